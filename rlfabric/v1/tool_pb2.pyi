from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCallStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CALL_STATUS_UNSPECIFIED: _ClassVar[ToolCallStatus]
    TOOL_CALL_STATUS_OK: _ClassVar[ToolCallStatus]
    TOOL_CALL_STATUS_TOOL_ERROR: _ClassVar[ToolCallStatus]
    TOOL_CALL_STATUS_TIMEOUT: _ClassVar[ToolCallStatus]
    TOOL_CALL_STATUS_INVALID_ARGUMENTS: _ClassVar[ToolCallStatus]
TOOL_CALL_STATUS_UNSPECIFIED: ToolCallStatus
TOOL_CALL_STATUS_OK: ToolCallStatus
TOOL_CALL_STATUS_TOOL_ERROR: ToolCallStatus
TOOL_CALL_STATUS_TIMEOUT: ToolCallStatus
TOOL_CALL_STATUS_INVALID_ARGUMENTS: ToolCallStatus

class ListToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ToolInfo(_message.Message):
    __slots__ = ("name", "description", "schema_json", "implementation", "max_concurrency", "default_deadline_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    schema_json: str
    implementation: str
    max_concurrency: int
    default_deadline_s: float
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., schema_json: _Optional[str] = ..., implementation: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., default_deadline_s: _Optional[float] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "server_id")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolInfo]
    server_id: str
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolInfo, _Mapping]]] = ..., server_id: _Optional[str] = ...) -> None: ...

class ToolCallRequest(_message.Message):
    __slots__ = ("call_id", "name", "arguments_json", "deadline_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments_json: str
    deadline_s: float
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class ToolCallResponse(_message.Message):
    __slots__ = ("call_id", "status", "text", "latency_s", "error", "server_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    status: ToolCallStatus
    text: str
    latency_s: float
    error: str
    server_id: str
    def __init__(self, call_id: _Optional[str] = ..., status: _Optional[_Union[ToolCallStatus, str]] = ..., text: _Optional[str] = ..., latency_s: _Optional[float] = ..., error: _Optional[str] = ..., server_id: _Optional[str] = ...) -> None: ...

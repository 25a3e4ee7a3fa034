from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierSpec(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sample_id", "response", "ground_truth", "verifiers", "prompt", "deadline_s")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    response: str
    ground_truth: str
    verifiers: _containers.RepeatedCompositeFieldContainer[VerifierSpec]
    prompt: str
    deadline_s: float
    def __init__(self, sample_id: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., verifiers: _Optional[_Iterable[_Union[VerifierSpec, _Mapping]]] = ..., prompt: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class ScoreRequestBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreResponseBatch(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("sample_id", "scores", "reward", "worker_id")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    scores: _containers.RepeatedCompositeFieldContainer[_common_pb2.VerifierScore]
    reward: float
    worker_id: str
    def __init__(self, sample_id: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[_common_pb2.VerifierScore, _Mapping]]] = ..., reward: _Optional[float] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ListVerifiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("name", "version", "builtin", "endpoint", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    builtin: bool
    endpoint: str
    description: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., builtin: _Optional[bool] = ..., endpoint: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class ListVerifiersResponse(_message.Message):
    __slots__ = ("verifiers",)
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    verifiers: _containers.RepeatedCompositeFieldContainer[VerifierInfo]
    def __init__(self, verifiers: _Optional[_Iterable[_Union[VerifierInfo, _Mapping]]] = ...) -> None: ...

class RegisterVerifierRequest(_message.Message):
    __slots__ = ("name", "version", "endpoint", "timeout_s", "max_concurrency", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    endpoint: str
    timeout_s: float
    max_concurrency: int
    description: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., endpoint: _Optional[str] = ..., timeout_s: _Optional[float] = ..., max_concurrency: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class RegisterVerifierResponse(_message.Message):
    __slots__ = ("verifier",)
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    verifier: VerifierInfo
    def __init__(self, verifier: _Optional[_Union[VerifierInfo, _Mapping]] = ...) -> None: ...

class UnregisterVerifierRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterVerifierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

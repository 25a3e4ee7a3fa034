from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_PHASE_UNSPECIFIED: _ClassVar[RunPhase]
    RUN_PHASE_STARTING: _ClassVar[RunPhase]
    RUN_PHASE_ROLLOUT: _ClassVar[RunPhase]
    RUN_PHASE_SCORING: _ClassVar[RunPhase]
    RUN_PHASE_UPDATE: _ClassVar[RunPhase]
    RUN_PHASE_WEIGHT_SYNC: _ClassVar[RunPhase]
    RUN_PHASE_CHECKPOINT: _ClassVar[RunPhase]
    RUN_PHASE_DONE: _ClassVar[RunPhase]
    RUN_PHASE_STOPPED: _ClassVar[RunPhase]
    RUN_PHASE_FAILED: _ClassVar[RunPhase]
RUN_PHASE_UNSPECIFIED: RunPhase
RUN_PHASE_STARTING: RunPhase
RUN_PHASE_ROLLOUT: RunPhase
RUN_PHASE_SCORING: RunPhase
RUN_PHASE_UPDATE: RunPhase
RUN_PHASE_WEIGHT_SYNC: RunPhase
RUN_PHASE_CHECKPOINT: RunPhase
RUN_PHASE_DONE: RunPhase
RUN_PHASE_STOPPED: RunPhase
RUN_PHASE_FAILED: RunPhase

class StartRunRequest(_message.Message):
    __slots__ = ("run_id", "config_yaml", "overrides", "resume")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    resume: bool
    def __init__(self, run_id: _Optional[str] = ..., config_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., resume: _Optional[bool] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("run_id", "from_iteration")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ITERATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_iteration: int
    def __init__(self, run_id: _Optional[str] = ..., from_iteration: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "phase", "iteration", "total_iterations", "weights_version", "error", "checkpoint")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    phase: RunPhase
    iteration: int
    total_iterations: int
    weights_version: int
    error: str
    checkpoint: str
    def __init__(self, run_id: _Optional[str] = ..., phase: _Optional[_Union[RunPhase, str]] = ..., iteration: _Optional[int] = ..., total_iterations: _Optional[int] = ..., weights_version: _Optional[int] = ..., error: _Optional[str] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class IterationMetrics(_message.Message):
    __slots__ = ("run_id", "iteration", "metrics")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    metrics: _common_pb2.Metrics
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., metrics: _Optional[_Union[_common_pb2.Metrics, _Mapping]] = ...) -> None: ...

from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("group", "expected_weights_version", "sampling", "interrupt")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.PromptGroup
    expected_weights_version: int
    sampling: _common_pb2.SamplingParams
    interrupt: bool
    def __init__(self, group: _Optional[_Union[_common_pb2.PromptGroup, _Mapping]] = ..., expected_weights_version: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., interrupt: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ...) -> None: ...

class WeightUpdateChunk(_message.Message):
    __slots__ = ("bucket", "commit")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    bucket: _common_pb2.WeightBucket
    commit: _common_pb2.WeightCommit
    def __init__(self, bucket: _Optional[_Union[_common_pb2.WeightBucket, _Mapping]] = ..., commit: _Optional[_Union[_common_pb2.WeightCommit, _Mapping]] = ...) -> None: ...

class WeightUpdateAck(_message.Message):
    __slots__ = ("version", "checksum", "num_tensors", "num_bytes", "duration_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: int
    num_tensors: int
    num_bytes: int
    duration_s: float
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("duration_s", "resident_bytes")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    resident_bytes: int
    def __init__(self, duration_s: _Optional[float] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class WakeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeResponse(_message.Message):
    __slots__ = ("duration_s", "resident_bytes")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    resident_bytes: int
    def __init__(self, duration_s: _Optional[float] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class RolloutInfoRequest(_message.Message):
    __slots__ = ("include_parameters",)
    INCLUDE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    include_parameters: bool
    def __init__(self, include_parameters: _Optional[bool] = ...) -> None: ...

class ParameterInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _common_pb2.DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("model", "engine", "tensor_parallel_size", "weights_version", "sleeping", "parameters", "max_model_len", "dtype", "max_samples_per_group", "returns_routed_experts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    RETURNS_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine: str
    tensor_parallel_size: int
    weights_version: int
    sleeping: bool
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    max_model_len: int
    dtype: _common_pb2.DType
    max_samples_per_group: int
    returns_routed_experts: bool
    def __init__(self, model: _Optional[str] = ..., engine: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., weights_version: _Optional[int] = ..., sleeping: _Optional[bool] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., max_samples_per_group: _Optional[int] = ..., returns_routed_experts: _Optional[bool] = ...) -> None: ...

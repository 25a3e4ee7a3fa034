from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_INTERRUPTED: _ClassVar[FinishReason]

class CollectiveBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_BACKEND_UNSPECIFIED: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_GLOO: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_NCCL: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_HCCL: _ClassVar[CollectiveBackend]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_BOOL: DType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_INTERRUPTED: FinishReason
COLLECTIVE_BACKEND_UNSPECIFIED: CollectiveBackend
COLLECTIVE_BACKEND_GLOO: CollectiveBackend
COLLECTIVE_BACKEND_NCCL: CollectiveBackend
COLLECTIVE_BACKEND_HCCL: CollectiveBackend

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "has_temperature", "top_p", "top_k", "min_p", "logprobs", "seed", "has_seed")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    HAS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    has_temperature: bool
    top_p: float
    top_k: int
    min_p: float
    logprobs: int
    seed: int
    has_seed: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., has_temperature: _Optional[bool] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "prompt_token_ids", "n")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_token_ids: Tensor
    n: int
    def __init__(self, group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "group_id", "index", "response_token_ids", "response_log_probs", "weights_version", "finish_reason", "prompt_length", "response_length", "error", "latency_s", "routed_experts", "response_mask", "response_token_versions")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    group_id: str
    index: int
    response_token_ids: Tensor
    response_log_probs: Tensor
    weights_version: int
    finish_reason: FinishReason
    prompt_length: int
    response_length: int
    error: str
    latency_s: float
    routed_experts: Tensor
    response_mask: Tensor
    response_token_versions: Tensor
    def __init__(self, sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., index: _Optional[int] = ..., response_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_log_probs: _Optional[_Union[Tensor, _Mapping]] = ..., weights_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_length: _Optional[int] = ..., response_length: _Optional[int] = ..., error: _Optional[str] = ..., latency_s: _Optional[float] = ..., routed_experts: _Optional[_Union[Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., response_token_versions: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class VerifierScore(_message.Message):
    __slots__ = ("verifier", "version", "score", "error", "latency_s")
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    verifier: str
    version: str
    score: float
    error: str
    latency_s: float
    def __init__(self, verifier: _Optional[str] = ..., version: _Optional[str] = ..., score: _Optional[float] = ..., error: _Optional[str] = ..., latency_s: _Optional[float] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("version", "index", "tensors", "checksum", "shm", "collective")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    checksum: int
    shm: SharedMemoryRef
    collective: CollectiveRef
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., checksum: _Optional[int] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., collective: _Optional[_Union[CollectiveRef, _Mapping]] = ...) -> None: ...

class CollectiveRef(_message.Message):
    __slots__ = ("store_address", "group_id", "world_size", "backend", "timeout_s", "push_id")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    group_id: str
    world_size: int
    backend: CollectiveBackend
    timeout_s: float
    push_id: str
    def __init__(self, store_address: _Optional[str] = ..., group_id: _Optional[str] = ..., world_size: _Optional[int] = ..., backend: _Optional[_Union[CollectiveBackend, str]] = ..., timeout_s: _Optional[float] = ..., push_id: _Optional[str] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("path", "segment_id", "size", "offsets")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    path: str
    segment_id: str
    size: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., segment_id: _Optional[str] = ..., size: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightCommit(_message.Message):
    __slots__ = ("version", "num_buckets", "checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_buckets: int
    checksum: int
    def __init__(self, version: _Optional[int] = ..., num_buckets: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

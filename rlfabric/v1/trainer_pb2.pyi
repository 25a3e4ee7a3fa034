from rlfabric.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GRPC_STREAM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_COLLECTIVE: _ClassVar[WeightTransport]
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_GRPC_STREAM: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_COLLECTIVE: WeightTransport

class SequenceBatch(_message.Message):
    __slots__ = ("sample_ids", "token_ids", "prompt_lengths", "response_lengths", "weights_version", "routed_experts", "response_mask")
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _common_pb2.Tensor
    prompt_lengths: _common_pb2.Tensor
    response_lengths: _common_pb2.Tensor
    weights_version: int
    routed_experts: _common_pb2.Tensor
    response_mask: _common_pb2.Tensor
    def __init__(self, sample_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., response_lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., weights_version: _Optional[int] = ..., routed_experts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LogProbRequest(_message.Message):
    __slots__ = ("batch", "temperature", "with_entropy", "adapters_off")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WITH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_OFF_FIELD_NUMBER: _ClassVar[int]
    batch: SequenceBatch
    temperature: float
    with_entropy: bool
    adapters_off: bool
    def __init__(self, batch: _Optional[_Union[SequenceBatch, _Mapping]] = ..., temperature: _Optional[float] = ..., with_entropy: _Optional[bool] = ..., adapters_off: _Optional[bool] = ...) -> None: ...

class ValueRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: SequenceBatch
    def __init__(self, batch: _Optional[_Union[SequenceBatch, _Mapping]] = ...) -> None: ...

class ValueResponse(_message.Message):
    __slots__ = ("sample_ids", "values", "weights_version")
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    values: _common_pb2.Tensor
    weights_version: int
    def __init__(self, sample_ids: _Optional[_Iterable[str]] = ..., values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., weights_version: _Optional[int] = ...) -> None: ...

class LogProbResponse(_message.Message):
    __slots__ = ("sample_ids", "log_probs", "entropy", "weights_version")
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    log_probs: _common_pb2.Tensor
    entropy: _common_pb2.Tensor
    weights_version: int
    def __init__(self, sample_ids: _Optional[_Iterable[str]] = ..., log_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., weights_version: _Optional[int] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("batch", "advantages", "old_log_probs", "ref_log_probs", "temperature", "step", "kl_coef", "behavior_log_probs", "token_advantages", "returns", "values", "batch_rows")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OLD_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    batch: SequenceBatch
    advantages: _common_pb2.Tensor
    old_log_probs: _common_pb2.Tensor
    ref_log_probs: _common_pb2.Tensor
    temperature: float
    step: int
    kl_coef: float
    behavior_log_probs: _common_pb2.Tensor
    token_advantages: _common_pb2.Tensor
    returns: _common_pb2.Tensor
    values: _common_pb2.Tensor
    batch_rows: int
    def __init__(self, batch: _Optional[_Union[SequenceBatch, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_log_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ref_log_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., step: _Optional[int] = ..., kl_coef: _Optional[float] = ..., behavior_log_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., token_advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("metrics", "weights_version", "num_tokens")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    metrics: _common_pb2.Metrics
    weights_version: int
    num_tokens: int
    def __init__(self, metrics: _Optional[_Union[_common_pb2.Metrics, _Mapping]] = ..., weights_version: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("dir", "iteration", "consumed_samples")
    DIR_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    dir: str
    iteration: int
    consumed_samples: int
    def __init__(self, dir: _Optional[str] = ..., iteration: _Optional[int] = ..., consumed_samples: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("dir", "iteration", "finetune", "no_load_optim", "no_load_rng")
    DIR_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    FINETUNE_FIELD_NUMBER: _ClassVar[int]
    NO_LOAD_OPTIM_FIELD_NUMBER: _ClassVar[int]
    NO_LOAD_RNG_FIELD_NUMBER: _ClassVar[int]
    dir: str
    iteration: int
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    def __init__(self, dir: _Optional[str] = ..., iteration: _Optional[int] = ..., finetune: _Optional[bool] = ..., no_load_optim: _Optional[bool] = ..., no_load_rng: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "iteration", "consumed_samples", "duration_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    iteration: int
    consumed_samples: int
    duration_s: float
    def __init__(self, path: _Optional[str] = ..., iteration: _Optional[int] = ..., consumed_samples: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("version", "targets", "bucket_bytes", "transport", "plan")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    version: int
    targets: _containers.RepeatedScalarFieldContainer[str]
    bucket_bytes: int
    transport: WeightTransport
    plan: ReshardPlan
    def __init__(self, version: _Optional[int] = ..., targets: _Optional[_Iterable[str]] = ..., bucket_bytes: _Optional[int] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., plan: _Optional[_Union[ReshardPlan, _Mapping]] = ...) -> None: ...

class ReshardPlan(_message.Message):
    __slots__ = ("trainer_tensor_parallel_size", "trainer_pipeline_parallel_size", "dtype", "tensors", "trainer_expert_parallel_size")
    TRAINER_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EXPERT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    trainer_tensor_parallel_size: int
    trainer_pipeline_parallel_size: int
    dtype: _common_pb2.DType
    tensors: _containers.RepeatedCompositeFieldContainer[PlannedTensor]
    trainer_expert_parallel_size: int
    def __init__(self, trainer_tensor_parallel_size: _Optional[int] = ..., trainer_pipeline_parallel_size: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., tensors: _Optional[_Iterable[_Union[PlannedTensor, _Mapping]]] = ..., trainer_expert_parallel_size: _Optional[int] = ...) -> None: ...

class PlannedTensor(_message.Message):
    __slots__ = ("name", "shape", "concat_dim", "sources", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONCAT_DIM_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    concat_dim: int
    sources: _containers.RepeatedCompositeFieldContainer[ShardSlice]
    dtype: _common_pb2.DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., concat_dim: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[ShardSlice, _Mapping]]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class ShardSlice(_message.Message):
    __slots__ = ("name", "tp_rank", "pp_rank", "shard_shape", "groups", "start", "stop", "ep_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_SHAPE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    tp_rank: int
    pp_rank: int
    shard_shape: _containers.RepeatedScalarFieldContainer[int]
    groups: int
    start: int
    stop: int
    ep_rank: int
    def __init__(self, name: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., shard_shape: _Optional[_Iterable[int]] = ..., groups: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., ep_rank: _Optional[int] = ...) -> None: ...

class PushWeightsProgress(_message.Message):
    __slots__ = ("target", "bytes_sent", "bytes_total", "done", "checksum", "elapsed_s")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    target: str
    bytes_sent: int
    bytes_total: int
    done: bool
    checksum: int
    elapsed_s: float
    def __init__(self, target: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., checksum: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("params", "grads", "optimizer")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    params: bool
    grads: bool
    optimizer: bool
    def __init__(self, params: _Optional[bool] = ..., grads: _Optional[bool] = ..., optimizer: _Optional[bool] = ...) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("duration_s", "bytes", "resident_bytes")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    bytes: int
    resident_bytes: int
    def __init__(self, duration_s: _Optional[float] = ..., bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class OnloadRequest(_message.Message):
    __slots__ = ("params", "grads", "optimizer")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    params: bool
    grads: bool
    optimizer: bool
    def __init__(self, params: _Optional[bool] = ..., grads: _Optional[bool] = ..., optimizer: _Optional[bool] = ...) -> None: ...

class TrainerInfoRequest(_message.Message):
    __slots__ = ("include_parameters",)
    INCLUDE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    include_parameters: bool
    def __init__(self, include_parameters: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("name", "shape", "tp_rank", "pp_rank", "partition_dim", "ep_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_DIM_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    tp_rank: int
    pp_rank: int
    partition_dim: int
    ep_rank: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., partition_dim: _Optional[int] = ..., ep_rank: _Optional[int] = ...) -> None: ...

class TrainerInfo(_message.Message):
    __slots__ = ("role", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "weights_version", "iteration", "shards", "dtype")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    role: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    weights_version: int
    iteration: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    dtype: _common_pb2.DType
    def __init__(self, role: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., weights_version: _Optional[int] = ..., iteration: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

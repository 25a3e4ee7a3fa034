"""What a memory plan is computed from: the model's shape, each trainer role's layout and batches, the rollout's
engine settings, the placement and offload choices (services/planning/plan.py reads them from a config and
evaluates them)."""

from __future__ import annotations

import dataclasses

from services.planning.activations import Kernels, MicroBatch, Recompute, TrainShape
from services.planning.arithmetic import ModelShape
from services.planning.experts import ExpertLayout


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """A trainer role's layout and batches."""

    tp: int
    pp: int
    dp: int
    params_bytes: int  # 2 bf16, 4 fp32
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    kernels: Kernels = Kernels(False, False, False, False)
    recompute: Recompute = Recompute()
    update: MicroBatch | None = None  # None: no update (the reference)
    micro_batches: int = 1  # per DP rank and optimizer step (1F1B in-flight bound)
    forward: MicroBatch = MicroBatch(1, 1, 1)
    experts: ExpertLayout | None = None  # MoE: megatron-core's expert layout (None: ep 1, etp = tp)
    tp_extend_ep: bool = False  # MindSpeed's moe_tp_extend_ep: the layout follows TP as EP x TP, 1
    stages: tuple[int, ...] | None = None  # the model's layers on each pipeline stage (None: an even split)

    def shape(self, recompute: Recompute | None = None) -> TrainShape:
        return TrainShape(tp=self.tp, sequence_parallel=self.sequence_parallel, act_bytes=self.params_bytes,
                          kernels=self.kernels, recompute=self.recompute if recompute is None else recompute,
                          experts=self.experts)

    @property
    def expert_layout(self) -> ExpertLayout:
        return self.experts or ExpertLayout(ep=1, etp=self.tp)

    @property
    def expert_dp(self) -> int | None:
        """Megatron's expert-data-parallel size (the distributed optimizer's group for expert state)."""
        return self.expert_layout.expert_dp(tp=self.tp, dp=self.dp)

    def with_tp(self, tp: int, dp: int) -> TrainerLayout:
        """The layout at another TP (and DP), its expert layout following as the config's keys make it."""
        experts = self.experts
        if experts is not None:
            experts = ExpertLayout(ep=experts.ep * tp // self.tp, etp=1) if self.tp_extend_ep else \
                ExpertLayout(ep=experts.ep, etp=tp)
        return dataclasses.replace(self, tp=tp, dp=dp, experts=experts)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    infer_tp: int
    weight_bytes: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int


@dataclasses.dataclass(frozen=True)
class Offload:
    param: bool = False
    grad: bool = False
    optimizer: bool = False


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    device_memory: int
    actor: TrainerLayout
    reference: TrainerLayout | None
    rollout: RolloutLayout
    integrated: bool
    offload: Offload = Offload()
    skip_old_log_probs: bool = False
    keys: dict[str, str] = dataclasses.field(default_factory=dict)  # knob -> the YAML key that sets it
    notes: tuple[str, ...] = ()

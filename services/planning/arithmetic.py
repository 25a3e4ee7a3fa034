"""Memory formulas of one device: weights, gradients, optimizer state, vLLM KV cache.

Pure functions of a model shape and a parallel layout (no torch, no config); docs/memory.md derives each
term. All results are bytes on one device (one TP x PP rank, or one rollout engine rank).

State (Megatron mixed precision, the `bf16: true` of every upstream config): bf16 weights (2 bytes/param),
fp32 main gradients (4; Megatron turns on `accumulate_allreduce_grads_in_fp32` under bf16), fp32 master
weights (4) and Adam's two fp32 moments (8). In fp32 the weights are their own master (no copy). The
distributed optimizer divides master weights and moments (not gradients: each rank keeps the full fp32 grad
buffer and reduce-scatters it) by the data-parallel size.

Activations and logits (what each pipeline stage keeps for backward, per micro-batch, under each kernel set and
recompute mode) are services/planning/activations.py's.

Mixture-of-experts models (Qwen3-MoE) add their routers and experts to the parameters, optimizer state (sharded
over the expert-data-parallel group) and activations of their MoE layers: services/planning/experts.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from services.planning.experts import ExpertLayout, Experts

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder (Qwen2 / Qwen2.5 / Qwen3 / Llama, Qwen3-MoE with `experts`): what the formulas need of it."""

    num_layers: int
    hidden: int
    ffn: int  # per gate of SwiGLU
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # padded vocabulary (rows of the embedding)
    tied: bool  # output layer shares the embedding
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: Experts | None = None  # None: a dense model

    @classmethod
    def from_spec(cls, spec) -> ModelShape:
        """From a `services.common.model_spec.ModelSpec` (an HF config.json)."""
        moe = spec.moe
        experts = None if moe is None else Experts(num_experts=moe.num_experts, ffn=moe.moe_intermediate_size,
                                                   topk=moe.num_experts_per_tok, layers=tuple(moe.moe_layers))
        return cls(num_layers=spec.num_hidden_layers, hidden=spec.hidden_size, ffn=spec.intermediate_size,
                   heads=spec.num_attention_heads, kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                   vocab=spec.vocab_size, tied=spec.tie_word_embeddings, qkv_bias=spec.attention_bias,
                   qk_norm=spec.qk_norm, experts=experts)

    def moe_layers(self, first: int = 0, count: int | None = None) -> int:
        """How many of layers first .. first + count - 1 (default: all) are MoE layers."""
        count = self.num_layers - first if count is None else count
        return 0 if self.experts is None else self.experts.layers_in(first, count)

    def layer_split_params(self, moe: bool = False) -> int:
        """Parameters of one layer that tensor parallelism splits (linear weights, QKV bias; not the experts)."""
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        weights = self.hidden * qkv_out + self.heads * self.head_dim * self.hidden
        return weights + (qkv_out if self.qkv_bias else 0) + (0 if moe else 3 * self.hidden * self.ffn)

    def layer_replicated_params(self, moe: bool = False) -> int:
        """Parameters of one layer every TP rank holds whole (the two RMSNorms, the per-head q/k norms, the router)."""
        router = self.experts.router_params(self.hidden) if moe and self.experts is not None else 0
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0) + router

    def total_params(self, *, active: bool = False) -> int:
        """Every parameter; `active`: those one token goes through (top-k of the experts of each MoE layer)."""
        n_moe = self.moe_layers()
        dense = (self.num_layers - n_moe) * (self.layer_split_params() + self.layer_replicated_params())
        moe = n_moe * (self.layer_split_params(True) + self.layer_replicated_params(True))
        if self.experts is not None:
            e = self.experts
            moe += n_moe * e.expert_params(self.hidden) * (e.topk if active else e.num_experts) // e.num_experts
        return dense + moe + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


Stages = Sequence[int] | None  # the model's layers on each pipeline stage (num_layer_list, noop_layers); None: even


def stage_span(num_layers: int, pp: int, stage: int, stages: Stages = None) -> tuple[int, int]:
    """(first layer, layer count) of pipeline stage `stage`: the trainer's layout `stages` (the model's layers on
    each stage, services/common/pipeline_layout.py), else an even split."""
    if stages is not None:
        if len(stages) != pp or sum(stages) != num_layers:
            raise ValueError(f"stage layers {list(stages)} do not place {num_layers} layers on {pp} pipeline stages")
        return sum(stages[:stage]), stages[stage]
    if num_layers % pp:
        raise ValueError(f"num_layers {num_layers} does not divide by pipeline_model_parallel_size {pp}")
    per = num_layers // pp
    return stage * per, per


def rank_params(shape: ModelShape, *, tp: int, pp: int, stage: int, experts: ExpertLayout | None = None,
                stages: Stages = None) -> int:
    """Parameters one TP rank of pipeline stage `stage` holds, its experts (`rank_expert_params`) included.

    `experts`: the expert layout (default Megatron's without expert parallelism: ep 1, etp = tp). `stages`: the
    layers of each stage (`stage_span`).
    """
    first, per_stage = stage_span(shape.num_layers, pp, stage, stages)
    n_moe = shape.moe_layers(first, per_stage)
    n = (per_stage - n_moe) * (shape.layer_split_params() // tp + shape.layer_replicated_params())
    n += n_moe * (shape.layer_split_params(True) // tp + shape.layer_replicated_params(True))
    n += rank_expert_params(shape, pp=pp, stage=stage, experts=experts or ExpertLayout(ep=1, etp=tp), stages=stages)
    vocab_shard = ceil_div(shape.vocab, tp) * shape.hidden
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += shape.hidden  # final norm
        if not shape.tied or pp > 1:  # tied weights across stages: the last stage keeps its own copy
            n += vocab_shard
    return n


def rank_expert_params(shape: ModelShape, *, pp: int, stage: int, experts: ExpertLayout, stages: Stages = None
                       ) -> int:
    """Expert parameters one rank of pipeline stage `stage` holds (0 for a dense model)."""
    if shape.experts is None:
        return 0
    first, per_stage = stage_span(shape.num_layers, pp, stage, stages)
    return shape.moe_layers(first, per_stage) * experts.params_per_layer(shape.experts, shape.hidden)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of model and optimizer state on one device: predicted here, counted by services/trainer/memory.py."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer_states: int = 0

    @property
    def optimizer(self) -> int:
        """Master weights + optimizer states: what `memory/*/optimizer_bytes` reports."""
        return self.master + self.optimizer_states

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states


def training_state(n_params: int, *, params_bytes: int, distributed_optimizer: bool, dp: int,
                   expert_params: int = 0, expert_dp: int = 1) -> StateBytes:
    """Weights, fp32 gradients, fp32 master weights (mixed precision only) and Adam moments of `n_params`.

    `expert_params` of the `n_params` are experts: the distributed optimizer shards their master weights and
    moments over the expert-data-parallel group (`expert_dp` ranks), the others' over DP.
    """
    mixed = params_bytes < 4
    master = moments = 0
    for n, group in ((n_params - expert_params, dp), (expert_params, expert_dp)):
        m, o = (4 * n if mixed else 0), 8 * n
        if distributed_optimizer and group > 1:
            m, o = ceil_div(m, group), ceil_div(o, group)
        master, moments = master + m, moments + o
    return StateBytes(params=params_bytes * n_params, grads=4 * n_params, master=master, optimizer_states=moments)



@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """One vLLM engine rank: its share of gpu_memory_utilization x device memory."""

    budget: int
    weights: int
    activations: int  # estimate of vLLM's profile run (largest layer working set and the sampler's logits)
    kv_cache: int
    kv_bytes_per_token: int

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_cache, 0) // self.kv_bytes_per_token


def rollout_memory(m: ModelShape, *, infer_tp: int, weight_bytes: int, kv_bytes: int, device_memory: int,
                   gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> RolloutMemory:
    """vLLM takes gpu_memory_utilization x device memory; what weights and activations leave is KV cache.

    Weights: the whole model split over the engine's TP ranks, every expert included: vLLM splits each expert
    over them, or with enable_expert_parallel places num_experts / TP whole experts on each (an rlfabric engine
    is one vLLM data-parallel rank, so its expert-parallel size is its TP): the same bytes. KV per token: K and
    V of every layer for this rank's KV heads (vLLM replicates KV heads when the engine's TP exceeds their number).
    """
    budget = int(gpu_memory_utilization * device_memory)
    weights = rank_params(m, tp=infer_tp, pp=1, stage=0) * weight_bytes
    kv_heads = max(m.kv_heads // infer_tp, 1)
    per_token = 2 * m.num_layers * kv_heads * m.head_dim * kv_bytes
    t = max_num_batched_tokens
    mlp = 3 * m.ffn // infer_tp if m.moe_layers() < m.num_layers else 0
    if m.experts is not None:  # fused MoE: each token's top-k copies through FC1 (2 f_moe), FC2's input, output
        mlp = max(mlp, m.experts.topk * (3 * m.experts.ffn // infer_tp + m.hidden))
    acts = t * (mlp + 4 * m.hidden) * weight_bytes \
        + max_num_seqs * m.vocab * (weight_bytes + 8)  # logits, fp32 logits and log-probs of the sampler
    return RolloutMemory(budget=budget, weights=weights, activations=acts,
                         kv_cache=budget - weights - acts, kv_bytes_per_token=per_token)


def parse_size(text: str) -> int:
    """'64GiB', '64G', '80GB', '1.5TiB', '123456' -> bytes (G/GiB binary, GB decimal)."""
    s = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20, "mib": 1 << 20,
             "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40,
             "tb": 10 ** 12}
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i], s[i:].lower()
    if unit not in units or not number:
        raise ValueError(f"device memory {text!r}: expected a size such as 64GiB, 80GB or 141G")
    value = float(number) * units[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"device memory {text!r} must be a positive size")
    return int(value)

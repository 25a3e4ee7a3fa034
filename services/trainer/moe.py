"""Mixture-of-experts (Qwen3-MoE) on Megatron-core's MoELayer: config, expert weights by name, router metrics.

Owns what the trainer adds for a MoE `ModelSpec` (`spec.moe`, read from the HF config):
- `transformer_config_kwargs`: the MoE fields of Megatron's TransformerConfig. Routing matches HF's
  `Qwen3MoeTopKRouter`: a softmax over all experts in fp32, the top-k, renormalised when `norm_topk_prob`.
  Megatron's softmax router gives exactly that: with `norm_topk_prob` the top-k of the logits and a softmax
  over those k (`moe_router_pre_softmax=False`; softmax is monotonic, so the same experts, and the softmax of
  the chosen logits is the renormalised full softmax), without it the top-k of the full softmax
  (`moe_router_pre_softmax=True`). Routed experts only (Qwen3-MoE has no shared expert), dropless (no
  capacity factor, as HF), `moe_layer_freq` from the HF config's MoE layers, local experts as Megatron's
  SequentialMLP (`moe_grouped_gemm` off: no grouped-GEMM kernel on a CPU). The YAML's training keys
  (`moe_aux_loss_coeff`, `moe_router_load_balancing_type`, `moe_token_dispatcher_type`) arrive as
  `MoeOptions`; the HF config's `router_aux_loss_coef` does not train (MindSpeed-RL reads the YAML's).
  DeepSeek-V3 (model_spec.MoeSpec): Megatron's sigmoid router with the expert bias (HF's `e_score_correction_bias`,
  fp32 logits as HF's), group-limited top-k, the routed scaling factor and the shared experts; its bias update is
  services/trainer/expert_bias.py's.
- Token dispatchers: "allgather" (Megatron's default) and "alltoall" both run on gloo ("alltoall" with the CPU
  patch in megatron_compat: its device-to-host copies run on a CUDA side stream). Megatron's allgather
  dispatcher all-gathers every rank's tokens of the EP x TP group into one tensor, which assumes every rank's
  micro-batch holds as many tokens, true of Megatron-LM's fixed [micro_batch_size, seq_length] batches but not
  of rlfabric's (padded to their own longest row, or packed; the DP ranks of an EP group hold different rows).
  `install` pads each rank's tokens to the group's largest count with rows routed to no expert (zero
  probabilities, all-False routing map: they reach no expert and combine to zero) and drops them after the
  combine, one small all-gather of the counts per MoE layer. "alltoall" exchanges per-expert counts itself.
- Equal micro-batch counts (`lockstep_data_parallel`, `inert_padding`): a MoE forward and backward are
  collectives over the EP (x expert-TP) group, whose ranks are different data-parallel ranks with their own rows,
  so every data-parallel rank must run as many micro-batches (packing.dp_groups pads with padding micro-batches).
  A padding micro-batch changes nothing: zero loss, its router's aux loss adds no gradient (the real ones' is
  scaled by 1 / their count, as without padding), and the MoE metrics and router statistics skip it.
- `ExpertLoad` and `moe_metrics`: the router's per-expert token counts and Megatron's tracked aux loss, as
  iteration metrics `moe/aux_loss` and `moe/expert_load_max_over_mean`.

The HF <-> Megatron names of the experts (expert-parallel rank r holds experts [r * E/EP, (r + 1) * E/EP),
renumbered from 0) live in services/common/weight_layout.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from services.common.model_spec import ModelSpec

TOKEN_DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# Megatron's names for the losses its router records in the aux-loss tracker, per load-balancing type.
_TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


@dataclasses.dataclass(frozen=True)
class MoeOptions:
    """The YAML's MoE training keys (MindSpeed-RL / Megatron names and defaults)."""

    moe_aux_loss_coeff: float = 0.0  # Megatron's default; MindSpeed-RL's config default is 0.001 (options.py reads it)
    moe_router_load_balancing_type: str = "aux_loss"
    moe_token_dispatcher_type: str = "allgather"
    # Aux-loss-free balancing of a router with expert bias (DeepSeek-V3): after each optimizer step the bias moves by
    # the rate towards under-loaded experts (expert_bias.update_expert_bias); off, the HF bias stays as loaded.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3  # Megatron's default

    def __post_init__(self) -> None:
        if self.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type {self.moe_token_dispatcher_type!r}: expected one of "
                             f"{', '.join(TOKEN_DISPATCHERS)}")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type {self.moe_router_load_balancing_type!r}: expected one "
                             f"of {', '.join(LOAD_BALANCING_TYPES)}")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")


def moe_layer_pattern(spec: ModelSpec) -> list[int]:
    """Megatron's `moe_layer_freq` as a list: 1 for a MoE layer, 0 for a dense one (model-wide)."""
    assert spec.moe is not None
    moe_layers = set(spec.moe.moe_layers)
    return [int(layer in moe_layers) for layer in range(spec.num_hidden_layers)]


def transformer_config_kwargs(spec: ModelSpec, opts: MoeOptions, *, ep: int, etp: int | None = None) -> dict:
    """TransformerConfig's MoE fields for `spec` ({} for a dense model); `etp` None: the TP size."""
    if spec.moe is None:
        return {}
    m = spec.moe
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.num_experts_per_tok,
        moe_ffn_hidden_size=m.moe_intermediate_size,
        moe_layer_freq=moe_layer_pattern(spec),
        moe_router_score_function=m.score_function,
        moe_router_pre_softmax=m.score_function == "softmax" and not m.norm_topk_prob,
        moe_router_topk_scaling_factor=m.routed_scaling_factor,
        # Qwen3-MoE: logits in the model dtype, softmax in fp32 (HF's router in any dtype); DeepSeek-V3's HF router
        # computes its logits in fp32.
        moe_router_dtype="fp32" if m.score_function == "sigmoid" else None,
        moe_shared_expert_intermediate_size=m.shared_expert_intermediate_size or None,
        # DeepSeek-V3 (model_spec: transformers' router; sigmoid normalised exactly when top-k > 1, as Megatron's).
        moe_router_num_groups=m.num_groups,
        moe_router_group_topk=m.group_topk,
        moe_router_enable_expert_bias=m.expert_bias,
        moe_router_bias_update_rate=opts.moe_router_bias_update_rate if opts.moe_router_enable_expert_bias else 0.0,
        moe_expert_capacity_factor=None,  # dropless, as HF
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        moe_router_load_balancing_type=opts.moe_router_load_balancing_type,
        moe_token_dispatcher_type=opts.moe_token_dispatcher_type,
        moe_grouped_gemm=False,  # SequentialMLP: one MLP per local expert (the grouped GEMM needs CUDA kernels)
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def install(model) -> None:
    """Lets the allgather dispatchers of `model` take token counts that differ over their EP x TP group."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    for module in model.modules():
        d = getattr(module, "token_dispatcher", None)
        if isinstance(d, MoEAllGatherTokenDispatcher) and (d.tp_size > 1 or d.ep_size > 1):
            _pad_to_group_max(d)


def _pad_to_group_max(dispatcher) -> None:
    import torch.distributed as dist

    dispatch, combine = dispatcher.token_dispatch, dispatcher.token_combine
    real: dict[str, int] = {}

    def token_dispatch(hidden_states: torch.Tensor, probs: torch.Tensor):
        group = dispatcher.tp_ep_group
        n = hidden_states.shape[0]
        counts = torch.empty(group.size(), dtype=torch.long, device=hidden_states.device)
        dist.all_gather_into_tensor(counts, torch.tensor([n], dtype=torch.long, device=hidden_states.device),
                                    group=group)
        pad = int(counts.max().item()) - n
        real.clear()
        if pad:
            real["n"] = n
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(pad, hidden_states.shape[1])])
            probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
            rmap = dispatcher.routing_map
            dispatcher.routing_map = torch.cat([rmap, rmap.new_zeros(pad, rmap.shape[1])])
        return dispatch(hidden_states, probs)

    def token_combine(hidden_states: torch.Tensor):
        out = combine(hidden_states)
        return out[: real["n"]] if real else out

    dispatcher.token_dispatch, dispatcher.token_combine = token_dispatch, token_combine


def routers(model) -> list:
    """Megatron TopKRouter modules of `model` (one per MoE layer of this stage), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


# Set on a model's routers while a padding micro-batch runs through them.
_PADDING_ATTR = "_rlfabric_padding"
# Router buffers that accumulate over forwards (global aux loss, aux-loss-free bias): padding leaves them as they were.
_ROUTER_STATS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")


def is_moe(model) -> bool:
    """Whether `model` is a mixture-of-experts model (also on a pipeline stage without MoE layers)."""
    from services.trainer.model import unwrap

    return bool(getattr(getattr(unwrap(model), "config", None), "num_moe_experts", None))


def lockstep_data_parallel(model) -> bool:
    """Whether every data-parallel rank must run as many micro-batches: a MoE model whose experts' collectives
    (the EP x expert-TP group, or a global aux loss's TP x DP group) span data-parallel ranks."""
    from megatron.core import parallel_state as ps

    from services.trainer.model import unwrap

    if not is_moe(model) or ps.get_data_parallel_world_size() == 1:
        return False
    config = unwrap(model).config
    if config.moe_router_load_balancing_type == "global_aux_loss" and config.moe_aux_loss_coeff > 0:
        return True
    return ps.get_expert_tensor_and_model_parallel_world_size() > ps.get_tensor_model_parallel_world_size()


class _AuxLossScale(torch.autograd.Function):
    """Identity on a stage's output whose backward, which runs before any router's of that micro-batch, sets
    the scale Megatron's MoEAuxLossAutoScaler gives the router aux losses' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), ctx.scale, device=grad.device))
        return grad, None


@contextlib.contextmanager
def inert_padding(model, micro_batches: Sequence[dict]) -> Iterator[None]:
    """While Megatron's schedule runs `micro_batches` through `model`, those marked `padding` change nothing
    (module docstring); a no-op when there are none. Forwards run in micro-batch order on every stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    padding = [bool(mb.get("padding")) for mb in micro_batches]
    if not any(padding):
        yield
        return
    real = len(padding) - sum(padding)
    # Megatron's scale without padding (no grad_scale_func): context-parallel size / micro-batches.
    scale = ps.get_context_parallel_world_size() / max(real, 1)
    mine = routers(model)
    forwards = iter(padding)
    saved: dict = {}

    def pre_hook(_module, _args) -> None:
        saved.clear()
        if next(forwards, False):
            saved["tracker"] = {k: v["values"].clone() for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()}
            saved["routers"] = [{n: getattr(r, n).clone() for n in _ROUTER_STATS if getattr(r, n, None) is not None}
                                for r in mine]
            for r in mine:
                setattr(r, _PADDING_ATTR, True)

    def hook(_module, _args, output):
        pad = bool(saved)
        if pad:
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            for name, values in saved["tracker"].items():
                tracker[name]["values"].copy_(values)
            for name in set(tracker) - set(saved["tracker"]):  # first recorded by this padding pass
                tracker[name]["values"].zero_()
            for r, stats in zip(mine, saved["routers"], strict=True):
                setattr(r, _PADDING_ATTR, False)
                for n, v in stats.items():
                    getattr(r, n).copy_(v)
            saved.clear()
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            return _AuxLossScale.apply(output, 0.0 if pad else scale)
        return output

    handles = [model.register_forward_pre_hook(pre_hook), model.register_forward_hook(hook)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for r in mine:
            setattr(r, _PADDING_ATTR, False)


class ExpertLoad:
    """Counts the tokens each router sends to each expert (forward hooks; training and log-prob passes alike).

    `counts` is [moe layers of this stage, num_experts], summed over every forward since the last `reset`,
    on this rank's tokens only (`moe_metrics` sums the ranks).
    """

    def __init__(self, model) -> None:
        self._routers = routers(model)
        n = self._routers[0].config.num_moe_experts if self._routers else 0
        self.counts = torch.zeros(len(self._routers), n, dtype=torch.float64)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self._routers)]

    def _hook(self, i: int):
        def hook(module, _args, output) -> None:
            if getattr(module, _PADDING_ATTR, False):  # a padding micro-batch (inert_padding)
                return
            routing_map = output[1]  # [tokens, experts] bool
            self.counts[i] += routing_map.detach().sum(dim=0).to("cpu", torch.float64)
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def moe_metrics(model, load: ExpertLoad | None = None, *, num_micro_batches: float = 1) -> dict[str, float]:
    """`moe/aux_loss` and `moe/expert_load_max_over_mean` of the passes since the last call (a collective).

    `moe/aux_loss`: Megatron's tracked load-balancing loss (without its coefficient), mean over the MoE layers
    and over `num_micro_batches` (per data-parallel rank: their mean, where the ranks ran different counts), as
    Megatron's `track_moe_metrics` reports it; present when a router recorded
    one (a training pass with moe_aux_loss_coeff > 0). The tracker is cleared.
    `moe/expert_load_max_over_mean`: tokens routed to the busiest expert over the mean per expert, per MoE
    layer over all data-parallel ranks (and sequence slices), the worst layer; 1.0 is perfectly balanced.
    Both count every token the model saw, padding of padded micro-batches included (as Megatron's router does).
    Every rank of the group must call it (a stage without MoE layers too); every rank gets the same dict.
    """
    from megatron.core.transformer.moe import moe_utils

    from services.trainer.model import unwrap

    out: dict[str, float] = {}
    config = unwrap(model).config
    name = _TRACKED_LOSSES.get(config.moe_router_load_balancing_type)
    if config.num_moe_experts and name and config.moe_aux_loss_coeff > 0:
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if name not in tracker:  # this stage recorded nothing yet: join the reduction with zeros
            _init_tracker(tracker, name, config, next(unwrap(model).parameters()).device)
        moe_utils.reduce_aux_losses_tracker_across_ranks([name])
        total = float(tracker[name]["values"].float().sum().item())
        moe_utils.clear_aux_losses_tracker()
        if total != 0.0:  # a recorded switch loss is positive; zero means no training pass ran
            out["moe/aux_loss"] = total / _num_moe_layers(config) / max(num_micro_batches, 1)
    if load is not None:
        out.update(_expert_load(model, load))
    return out


def _init_tracker(tracker: dict, name: str, config, device: torch.device) -> None:
    """The entry Megatron's router would have made (router.py, attach_and_log_load_balancing_loss)."""
    from megatron.core import parallel_state as ps

    global_loss = name == _TRACKED_LOSSES["global_aux_loss"]
    group = (ps.get_tensor_and_data_parallel_group(with_context_parallel=True) if global_loss
             else ps.get_tensor_and_context_parallel_group())
    tracker[name] = {"values": torch.zeros(config.num_layers, device=device), "reduce_group": group,
                     "avg_group": None, "reduce_group_has_dp": global_loss}


def _num_moe_layers(config) -> int:
    freq = config.moe_layer_freq
    return sum(freq) if isinstance(freq, list) else len(range(0, config.num_layers, freq))


def _expert_load(model, load: ExpertLoad) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    counts = load.counts.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # The same tokens pass every TP rank unless sequence parallelism split them; DP ranks hold other rows.
        counts = counts.to(torch.float32)  # gloo all-reduces float64 too, but HCCL/NCCL parity is simpler in fp32
        groups = [ps.get_data_parallel_group(with_context_parallel=True)]
        from services.trainer.model import unwrap

        if unwrap(model).config.sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        device = comm_device()
        counts = counts.to(device)
        for g in groups:
            dist.all_reduce(counts, group=g)
        # Stages hold different layers: the worst layer of the model is the max over the pipeline.
        ratio = _max_over_mean(counts)
        ratio_t = torch.tensor([ratio], dtype=torch.float32, device=device)
        dist.all_reduce(ratio_t, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
        load.reset()
        return {"moe/expert_load_max_over_mean": float(ratio_t.item())}
    ratio = _max_over_mean(counts)
    load.reset()
    return {"moe/expert_load_max_over_mean": ratio}


def _max_over_mean(counts: torch.Tensor) -> float:
    """Worst layer's max/mean tokens per expert; 0.0 when no tokens were routed (no layer here, or no pass)."""
    if counts.numel() == 0:
        return 0.0
    mean = counts.double().mean(dim=1)
    seen = mean > 0
    if not bool(seen.any()):
        return 0.0
    return float((counts.double().max(dim=1).values[seen] / mean[seen]).max().item())


def comm_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("npu", torch.npu.current_device())

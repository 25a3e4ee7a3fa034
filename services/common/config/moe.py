"""Rules of the mixture-of-experts keys (Qwen3-MoE) as Megatron and MindSpeed apply them.

Expert layout (the actor's, and the reference's when `ref_config` gives it its own):
- Megatron refuses expert parallelism without experts (`num_experts`), an EP that does not divide
  num_experts, and an expert layout that does not fill the devices: EP x expert-TP x PP must divide them,
  which with the expert-TP of TP means EP divides DP x CP;
- MindSpeed's `moe_tp_extend_ep` keeps experts whole and lets the TP group extend expert parallelism (EP x
  TP ranks share the experts, expert-TP 1: the same device condition); its feature refuses a num_experts
  not divisible by TP x EP, and asks for `moe_grouped_gemm` and `moe_permutation_async_comm` with it.

Values: the router's top-k must lie in [1, num_experts]; the aux-loss coefficient must be >= 0; the
load-balancing types and token dispatchers are those upstream names that rlfabric's trainer runs (Sinkhorn
routing is not among them). The model block's own facts (experts, top-k, expert size, norm_topk_prob,
MoE layers) are compared with the config.json the model is built from (hf_check.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.config.megatron import MegatronConfig
    from services.common.config.resolved import RLFabricConfig
    from services.common.config.validation import Problem

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "alltoall_seq")


def _sections(cfg: RLFabricConfig) -> Iterator[tuple[str, MegatronConfig, int | None]]:
    """(key prefix, Megatron section, its DP x CP) of the actor, and of the reference when it has its own."""
    d = cfg.derived
    a = cfg.actor_config
    dp = d.actor_data_parallel_size
    yield "", a, None if dp is None else dp * a.context_parallel_size
    if cfg.ref_config is not a and d.ref_data_parallel_size is not None:
        r = cfg.ref_config
        yield "ref_config.", r, d.ref_data_parallel_size * r.context_parallel_size


def moe_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    for prefix, mt, dp_cp in _sections(cfg):
        yield from _layout(prefix, mt, dp_cp)
    yield from _values(cfg.actor_config)


def _layout(prefix: str, mt: MegatronConfig, dp_cp: int | None) -> Iterable[Problem]:
    from services.common.config.validation import Problem

    ep, tp, experts = mt.expert_model_parallel_size, mt.tensor_model_parallel_size, mt.num_experts
    key = f"{prefix}expert_model_parallel_size"
    if ep < 1 or tp < 1:
        return  # positive_sizes reports these
    if experts is None:
        if ep > 1:
            yield Problem((key,), f"{prefix}expert_model_parallel_size is {ep} but the model has no experts "
                                  f"(num_experts unset: a dense model); remove it or set it to 1")
        if mt.moe_tp_extend_ep:
            yield Problem((f"{prefix}moe_tp_extend_ep",), f"{prefix}moe_tp_extend_ep is true but the model has no "
                                                          f"experts (num_experts unset: a dense model); remove it")
        return
    if mt.moe_tp_extend_ep:
        if experts % (tp * ep):
            yield Problem((key, f"{prefix}moe_tp_extend_ep"),
                          f"num_experts ({experts}) must be divisible by tensor_model_parallel_size x "
                          f"expert_model_parallel_size ({tp} x {ep} = {tp * ep}) with moe_tp_extend_ep, which "
                          f"places whole experts on the TP ranks as well (MindSpeed's rule); choose an EP that "
                          f"divides {experts // tp if experts % tp == 0 else experts}")
        missing = [k for k in ("moe_grouped_gemm", "moe_permutation_async_comm") if not getattr(mt, k)]
        if missing:
            yield Problem((f"{prefix}moe_tp_extend_ep", *(prefix + k for k in missing)),
                          f"moe_tp_extend_ep needs {' and '.join(missing)} set to true, as MindSpeed requires; "
                          f"set {'them' if len(missing) > 1 else 'it'} or remove moe_tp_extend_ep")
    elif experts % ep:
        yield Problem((key,), f"{prefix}expert_model_parallel_size ({ep}) must divide num_experts ({experts}): each "
                              f"expert-parallel rank holds num_experts / EP whole experts")
    if dp_cp is not None and dp_cp % ep:
        yield Problem((key,),
                      f"{prefix}expert_model_parallel_size ({ep}) must divide the data-parallel x context-parallel "
                      f"size ({dp_cp}), as Megatron requires: EP x TP x PP ranks hold one copy of the experts and "
                      f"those copies must fill the devices; choose an EP that divides {dp_cp}")


def _values(a: MegatronConfig) -> Iterable[Problem]:
    from services.common.config.validation import Problem

    if a.num_experts is None:
        return
    if a.num_experts < 1:
        yield Problem(("num_experts",), f"num_experts must be at least 1 (or unset for a dense model), "
                                        f"got {a.num_experts}")
        return
    if not 1 <= a.moe_router_topk <= a.num_experts:
        yield Problem(("moe_router_topk", "num_experts"),
                      f"moe_router_topk ({a.moe_router_topk}) must be between 1 and num_experts ({a.num_experts})")
    if a.moe_aux_loss_coeff < 0:
        yield Problem(("moe_aux_loss_coeff",), f"moe_aux_loss_coeff must be >= 0, got {a.moe_aux_loss_coeff}")
    if a.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        yield Problem(("moe_router_load_balancing_type",),
                      f"unsupported moe_router_load_balancing_type `{a.moe_router_load_balancing_type}`; supported: "
                      f"{', '.join(LOAD_BALANCING_TYPES)} (Sinkhorn routing is not implemented by rlfabric's trainer)")
    if a.moe_token_dispatcher_type is not None and a.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
        yield Problem(("moe_token_dispatcher_type",),
                      f"unsupported moe_token_dispatcher_type `{a.moe_token_dispatcher_type}`; supported: "
                      f"{', '.join(TOKEN_DISPATCHERS)} (or unset: allgather)")

"""Aux-loss-free load balancing: the expert-bias update of a router with expert bias (DeepSeek-V3).

A DeepSeek-V3 router adds a per-expert bias (HF `e_score_correction_bias`, Megatron's router `expert_bias`) to its
sigmoid scores when it chooses experts, and weighs the chosen experts without it. Megatron-core trains that bias
outside the gradient (arXiv:2408.15664): every training forward counts the tokens each expert received
(`local_tokens_per_expert`; log-prob passes run without grad and count nothing, padding micro-batches are
restored by moe.inert_padding), and once per optimizer step `finalize_model_grads` sums the counts over the
tensor x context x data-parallel group and moves each bias by `moe_router_bias_update_rate` towards balance:
bias += rate x sign(mean count - count). `update_expert_bias` is that step for rlfabric's optimizer (which does
not run finalize_model_grads); it zeroes the counts after, as Megatron's `reset_model_temporary_tensors` does.

With `moe_router_enable_expert_bias` off in the YAML (MoeOptions), the rate in the TransformerConfig is 0 and the
bias stays as loaded, which is what the HF model computes; the counts are zeroed all the same.
"""

from __future__ import annotations

import torch


def update_expert_bias(model) -> None:
    """Megatron's per-step expert-bias update for every router of `model` with expert bias (a collective of the
    tensor x data-parallel group when the rate is > 0; a no-op for a model without one)."""
    from services.trainer import megatron_compat
    from services.trainer.model import unwrap
    from services.trainer.moe import routers

    mine = [r for r in routers(model) if getattr(r, "expert_bias", None) is not None]
    config = getattr(unwrap(model), "config", None)
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    if config.moe_router_bias_update_rate > 0:
        from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

        # Every rank of the group joins the all-reduce, also a pipeline stage without MoE layers (it has no router
        # and Megatron returns before reducing: the reduction is per stage, over ranks of the same stage).
        with megatron_compat.cpu_device_mode():
            _update_router_expert_bias([unwrap(model)], config)
    with torch.no_grad():
        for r in mine:
            r.local_tokens_per_expert.zero_()

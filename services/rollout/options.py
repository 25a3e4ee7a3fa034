"""What a rollout replica is configured with: engine options, default sampling values, and their checks.

Both mirror MindSpeed-RL's `generate_config` (`options_from_config` maps the YAML section). A field with a
`generate_config` key takes its default from the config schema (services/common/config/sections.py), the one
home of those defaults: a replica started without a config runs as one whose config sets none of the keys.
No vLLM and no gRPC here, so the CLI validates a configuration before it builds an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.common.config.sections import GenerateConfig

# generate_config (with sampling_config) as a config that sets none of its keys has it.
_SCHEMA_GENERATE = GenerateConfig()
_SCHEMA_SAMPLING = _SCHEMA_GENERATE.sampling_config


def _top_k(value: int) -> int:
    """sampling_config.top_k as SamplingOptions holds it: MindSpeed-RL's 0 (off) is -1 (off) here."""
    return -1 if int(value) == 0 else int(value)


class InvalidSamplingValueError(ValueError):
    """A sampling value out of range; `field` names the offending SamplingParams field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"sampling.{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class EngineOptions:
    """How to build the engine; the fields mirror `generate_config` (see `options_from_config`)."""

    model: str
    tensor_parallel_size: int = _SCHEMA_GENERATE.infer_tensor_parallel_size
    max_num_seqs: int = _SCHEMA_GENERATE.max_num_seqs
    max_model_len: int = _SCHEMA_GENERATE.max_model_len
    max_num_batched_tokens: int | None = _SCHEMA_GENERATE.max_num_batched_tokens
    dtype: str = _SCHEMA_GENERATE.dtype
    gpu_memory_utilization: float = _SCHEMA_GENERATE.gpu_memory_utilization
    enforce_eager: bool = _SCHEMA_GENERATE.enforce_eager
    enable_prefix_caching: bool = _SCHEMA_GENERATE.enable_prefix_caching
    trust_remote_code: bool = _SCHEMA_GENERATE.trust_remote_code
    # The fields below have no generate_config key: the service's own (flags of `rollout serve`, or fixed).
    seed: int = 0
    logprobs_mode: str = "processed_logprobs"
    # CPU only: GiB of host memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gib: int = 1
    # Where vLLM keeps its caches (VLLM_CACHE_ROOT); default: a folder under the system temp dir.
    cache_root: str | None = None
    # CPU only: torch threads for the engine (vLLM forbids changing them once the worker started).
    num_threads: int | None = None
    # vllm-ascend's options as MindSpeed-RL passes them (`generate_config.vllm_additional_config()`, expert
    # parallelism); vLLM hands `additional_config` to its platform plugin, so other platforms ignore it.
    additional_config: dict[str, Any] = field(default_factory=_SCHEMA_GENERATE.vllm_additional_config)
    enable_expert_parallel: bool = _SCHEMA_GENERATE.enable_expert_parallel
    # MoE models: each sample carries the experts every MoE layer chose per token (routed_experts.py), for
    # routing replay in training; needs enable_prefix_caching off.
    return_routed_experts: bool = False
    # rlfabric.deterministic: vLLM's batch-invariant kernels where vLLM has them (services/common/determinism.py).
    batch_invariant: bool = False


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling values for one sample; mirrors `generate_config.sampling_config`."""

    max_tokens: int = _SCHEMA_SAMPLING.max_tokens
    temperature: float = _SCHEMA_SAMPLING.temperature
    top_p: float = _SCHEMA_SAMPLING.top_p
    top_k: int = _top_k(_SCHEMA_SAMPLING.top_k)
    min_p: float = _SCHEMA_SAMPLING.min_p
    logprobs: int = _SCHEMA_SAMPLING.logprobs
    seed: int | None = _SCHEMA_SAMPLING.seed

    def validate(self, max_model_len: int | None = None) -> None:
        """Raises InvalidSamplingValueError naming the first field out of range.

        With `max_model_len`, also refuses a `max_tokens` that no prompt (of at least one token) fits
        beside: the engine would otherwise cut every response short without saying so.
        """
        if self.max_tokens < 1:
            raise InvalidSamplingValueError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if max_model_len is not None and self.max_tokens >= max_model_len:
            raise InvalidSamplingValueError(
                "max_tokens", f"{self.max_tokens} cannot be honoured: max_model_len={max_model_len} leaves at most "
                              f"{max_model_len - 1} response tokens beside a one-token prompt; lower max_tokens or "
                              f"raise generate_config.max_model_len")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingValueError("temperature", f"must be a finite value >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidSamplingValueError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidSamplingValueError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidSamplingValueError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 <= self.logprobs <= 20:
            raise InvalidSamplingValueError("logprobs", f"must be in [0, 20], got {self.logprobs}")


def options_from_config(generate_config: Any, model: str, **extra: Any) -> tuple[EngineOptions, SamplingOptions]:
    """Builds the engine and default sampling options from MindSpeed-RL's `generate_config` section.

    Args:
        generate_config: an object with the `generate_config` YAML keys as attributes (and `sampling_config`).
        model: HF model folder the engine loads.
        extra: EngineOptions fields not in the YAML (cpu_kv_cache_gib, cache_root, num_threads, seed, ...).
    """
    g = generate_config
    s = g.sampling_config
    engine = EngineOptions(
        model=str(model),
        tensor_parallel_size=int(g.infer_tensor_parallel_size),
        max_num_seqs=int(g.max_num_seqs),
        max_model_len=int(g.max_model_len),
        max_num_batched_tokens=g.max_num_batched_tokens,
        dtype=str(g.dtype),
        gpu_memory_utilization=float(g.gpu_memory_utilization),
        enforce_eager=bool(g.enforce_eager),
        enable_prefix_caching=bool(g.enable_prefix_caching),
        trust_remote_code=bool(g.trust_remote_code),
        additional_config=g.vllm_additional_config(),
        enable_expert_parallel=bool(g.enable_expert_parallel),
        **extra,
    )
    sampling = SamplingOptions(
        max_tokens=int(s.max_tokens),
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=_top_k(s.top_k),
        min_p=float(s.min_p),
        logprobs=int(s.logprobs),
        seed=s.seed,
    )
    return engine, sampling

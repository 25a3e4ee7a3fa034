"""MindSpeed-RL YAML configuration: typed sections, strict loading, derived values, validation.

    from services.common.config import load_config
    cfg = load_config("configs/grpo_qwen25_7b_A3.yaml", overrides=["rl_config.clip_ratio=0.3"])
    cfg.rl_config.n_samples_per_prompt, cfg.actor_config.tensor_model_parallel_size
    cfg.derived.actor_data_parallel_size

Imports only the standard library and PyYAML (no torch, no vLLM), so CLIs and launchers stay fast.
"""

from services.common.config.derived import Derived
from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.loader import load_config, load_config_dict
from services.common.config.megatron import MegatronConfig, ModelConfig
from services.common.config.resolved import RLFabricConfig
from services.common.config.sections import (
    FabricConfig,
    GenerateConfig,
    IntegratedModeConfig,
    MsprobeConfig,
    ProfilerConfig,
    ResourceConfig,
    RLConfig,
    SamplingConfig,
)

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "Derived",
    "GenerateConfig",
    "IntegratedModeConfig",
    "MegatronConfig",
    "ModelConfig",
    "FabricConfig",
    "MsprobeConfig",
    "ProfilerConfig",
    "RLConfig",
    "RLFabricConfig",
    "ResourceConfig",
    "SamplingConfig",
    "load_config",
    "load_config_dict",
]

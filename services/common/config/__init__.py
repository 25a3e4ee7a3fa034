"""MindSpeed-RL YAML configuration: typed sections, strict loading, derived values, validation.

    from services.common.config import load_config
    cfg = load_config("configs/grpo_qwen25_7b_A3.yaml", overrides=["rl_config.clip_ratio=0.3"])
    cfg.rl_config.n_samples_per_prompt, cfg.actor_config.tensor_model_parallel_size
    cfg.derived.actor_data_parallel_size, cfg.derived.algorithm, cfg.derived.use_kl_loss

Every key has a status (read / refused / inert) declared beside its field; docs/config.md lists them.
Imports only the standard library and PyYAML (no torch, no vLLM), so CLIs and launchers stay fast.
"""

from services.common.config.architecture import ModelConfig
from services.common.config.catalog import SECTIONS
from services.common.config.derived import Derived
from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.hf_check import check_model_files
from services.common.config.input_paths import check_run_files
from services.common.config.loader import load_config, load_config_dict
from services.common.config.megatron import MegatronConfig
from services.common.config.resolved import RLFabricConfig
from services.common.config.rl import (
    DEFAULT_VERIFIER_FUNCTION,
    DEFAULT_VERIFIER_WEIGHT,
    IntegratedModeConfig,
    ResourceConfig,
    RLConfig,
)
from services.common.config.sections import (
    FabricConfig,
    GenerateConfig,
    MsprobeConfig,
    ProfilerConfig,
    SamplingConfig,
)

__all__ = [
    "DEFAULT_VERIFIER_FUNCTION",
    "DEFAULT_VERIFIER_WEIGHT",
    "SECTIONS",
    "ConfigError",
    "ConfigIssue",
    "Derived",
    "FabricConfig",
    "GenerateConfig",
    "IntegratedModeConfig",
    "MegatronConfig",
    "ModelConfig",
    "MsprobeConfig",
    "ProfilerConfig",
    "RLConfig",
    "RLFabricConfig",
    "ResourceConfig",
    "SamplingConfig",
    "check_model_files",
    "check_run_files",
    "load_config",
    "load_config_dict",
]

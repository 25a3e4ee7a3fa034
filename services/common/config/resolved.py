"""`RLFabricConfig`: a loaded, validated configuration and where each of its values came from.

Sections keep MindSpeed-RL's names. `actor_config` is the merged view trainers use
(model block < `megatron_training` < `actor_config`, later wins); `megatron_training` is the model
block plus `megatron_training` alone; `ref_config` is the reference's view (the actor's when the
YAML has no `ref_config`); `critic_config` is PPO's critic's (model block < `megatron_training` <
`critic_config`; None without the section). `model` holds the architecture keys of the actor view.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config.architecture import ModelConfig
from services.common.config.derived import Derived
from services.common.config.megatron import MegatronConfig
from services.common.config.rl import RLConfig
from services.common.config.sections import (
    FabricConfig,
    GenerateConfig,
    MsprobeConfig,
    ProfilerConfig,
)

# Sections printed by `rlfabric config check`, in order.
SECTION_NAMES = ("model", "megatron_training", "actor_config", "ref_config", "critic_config", "rl_config",
                 "generate_config", "profiler_config", "msprobe_config", "rlfabric")


@dataclass
class Provenance:
    """Where values were set: the section that supplied each Megatron field, and file:line of keys.

    Attributes:
        megatron_origin: actor-view field name -> "actor_config" / "megatron_training" / "model.<name>".
        sources: dotted key ("rl_config.clip_ratio", "actor_config.lr") -> "file:line" or "--override ...".
    """

    megatron_origin: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class RLFabricConfig:
    """A MindSpeed-RL configuration, loaded and validated (see module docstring for the views)."""

    model_name: str | None
    model: ModelConfig
    megatron_training: MegatronConfig
    actor_config: MegatronConfig
    ref_config: MegatronConfig
    rl_config: RLConfig
    generate_config: GenerateConfig
    profiler_config: dict[str, ProfilerConfig]
    msprobe_config: MsprobeConfig
    rlfabric: FabricConfig
    derived: Derived
    # PPO's critic (`critic_config` over its model block and `megatron_training`); None without the section.
    critic_config: MegatronConfig | None = None
    path: Path | None = None
    warnings: list[str] = field(default_factory=list)
    provenance: Provenance = field(default_factory=Provenance, repr=False)

    @property
    def sampling_config(self):
        """Shortcut for `generate_config.sampling_config`."""
        return self.generate_config.sampling_config

    def where(self, key: str) -> str:
        """Dotted YAML location of a key: a bare Megatron field name maps to the section that set it."""
        if "." in key:
            return key
        return f"{self.provenance.megatron_origin.get(key, 'megatron_training')}.{key}"

    def source(self, key: str) -> str | None:
        """file:line (or override) where `key` (as accepted by `where`) was set, if known."""
        return self.provenance.sources.get(self.where(key))

    def to_dict(self) -> dict[str, Any]:
        """All sections as plain data, then the derived values (what `config check --json` prints)."""
        out: dict[str, Any] = {"model_name": self.model_name}
        for name in SECTION_NAMES:
            value = getattr(self, name)
            if isinstance(value, dict):
                out[name] = {k: dataclasses.asdict(v) for k, v in value.items()}
            elif value is None:  # a section the YAML need not have (critic_config)
                continue
            else:
                out[name] = dataclasses.asdict(value)
        out["derived"] = self.derived.to_dict()
        return out

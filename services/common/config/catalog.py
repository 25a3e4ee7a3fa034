"""The catalog of a MindSpeed-RL YAML: its sections, the class of each, and every key's status.

One table (`SECTIONS`) maps each section to its dataclass; the loader, `rlfabric config keys`, the key
report of `rlfabric config check` and docs/config.md all read it. `iter_keys` walks every key once,
`status_of` finds the status of a dotted key as the loader records it in `provenance.sources`
("model.qwen25_7b.num_layers", "rl_config.actor_resource.num_npus", "profiler_config.integrated.profile"),
and `render_status_table` writes the table docs/config.md carries (tests/common/test_config_keys.py keeps
the two equal: `rlfabric config keys --markdown` prints it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from services.common.config.architecture import ModelConfig
from services.common.config.megatron import MegatronConfig
from services.common.config.rl import IntegratedModeConfig, ResourceConfig, RLConfig
from services.common.config.schema import (
    INERT,
    READ,
    REFUSED,
    KeyStatus,
    dataclass_in,
    field_default,
    field_status,
    field_types,
)
from services.common.config.sections import (
    FabricConfig,
    GenerateConfig,
    MsprobeConfig,
    ProfilerConfig,
    SamplingConfig,
)
from services.common.config.statuses import REWARD_MODEL

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

MEGATRON_SECTIONS = ("megatron_training", "actor_config", "ref_config", "critic_config")
# Section -> class. `model` maps block names to blocks (each parsed as MegatronConfig, listed as ModelConfig);
# `profiler_config` maps roles (e.g. `integrated`) to ProfilerConfig.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "megatron_training": MegatronConfig,
    "actor_config": MegatronConfig,
    "ref_config": MegatronConfig,
    "critic_config": MegatronConfig,
    "rl_config": RLConfig,
    "generate_config": GenerateConfig,
    "generate_config.sampling_config": SamplingConfig,
    "profiler_config": ProfilerConfig,
    "msprobe_config": MsprobeConfig,
    "rlfabric": FabricConfig,
}
# Sections MindSpeed-RL has for features rlfabric does not: section -> (feature, reason).
REFUSED_SECTIONS: dict[str, tuple[str, str]] = {
    "reward_config": (REWARD_MODEL, "a reward model's Megatron options; list rule verifiers in "
                                    "rl_config.verifier_function instead"),
}
TOP_LEVEL_KEYS = ("defaults", *(name for name in SECTIONS if "." not in name), *REFUSED_SECTIONS)
_KEYED_BY_NAME = ("model", "profiler_config")  # one more level: the block name / the role


@dataclasses.dataclass(frozen=True)
class KeyEntry:
    """One key of the schema: where it lives, its class, default and status."""

    section: str
    name: str
    cls: type
    default: Any
    status: KeyStatus | None

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


# Each class once, under the section name docs use.
_WALK: tuple[tuple[str, type, tuple[str, ...]], ...] = (
    ("model.<block>", ModelConfig, ()),
    ("megatron_training", MegatronConfig, tuple(f.name for f in dataclasses.fields(ModelConfig))),
    ("rl_config", RLConfig, ()),
    ("rl_config.<role>_resource", ResourceConfig, ()),
    ("rl_config.integrated_mode_config", IntegratedModeConfig, ()),
    ("generate_config", GenerateConfig, ()),
    ("generate_config.sampling_config", SamplingConfig, ()),
    ("profiler_config.<role>", ProfilerConfig, ()),
    ("msprobe_config", MsprobeConfig, ()),
    ("rlfabric", FabricConfig, ()),
)


def iter_keys() -> Iterator[KeyEntry]:
    """Every key of every section, once (Megatron's architecture keys under `model.<block>`)."""
    for section, cls, skip in _WALK:
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                yield KeyEntry(section, f.name, cls, field_default(f), field_status(f))


def _field(cls: type, name: str) -> dataclasses.Field | None:
    return next((f for f in dataclasses.fields(cls) if f.name == name), None)


def status_of(dotted: str) -> KeyStatus | None:
    """Status of a dotted key as provenance records it; None for sections and unknown keys."""
    parts = dotted.split(".")
    head = parts[0]
    cls: type | None = MegatronConfig if head == "model" else SECTIONS.get(head)
    rest = parts[2:] if head in _KEYED_BY_NAME else parts[1:]
    if cls is None or not rest:
        return None
    for i, name in enumerate(rest):
        f = _field(cls, name)
        if f is None:
            return None
        if i == len(rest) - 1:
            return field_status(f)
        cls = dataclass_in(field_types(cls)[name])
        if cls is None:
            return None
    return None


def current_platform() -> str:
    """"ascend" where vllm-ascend is installed, else "cpu/cuda" (keys with `platform` act only on theirs)."""
    return "ascend" if importlib.util.find_spec("vllm_ascend") is not None else "cpu/cuda"


@dataclasses.dataclass
class KeyReport:
    """What `rlfabric config check` says about the keys a file sets besides their values.

    Attributes:
        inert: reason -> the inert keys the file sets for that reason.
        inactive_here: keys only another platform acts on (e.g. vllm-ascend's), with that platform.
        inactive_for_algorithm: keys the selected algorithm does not read -> why (algorithm.py).
    """

    inert: dict[str, list[str]]
    inactive_here: dict[str, str]
    inactive_for_algorithm: dict[str, str]


def key_report(cfg: RLFabricConfig, platform: str | None = None) -> KeyReport:
    """Sort the keys a file (and its overrides) sets by what rlfabric does with them."""
    from services.common.config.algorithm import inactive_keys

    platform = platform or current_platform()
    inert: dict[str, list[str]] = {}
    inactive_here: dict[str, str] = {}
    for dotted in cfg.provenance.sources:
        status = status_of(dotted)
        if status is None:
            continue
        if status.kind == INERT:
            inert.setdefault(status.reason, []).append(dotted)
        elif status.kind == READ and status.platform and status.platform != platform:
            inactive_here[dotted] = status.platform
    return KeyReport(inert, inactive_here, inactive_keys(cfg))


def render_status_table() -> str:
    """The Markdown table of every key and its status (docs/config.md holds a copy)."""
    lines = ["| key | default | status | read by / reason |", "|---|---|---|---|"]
    for entry in iter_keys():
        status = entry.status
        if status is None:
            kind, detail = "**none**", "(missing: tests/common/test_config_keys.py fails)"
        elif status.kind == READ:
            kind = "read" + (f" ({status.platform} only)" if status.platform else "")
            detail = ", ".join(f"`{m}`" for m in status.modules) + (f"; {status.reason}" if status.reason else "")
        elif status.kind == REFUSED:
            allowed = status.allowed if status.allowed is not None else (entry.default,)
            kind = "refused unless " + " or ".join(_show(v) for v in allowed)
            detail = (f"{status.feature}: " if status.feature else "") + status.reason
        else:
            kind, detail = INERT, status.reason
        lines.append(f"| `{entry.dotted}` | {_show(entry.default)} | {kind} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return "{...}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)

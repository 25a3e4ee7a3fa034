"""Refused values: keys whose status is REFUSED (schema.py) set to a value rlfabric will not run.

Every section's refused keys are checked the same way: the value must be one of the status's `allowed`
values (default: the field's default). A refused key that belongs to a feature rlfabric does not have
(PPO, DPO, LoRA, multi-turn, DeepSeek-V3, ...) is grouped with the other keys of that feature, and the loader
refuses such a config with one message per feature instead of a list of symptoms; refused keys of no
feature become ordinary validation problems.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.config.algorithm import stage_feature
from services.common.config.catalog import REFUSED_SECTIONS
from services.common.config.errors import ConfigIssue
from services.common.config.schema import REFUSED, field_default, field_status

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig


_SHOWN = 6  # keys named in a feature's message


@dataclass(frozen=True)
class Refusal:
    """One refused key: `key` is dotted, or a bare Megatron name of the actor view."""

    key: str
    feature: str | None
    reason: str
    value: Any = None
    allowed: tuple[Any, ...] = ()
    default: Any = None


def _walk(obj: Any, prefix: str) -> Iterator[Refusal]:
    for f in dataclasses.fields(obj):
        value, status = getattr(obj, f.name), field_status(f)
        if status is not None and status.kind == REFUSED:
            allowed = status.allowed if status.allowed is not None else (field_default(f),)
            if value not in allowed:
                yield Refusal(prefix + f.name, status.feature, status.reason, value, allowed, field_default(f))
        elif dataclasses.is_dataclass(value):
            yield from _walk(value, f"{prefix}{f.name}.")


def refused_values(cfg: RLFabricConfig) -> list[Refusal]:
    """Every refused key the config sets, the stage included (a PPO or DPO stage names its feature)."""
    out = list(_walk(cfg.actor_config, ""))
    if cfg.ref_config is not cfg.actor_config:
        written = {k.removeprefix("ref_config.") for k in cfg.provenance.sources if k.startswith("ref_config.")}
        out += [r for r in _walk(cfg.ref_config, "ref_config.") if r.key.removeprefix("ref_config.") in written]
    for name in ("rl_config", "generate_config", "msprobe_config", "rlfabric"):
        out += _walk(getattr(cfg, name), f"{name}.")
    for role, profiler in cfg.profiler_config.items():
        out += _walk(profiler, f"profiler_config.{role}.")
    stage = cfg.actor_config.stage
    feature = stage_feature(stage)
    if feature is not None:
        out.insert(0, Refusal("stage", feature, f"`stage: {stage}` is MindSpeed-RL's {feature.split(' (')[0]}",
                              stage))
    return out


def refusal_message(cfg: RLFabricConfig, refusal: Refusal) -> str:
    """The message of a refused key of no feature: the value, why, and what to write instead."""
    where = cfg.where(refusal.key)
    written = where in cfg.provenance.sources
    if refusal.allowed == (refusal.default,):
        fix = "remove it"
    else:
        fix = "set it to " + " or ".join(repr(v) for v in refusal.allowed)
    value = f"{refusal.value!r}" + ("" if written else " (MindSpeed-RL's default)")
    return f"`{where}` is {value}: {refusal.reason}; {fix}"


def feature_issues(cfg: RLFabricConfig, refusals: list[Refusal]) -> list[ConfigIssue]:
    """One issue per feature the config uses, naming the feature and every key that asks for it."""
    by_feature: dict[str, list[Refusal]] = {}
    for refusal in refusals:
        if refusal.feature is not None:
            by_feature.setdefault(refusal.feature, []).append(refusal)
    issues = []
    for feature, found in by_feature.items():
        names = [f"`{_where(cfg, r.key)}`" for r in found]
        keys = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        first = _where(cfg, found[0].key)
        issues.append(ConfigIssue(
            first, f"rlfabric does not support {feature} ({found[0].reason}); this config asks for it with {keys}. "
                   f"rlfabric trains GRPO and DAPO on dense, Qwen3-MoE and DeepSeek-V3 text models: remove these "
                   f"keys, or run this config with MindSpeed-RL", cfg.provenance.sources.get(first)))
    return issues


def section_refusals(top_level: list[str]) -> list[Refusal]:
    """The sections of features rlfabric does not have (critic_config, reward_config) a config holds."""
    return [Refusal(name, *REFUSED_SECTIONS[name]) for name in top_level if name in REFUSED_SECTIONS]


def _where(cfg: RLFabricConfig, key: str) -> str:
    return key if key in REFUSED_SECTIONS else cfg.where(key)

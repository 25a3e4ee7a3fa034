"""Load a MindSpeed-RL YAML into an `RLFabricConfig`: includes, overrides, merging, strict checks.

Steps, each collecting problems instead of stopping at the first:
1. read the YAML (file:line kept for every key; duplicate keys refused);
2. apply dotted overrides (`rl_config.clip_ratio=0.3`, value parsed as a YAML scalar);
3. resolve `defaults: - model: [name, ...]`: each `<config dir>/model/<name>.yaml` holds model blocks
   keyed by name; an inline top-level `model:` mapping may add or override blocks;
4. parse every section strictly (unknown keys name the section and the closest valid key);
5. merge the Megatron views: model block < `megatron_training` < `actor_config` (and `ref_config`);
6. refuse a config of a feature rlfabric does not have (PPO, DPO, LoRA, MoE, ...) with one message per
   feature (refusals.py), then derive sizes (derived.py) and run the cross-field rules (validation.py).
All problems are raised together as one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.config.architecture import ModelConfig
from services.common.config.catalog import MEGATRON_SECTIONS, SECTIONS, TOP_LEVEL_KEYS
from services.common.config.derived import compute_derived
from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.megatron import MegatronConfig
from services.common.config.problems import Problem
from services.common.config.raw_tree import apply_overrides, copy_tree, source_of
from services.common.config.refusals import feature_issues, refused_values, section_refusals
from services.common.config.resolved import Provenance, RLFabricConfig
from services.common.config.schema import (
    closest_key,
    field_types,
    normalize_key,
    parse_section,
)
from services.common.config.validation import RULES, WARNINGS, run_rules
from services.common.config.yaml_io import SourcedDict, read_yaml

logger = logging.getLogger(__name__)

# Keys of each section, to tell a user that a key belongs in another section.
_SECTION_KEYS: dict[str, Iterable[str]] = {
    name: field_types(SECTIONS[name])
    for name in ("megatron_training", "rl_config", "generate_config", "generate_config.sampling_config")
}


def _elsewhere(own: str) -> dict[str, Iterable[str]]:
    own_family = "megatron_training" if own in MEGATRON_SECTIONS or own.startswith("model.") else own
    return {name: keys for name, keys in _SECTION_KEYS.items() if name != own_family}


def _parse(name: str, raw_section: Any, raw: Mapping, issues: list[ConfigIssue], bad: set[str]) -> Any:
    """One single-level section (rl_config, generate_config, msprobe_config, rlfabric) as its dataclass."""
    cls = SECTIONS[name]
    return cls(**parse_section(cls, raw_section, section=name, issues=issues,
                               source=_sourcer(raw_section, source_of(raw, name)), elsewhere=_elsewhere(name), bad=bad))


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RLFabricConfig:
    """Load, merge and validate a MindSpeed-RL YAML file.

    Args:
        path: the config file; `defaults: model:` includes are read from `<its dir>/model/`.
        overrides: dotted `section.key=value` strings applied after reading (value parsed as YAML),
            e.g. ["rl_config.clip_ratio=0.3", "generate_config.sampling_config.temperature=0.7"].

    Returns:
        The resolved configuration, with `.derived` values and `.warnings`.

    Raises:
        ConfigError: listing every problem found (unknown keys, type errors, broken rules).
    """
    path = Path(path)
    raw = read_yaml(path)
    return load_config_dict(raw, base_dir=path.parent, overrides=overrides, label=str(path), path=path)


def load_config_dict(
    data: Any,
    *,
    base_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    label: str = "<config>",
    path: Path | None = None,
) -> RLFabricConfig:
    """Like `load_config` for an already-parsed mapping (model includes resolved from `base_dir`)."""
    issues: list[ConfigIssue] = []
    bad: set[str] = set()
    if data is None or isinstance(data, Mapping) and not data:
        # One error, not the rules' list of every required key that is not set.
        raise ConfigError([ConfigIssue(label, "CONFIG is empty: a MindSpeed-RL config maps its sections "
                                              "(megatron_training, rl_config, generate_config, ...); start from one "
                                              "of configs/*.yaml")], label)
    if not isinstance(data, Mapping):
        raise ConfigError([ConfigIssue(label, f"a config must be a mapping of sections, got {type(data).__name__}")],
                          label)
    raw = copy_tree(data)
    apply_overrides(raw, overrides, issues)
    top = _check_top_level(raw, issues)
    config_dir = Path(base_dir) if base_dir is not None else None
    included, missing = len(issues), set()
    blocks = _model_blocks(top.get("defaults"), top.get("model"), config_dir, raw, issues, missing)
    include_failed = len(issues) > included
    views = _megatron_views(top, raw, blocks, issues, bad, missing)
    rl, gen, msprobe, fabric = (_parse(name, top.get(name), raw, issues, bad)
                                for name in ("rl_config", "generate_config", "msprobe_config", "rlfabric"))
    profilers = _profilers(top.get("profiler_config"), raw, issues, bad)
    _check_worker_sections(views.sections, rl, raw, issues)
    actor, ref, critic = views.actor, views.ref, views.critic
    cfg = RLFabricConfig(
        model_name=views.model_name,
        model=ModelConfig(**{f.name: getattr(actor, f.name) for f in dataclasses.fields(ModelConfig)}),
        megatron_training=views.megatron_training,
        actor_config=actor,
        ref_config=ref,
        rl_config=rl,
        generate_config=gen,
        profiler_config=profilers,
        msprobe_config=msprobe,
        rlfabric=fabric,
        derived=compute_derived(actor, ref, rl, gen, config_dir=config_dir, critic=critic),
        critic_config=critic,
        path=path,
        provenance=Provenance(megatron_origin=_megatron_origin(views.sections, views.model_name, views.blocks),
                              sources=_collect_sources(raw, blocks)),
    )
    _validate(cfg, top, raw, bad, issues, label, rules=not include_failed)
    return cfg


def _sourcer(mapping: Any, fallback: str | None = None) -> Callable[[str], str | None]:
    sources = getattr(mapping, "key_sources", {})
    return lambda key: sources.get(key, fallback)


@dataclasses.dataclass
class _MegatronViews:
    """The parsed Megatron sections and the three views built from them (see resolved.py)."""

    sections: dict[str, dict[str, Any]]
    blocks: dict[str, dict[str, Any]]
    model_name: str | None
    megatron_training: MegatronConfig
    actor: MegatronConfig
    ref: MegatronConfig
    critic: MegatronConfig | None


def _megatron_views(top: Mapping[str, Any], raw: Mapping, blocks: Mapping[str, tuple[Any, str | None]],
                    issues: list[ConfigIssue], bad: set[str], missing: set[str]) -> _MegatronViews:
    """Parse megatron_training / actor_config / ref_config / critic_config and merge each view over its model block
    (blocks
    whose include file is `missing` were reported already: they count as empty)."""
    sections: dict[str, dict[str, Any]] = {}
    for name in MEGATRON_SECTIONS:
        if name in top:
            sections[name] = parse_section(MegatronConfig, top[name], section=name, issues=issues,
                                           source=_sourcer(top[name], source_of(raw, name)), elsewhere=_elsewhere(name),
                                           bad=bad)
    mt = sections.get("megatron_training", {})
    actor_kw = {**mt, **sections.get("actor_config", {})}
    parsed_blocks: dict[str, dict[str, Any]] = {}

    def block(name: str | None, owner: str) -> dict[str, Any]:
        if name is None or name in missing and name not in blocks:
            return {}
        if name not in parsed_blocks and name not in blocks:
            available = ", ".join(sorted(blocks)) or "none"
            issues.append(ConfigIssue(f"{owner}.model", f"model block `{name}` is not loaded (loaded: {available}); "
                                                        f"add it to `defaults: - model: [{name}]` with a file "
                                                        f"model/{name}.yaml next to the config",
                                      source_of(raw, owner, "model")))
            parsed_blocks[name] = {}
        elif name not in parsed_blocks:
            mapping, fallback = blocks[name]
            parsed_blocks[name] = parse_section(MegatronConfig, mapping, section=f"model.{name}", issues=issues,
                                                source=_sourcer(mapping, fallback),
                                                elsewhere=_elsewhere(f"model.{name}"), bad=bad)
        return parsed_blocks[name]

    mt_owner = "actor_config" if "model" in sections.get("actor_config", {}) else "megatron_training"
    megatron_training = MegatronConfig(**{**block(mt.get("model"), "megatron_training"), **mt})
    actor = MegatronConfig(**{**block(actor_kw.get("model"), mt_owner), **actor_kw})
    ref = actor
    if "ref_config" in sections:
        ref_kw = {**mt, **sections["ref_config"]}
        ref = MegatronConfig(**{**block(ref_kw.get("model"), "ref_config"), **ref_kw})
    critic = None
    if "critic_config" in sections:  # PPO's critic: over megatron_training alone, as MindSpeed-RL merges it
        critic_kw = {**mt, **sections["critic_config"]}
        critic = MegatronConfig(**{**block(critic_kw.get("model"), "critic_config"), **critic_kw})
    return _MegatronViews(sections, parsed_blocks, actor.model, megatron_training, actor, ref, critic)


def _validate(cfg: RLFabricConfig, top: Mapping[str, Any], raw: Mapping, bad: set[str], issues: list[ConfigIssue],
              label: str, *, rules: bool = True) -> None:
    """Refused features, then the rules; raise every problem together, log the warnings. Without `rules` (a
    model include could not be read), the rules are skipped: they would only list the block's missing keys."""
    # A config of a feature rlfabric does not have gets one message per feature, not a list of its symptoms.
    features = feature_issues(cfg, refused_values(cfg) + section_refusals(list(top)))
    if features:
        raise ConfigError(features, label)
    suppressed = {_canonical(key) for key in bad}
    # With a misspelled or misplaced section, rule results would only repeat "not set" for its keys.
    structure_ok = set(map(normalize_key, raw)) <= set(TOP_LEVEL_KEYS) and rules
    for problem in run_rules(cfg, RULES if structure_ok else ()):
        if not _touches(problem, suppressed):
            issues.append(ConfigIssue(cfg.where(problem.keys[0]), problem.message, cfg.source(problem.keys[0])))
    if issues:
        raise ConfigError(issues, label)
    cfg.warnings = [f"{cfg.where(p.keys[0])}: {p.message}" for p in run_rules(cfg, WARNINGS)]
    for warning in cfg.warnings:
        logger.warning("%s: %s", label, warning)


def _check_top_level(raw: SourcedDict, issues: list[ConfigIssue]) -> dict[str, Any]:
    """Map normalized top-level names to their raw values; report unknown sections."""
    top: dict[str, Any] = {}
    for key, value in raw.items():
        name = normalize_key(key)
        if name in TOP_LEVEL_KEYS:
            top[name] = value
            continue
        guess = closest_key(name, TOP_LEVEL_KEYS)
        hint = f"did you mean `{guess}`?" if guess else f"valid sections are: {', '.join(TOP_LEVEL_KEYS)}"
        issues.append(ConfigIssue(name, f"unknown top-level section `{name}`; {hint}", raw.key_sources.get(key)))
    return top


def _model_blocks(defaults: Any, inline: Any, config_dir: Path | None, raw: Mapping,
                  issues: list[ConfigIssue], missing: set[str]) -> dict[str, tuple[Any, str | None]]:
    """Model blocks by name -> (raw mapping, file:line of its name), from includes then inline; adds the names
    whose include file is not there to `missing`."""
    names: list[str] = []
    entries = defaults if isinstance(defaults, list) else ([] if defaults is None else [defaults])
    for entry in entries:
        if entry == "_self_":
            continue
        if isinstance(entry, Mapping) and set(map(normalize_key, entry)) <= {"model"}:
            for value in entry.values():
                listed = value if isinstance(value, list) else [value]
                if all(isinstance(v, str) for v in listed):
                    names.extend(listed)
                    continue
                issues.append(ConfigIssue("defaults.model", f"model names must be strings, got {value!r}",
                                          source_of(raw, "defaults")))
            continue
        issues.append(ConfigIssue("defaults", f"unsupported defaults entry {entry!r}; only "
                                              f"`- model: [name, ...]` (and `_self_`) is supported",
                                  source_of(raw, "defaults")))
    blocks: dict[str, tuple[Any, str | None]] = {}
    for name in names:
        if config_dir is None:
            issues.append(ConfigIssue("defaults.model", f"cannot include model `{name}`: no config directory "
                                                        f"(load from a file, or pass base_dir)"))
            continue
        file = config_dir / "model" / f"{name}.yaml"
        if not file.is_file():
            issues.append(ConfigIssue("defaults.model", _include_not_found(name, file), source_of(raw, "defaults")))
            missing.add(name)
            continue
        try:
            content = read_yaml(file, what=f"model file for `defaults: model: {name}`")
        except ConfigError as exc:
            issues.extend(exc.issues)
            continue
        if not isinstance(content, Mapping) or not content:
            issues.append(ConfigIssue(str(file), "a model file must map block names to architecture keys, "
                                                 f"e.g. `{name}: {{num_layers: 28, ...}}`"))
            continue
        for block_name, block in content.items():
            blocks[str(block_name)] = (block, content.key_sources.get(block_name))
    if inline is not None:
        if not isinstance(inline, Mapping):
            issues.append(ConfigIssue("model", "the top-level `model` section must map block names to "
                                               "architecture keys", source_of(raw, "model")))
        else:
            for block_name, block in inline.items():
                base = blocks.get(str(block_name), (SourcedDict(), None))[0]
                merged = copy_tree(base) if isinstance(base, Mapping) else SourcedDict()
                if isinstance(block, Mapping):
                    for k, v in block.items():
                        merged[k] = v
                        merged.key_sources[k] = getattr(block, "key_sources", {}).get(k)
                    blocks[str(block_name)] = (merged, inline.key_sources.get(block_name))
                else:
                    blocks[str(block_name)] = (block, inline.key_sources.get(block_name))
    return blocks


def _include_not_found(name: str, file: Path) -> str:
    """Where `defaults: - model: [name]` looked, and where rlfabric's own copy of that file is (if it has one)."""
    message = (f"model `{name}` not found: looked for {file.name} in {file.parent.resolve()} (includes are read from "
               f"the `model/` folder next to the config)")
    shipped = Path(__file__).resolve().parents[3] / "configs" / "model" / file.name
    if shipped.is_file() and shipped.resolve() != file.resolve():
        message += f"; rlfabric ships {shipped}: copy it there"
    return message


def _profilers(raw_section: Any, raw: Mapping, issues: list[ConfigIssue], bad: set[str]) -> dict[str, Any]:
    if raw_section is None:
        return {}
    if not isinstance(raw_section, Mapping):
        issues.append(ConfigIssue("profiler_config", "profiler_config must map roles (e.g. `integrated`) to "
                                                     "profiler options", source_of(raw, "profiler_config")))
        return {}
    out = {}
    for role, options in raw_section.items():
        role = normalize_key(role)
        sources = getattr(options, "key_sources", {})
        cls = SECTIONS["profiler_config"]
        out[role] = cls(**parse_section(cls, options, section=f"profiler_config.{role}", issues=issues,
                                        source=lambda key, s=sources: s.get(key), bad=bad))
    return out


def _check_worker_sections(sections: Mapping[str, Any], rl: Any, raw: Mapping,
                           issues: list[ConfigIssue]) -> None:
    if rl.use_integrated_worker and "ref_config" in sections:
        issues.append(ConfigIssue("ref_config", "ref_config is set while rl_config.use_integrated_worker is true; "
                                                "in integrated mode the reference uses actor_config: remove "
                                                "ref_config, or set use_integrated_worker: false",
                                  source_of(raw, "ref_config")))


def _megatron_origin(sections: Mapping[str, dict], model_name: str | None,
                     blocks: Mapping[str, dict]) -> dict[str, str]:
    origin = {}
    block = blocks.get(model_name or "", {})
    for name in field_types(MegatronConfig):
        if name in sections.get("actor_config", {}):
            origin[name] = "actor_config"
        elif name in sections.get("megatron_training", {}):
            origin[name] = "megatron_training"
        elif name in block:
            origin[name] = f"model.{model_name}"
    return origin


def _collect_sources(raw: Mapping, blocks: Mapping[str, tuple[Any, str | None]]) -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, Mapping):
            return
        sources = getattr(node, "key_sources", {})
        for key, value in node.items():
            dotted = f"{prefix}{normalize_key(key)}"
            if sources.get(key):
                out[dotted] = sources[key]
            walk(value, dotted + ".")

    walk(raw, "")
    for name, (block, _) in blocks.items():
        walk(block, f"model.{name}.")
    return out


def _canonical(key: str) -> str:
    """Parse-issue key -> rule key: Megatron section keys become bare field names."""
    for prefix in (*(f"{s}." for s in MEGATRON_SECTIONS), "model."):
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest.split(".", 1)[1] if prefix == "model." and "." in rest else rest
    return key


def _touches(problem: Problem, suppressed: set[str]) -> bool:
    for key in problem.keys:
        for bad in suppressed:
            if key == bad or key.startswith(bad + ".") or bad.startswith(key + "."):
                return True
    return False

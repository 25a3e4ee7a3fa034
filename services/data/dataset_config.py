"""The dataset YAML of `configs/datasets/*.yaml` (MindSpeed-RL's preprocessing keys), read strictly.

Parsed with the main config's machinery (`services/common/config`): `read_yaml` keeps the file:line of every
key and refuses duplicate keys, `parse_section` checks each key against `DatasetConfig` (dashes read as
underscores, unknown keys named with the closest valid key, type errors with the expected type). Every
problem, with where it was set, is reported at once as one `DataError`. Field names are exactly the
YAML keys of the seed's table. Relative paths are kept as written and resolve from the working directory,
as upstream, where `bash examples/data/preprocess_data.sh NAME` runs from the repository root. Overrides
(`key=value`, the value parsed as YAML; `rlfabric preprocess --set`) replace keys without editing the file,
e.g. to point `input` at another copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config.errors import ConfigError, ConfigIssue
from services.common.config.schema import (
    REFUSED,
    field_default,
    field_status,
    inert,
    normalize_key,
    parse_section,
    read,
    refused,
    setting,
)
from services.common.config.yaml_io import SourcedDict, parse_yaml, read_yaml
from services.common.errors import DataError

MAP_KEY_SLOTS = ("prompt", "query", "response", "system")
SECTION = "dataset"  # how messages name the file's one mapping
_STRIPPED = ("input", "tokenizer_name_or_path", "output_prefix", "handler_name", "prompt_type")
_READ = read("services/data/preprocess.py")


@dataclass
class DatasetConfig:
    """One dataset's preprocessing settings (MindSpeed-RL `configs/datasets/*.yaml`)."""

    input: str = setting(help="data file (.json, .jsonl, .parquet) or a directory of them", status=_READ)
    tokenizer_name_or_path: str = setting(help="Hugging Face model/tokenizer folder", status=_READ)
    output_prefix: str = setting(help="outputs go to {output_prefix}_packed_{field}_document.bin/.idx",
                                 status=_READ)
    handler_name: str = setting(help="R1AlpacaStyleInstructionHandler or Math17kAlpacaStyleInstructionHandler",
                                status=_READ)
    tokenizer_type: str = setting("HuggingFaceTokenizer", "only HuggingFaceTokenizer", refused(
        "only Hugging Face tokenizers are loaded (transformers.AutoTokenizer)"))
    workers: int = setting(1, "tokenizer processes", _READ)
    prompt_type: str = setting("empty", "template name in prompt_type_path", _READ)
    log_interval: int = setting(100, "log progress every this many rows", _READ)
    map_keys: dict[str, str] | None = setting(
        None, "raw field feeding each slot (prompt, query, response, system); '' leaves a slot unused; "
              "dotted paths reach nested fields (reward_model.ground_truth)", _READ)
    dataset_additional_keys: list[str] = setting(
        help="extra fields written beside input_ids/attention_mask; `labels` = the tokenised response",
        status=_READ, factory=list)
    seq_length: int | None = setting(None, "drop rows with any written field of this many tokens or more; "
                                           "None keeps all", _READ)
    seed: int = setting(1234, "upstream's preprocessing seed", inert(
        "preprocessing keeps the input order and draws nothing at random"))
    prompt_type_path: str | None = setting(None, "templates.json to read prompt_type from; default "
                                                 "configs/model/templates.json", _READ)

    def __post_init__(self) -> None:
        problems = value_problems(vars(self))
        if problems:
            raise DataError("; ".join(message for _key, message in problems))
        for name in _STRIPPED:
            setattr(self, name, getattr(self, name).strip())
        if self.map_keys is not None:
            self.map_keys = {slot: field or "" for slot, field in self.map_keys.items()}


def value_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for every value the types allow but preprocessing cannot use."""
    problems = []
    for f in dataclasses.fields(DatasetConfig):
        status = field_status(f)
        if status is not None and status.kind == REFUSED:
            allowed = status.allowed if status.allowed is not None else (field_default(f),)
            if values[f.name] not in allowed:
                problems.append((f.name, f"{f.name} {values[f.name]!r} is not supported ({status.reason}); "
                                         f"use one of {list(allowed)}"))
    for name in ("workers", "log_interval"):
        if values[name] < 1:
            problems.append((name, f"{name} must be >= 1, got {values[name]}"))
    if values["seq_length"] is not None and values["seq_length"] < 1:
        problems.append(("seq_length", f"seq_length must be a positive integer or null, got {values['seq_length']}"))
    map_keys = values["map_keys"]
    if map_keys is not None:
        bad = sorted(set(map_keys) - set(MAP_KEY_SLOTS))
        if bad:
            problems.append(("map_keys", f"map_keys has unknown slots {bad}; valid slots are {list(MAP_KEY_SLOTS)}"))
        fields = [field for field in map_keys.values() if field is not None and not isinstance(field, str)]
        if fields:
            problems.append(("map_keys", f"map_keys values must be field names (strings) or '', got {fields}"))
    additional = values["dataset_additional_keys"]
    if len(set(additional)) != len(additional):
        problems.append(("dataset_additional_keys", f"dataset_additional_keys repeats a key: {additional}"))
    clash = {"input_ids", "attention_mask"} & set(additional)
    if clash:
        problems.append(("dataset_additional_keys", f"dataset_additional_keys must not name {sorted(clash)}: "
                                                    "those are always written"))
    return problems


def _defaults() -> dict[str, Any]:
    return {f.name: field_default(f) for f in dataclasses.fields(DatasetConfig)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _apply_overrides(raw: SourcedDict, overrides: Iterable[str], issues: list[ConfigIssue]) -> None:
    """`key=value` strings into `raw`, each remembered as set by `--set key=value`."""
    for text in overrides:
        origin = f"--set {text}"
        key, sep, value_text = text.partition("=")
        if not sep or not key.strip():
            issues.append(ConfigIssue(text, f"override {text!r} must look like key=value, e.g. workers=2", origin))
            continue
        try:
            value = parse_yaml(value_text, origin) if value_text.strip() else ""
        except ConfigError as exc:
            issues.extend(exc.issues)
            continue
        key = next((k for k in raw if normalize_key(k) == normalize_key(key.strip())), key.strip())
        raw[key] = value
        raw.key_sources[key] = origin


def dataset_config_from_dict(raw: Mapping[str, Any], overrides: Iterable[str] = (),
                             label: str = "dataset config") -> DatasetConfig:
    """Builds a `DatasetConfig` from parsed YAML (a `SourcedDict` keeps file:line in the messages).

    Raises DataError listing every unknown key, wrong type, missing key and unusable value.
    """
    issues: list[ConfigIssue] = []
    if raw is None:
        raw = SourcedDict()
    if not isinstance(raw, Mapping):
        raise DataError(str(ConfigError([ConfigIssue(label, f"a dataset config must be a mapping of keys, got "
                                                            f"{type(raw).__name__}", label)], label)))
    sourced = SourcedDict(raw)
    sourced.key_sources = dict(getattr(raw, "key_sources", {}))
    _apply_overrides(sourced, overrides, issues)
    sources = {normalize_key(k): where for k, where in sourced.key_sources.items()}

    def source(key: str) -> str | None:
        return sourced.key_sources.get(key, label)

    bad: set[str] = set()
    kwargs = parse_section(DatasetConfig, sourced, section=SECTION, issues=issues, source=source, bad=bad)
    required = [f.name for f in dataclasses.fields(DatasetConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in kwargs and f"{SECTION}.{name}" not in bad]
    if missing:
        issues.append(ConfigIssue(SECTION, f"missing required keys {missing}; add them to the file or pass "
                                           "them as KEY=VALUE overrides", label))
    if not issues:
        for key, message in value_problems({**_defaults(), **kwargs}):
            issues.append(ConfigIssue(f"{SECTION}.{key}", message, sources.get(key, label)))
    if issues:
        raise DataError(str(ConfigError(issues, label)))
    return DatasetConfig(**kwargs)


def load_dataset_config(path: str | Path, overrides: Iterable[str] = ()) -> DatasetConfig:
    """Reads a dataset YAML file, applies `key=value` overrides and validates the result."""
    p = Path(path)
    try:
        raw = read_yaml(p, what="dataset config")
    except ConfigError as exc:
        raise DataError(str(exc)) from exc
    return dataset_config_from_dict(raw, overrides, label=str(p))

"""The dataset YAML of `configs/datasets/*.yaml` (MindSpeed-RL's preprocessing keys), read strictly.

Field names are exactly the YAML keys of the seed's table. Unknown keys are errors that name the closest
valid key. Relative paths are kept as written and resolve from the working directory, as upstream, where
`bash examples/data/preprocess_data.sh NAME` runs from the repository root. `overrides` (`key=value`, the
value parsed as YAML) replace keys without editing the file, e.g. to point `input` at another copy.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import DataError

SUPPORTED_TOKENIZER_TYPES = ("HuggingFaceTokenizer",)
MAP_KEY_SLOTS = ("prompt", "query", "response", "system")


@dataclass
class DatasetConfig:
    """One dataset's preprocessing settings (MindSpeed-RL `configs/datasets/*.yaml`)."""

    input: str = field(metadata={"help": "data file (.json, .jsonl, .parquet) or a directory of them"})
    tokenizer_name_or_path: str = field(metadata={"help": "Hugging Face model/tokenizer folder"})
    output_prefix: str = field(metadata={"help": "outputs go to {output_prefix}_packed_{field}_document.bin/.idx"})
    handler_name: str = field(metadata={"help": "R1AlpacaStyleInstructionHandler or "
                                                "Math17kAlpacaStyleInstructionHandler"})
    tokenizer_type: str = field(default="HuggingFaceTokenizer", metadata={"help": "only HuggingFaceTokenizer"})
    workers: int = field(default=1, metadata={"help": "tokenizer processes"})
    prompt_type: str = field(default="empty", metadata={"help": "template name in prompt_type_path"})
    log_interval: int = field(default=100, metadata={"help": "log progress every this many rows"})
    map_keys: dict[str, str] | None = field(default=None, metadata={
        "help": "raw field feeding each slot (prompt, query, response, system); '' leaves a slot unused; "
                "dotted paths reach nested fields (reward_model.ground_truth)"})
    dataset_additional_keys: list[str] = field(default_factory=list, metadata={
        "help": "extra fields written beside input_ids/attention_mask; `labels` = the tokenised response"})
    seq_length: int | None = field(default=None, metadata={
        "help": "drop rows with any written field of this many tokens or more; None keeps all"})
    seed: int = field(default=1234, metadata={
        "help": "accepted for parity; preprocessing keeps input order, so nothing here is random"})
    prompt_type_path: str | None = field(default=None, metadata={
        "help": "templates.json to read prompt_type from; default configs/model/templates.json"})

    def __post_init__(self) -> None:
        if self.tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
            raise DataError(f"tokenizer_type {self.tokenizer_type!r} is not supported; "
                            f"use one of {list(SUPPORTED_TOKENIZER_TYPES)}")
        for name in ("workers", "log_interval"):
            if getattr(self, name) < 1:
                raise DataError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_length is not None and self.seq_length < 1:
            raise DataError(f"seq_length must be a positive integer or null, got {self.seq_length}")
        if self.map_keys is not None:
            bad = sorted(set(self.map_keys) - set(MAP_KEY_SLOTS))
            if bad:
                raise DataError(f"map_keys has unknown slots {bad}; valid slots are {list(MAP_KEY_SLOTS)}")
        if len(set(self.dataset_additional_keys)) != len(self.dataset_additional_keys):
            raise DataError(f"dataset_additional_keys repeats a key: {self.dataset_additional_keys}")
        clash = {"input_ids", "attention_mask"} & set(self.dataset_additional_keys)
        if clash:
            raise DataError(f"dataset_additional_keys must not name {sorted(clash)}: those are always written")


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(DatasetConfig)}


def _check_type(key: str, value: Any, source: str) -> Any:
    expected = _field_types()[key]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "int | None": value is None or (isinstance(value, int) and not isinstance(value, bool)),
        "str | None": value is None or isinstance(value, str),
        "dict[str, str] | None": value is None or (
            isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str | None)
                                            for k, v in value.items())),
        "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[expected]
    if not ok:
        raise DataError(f"{source}: key {key!r} must be {expected}, got {value!r}")
    if key == "map_keys" and value is not None:
        return {k: (v or "") for k, v in value.items()}
    if key in ("input", "tokenizer_name_or_path", "output_prefix", "handler_name", "prompt_type"):
        return value.strip()
    return value


def dataset_config_from_dict(raw: Mapping[str, Any], source: str = "dataset config") -> DatasetConfig:
    """Builds a `DatasetConfig` from parsed YAML, rejecting unknown keys, wrong types and missing keys."""
    valid = list(_field_types())
    kwargs = {}
    for key, value in raw.items():
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
            raise DataError(f"{source}: unknown key {key!r}{hint}")
        kwargs[key] = _check_type(key, value, source)
    required = [f.name for f in dataclasses.fields(DatasetConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in kwargs]
    if missing:
        raise DataError(f"{source}: missing required keys {missing}")
    return DatasetConfig(**kwargs)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values are YAML (`workers=2` is an int, `map_keys={...}` a dict)."""
    import yaml

    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DataError(f"override {item!r} must look like key=value")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise DataError(f"override {item!r}: value is not valid YAML: {exc}") from exc
    return out


def load_dataset_config(path: str | Path, overrides: Iterable[str] = ()) -> DatasetConfig:
    """Reads a dataset YAML file, applies `key=value` overrides and validates the result."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise DataError(f"dataset config {p} not found") from exc
    except OSError as exc:
        raise DataError(f"cannot read dataset config {p}: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise DataError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise DataError(f"{p}: expected a mapping of keys, got {type(raw).__name__}")
    raw.update(parse_overrides(overrides))
    return dataset_config_from_dict(raw, source=str(p))

"""No silent keys: every key of every section has a status, and each status is true.

READ keys are read by the modules they name (the source holds the attribute access), REFUSED keys are
refused with a message naming them when set to a value they do not allow, INERT keys say why, and
docs/config.md carries the current table (`rlfabric config keys --markdown` prints it).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import types
import typing
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.config.catalog import KeyEntry, iter_keys, render_status_table
from services.common.config.schema import INERT, READ, REFUSED, field_types, inert, setting

REPO = Path(__file__).resolve().parents[2]
ENTRIES = list(iter_keys())
DOCS_BEGIN, DOCS_END = "<!-- key-status-table:begin -->", "<!-- key-status-table:end -->"


def keys_without_status(entries: list[KeyEntry]) -> list[str]:
    return [e.dotted for e in entries if e.status is None]


@functools.cache
def attributes_accessed(module: str) -> frozenset[str]:
    """Every attribute name the module's code accesses (`x.name`), from its syntax tree: not strings, not comments."""
    tree = ast.parse((REPO / module).read_text())
    return frozenset(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute))


def unread_claims(entry: KeyEntry) -> list[str]:
    """The modules a READ key names that do not access it (or do not exist)."""
    bad = [m for m in entry.status.modules
           if not (REPO / m).is_file() or entry.name not in attributes_accessed(m)]
    return bad if entry.status.modules else ["(no module named)"]


def test_every_key_has_a_status():
    assert len(ENTRIES) > 250
    assert keys_without_status(ENTRIES) == []


def test_the_walk_catches_a_key_without_a_status():
    @dataclasses.dataclass(kw_only=True)
    class Section:
        declared: int = setting(1, "A key with a status.", inert("a reason that is long enough"))
        forgotten: int = setting(2, "A key someone added without one.")

    entries = [KeyEntry("demo", f.name, Section, f.default, f.metadata.get("status"))
               for f in dataclasses.fields(Section)]
    assert keys_without_status(entries) == ["demo.forgotten"]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.status and e.status.kind == READ], ids=lambda e: e.dotted)
def test_read_keys_are_read_where_they_say(entry: KeyEntry):
    assert unread_claims(entry) == [], f"{entry.dotted} is declared read by modules that do not read it"


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.status and e.status.kind == INERT], ids=lambda e: e.dotted)
def test_inert_keys_say_why(entry: KeyEntry):
    assert len(entry.status.reason) > 20


def _refused_value(entry: KeyEntry):
    """A value of the key's type that its status does not allow."""
    allowed = entry.status.allowed if entry.status.allowed is not None else (entry.default,)
    annotation = field_types(entry.cls)[entry.name]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else (annotation,)
    candidates = []
    for option in options:
        if typing.get_origin(option) is typing.Literal:
            candidates += list(typing.get_args(option))
        elif option is bool:
            candidates += [True, False]
        elif option is int:
            candidates += [3, 7]
        elif option is float:
            candidates += [0.37, 0.5]
        elif option is str:
            candidates += ["not-allowed"]
        elif typing.get_origin(option) is list:
            candidates += [["not-allowed"]] if typing.get_args(option) == (str,) else [[3]]
        elif dataclasses.is_dataclass(option):
            candidates += [{"num_npus": 1}]
    return next(v for v in candidates if v not in allowed)


def _override_path(entry: KeyEntry) -> str:
    section = {"model.<block>": "megatron_training", "profiler_config.<role>": "profiler_config.integrated"}
    return f"{section.get(entry.section, entry.section)}.{entry.name}"


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.status and e.status.kind == REFUSED],
                         ids=lambda e: e.dotted)
def test_refused_keys_are_refused_naming_the_key(entry: KeyEntry):
    assert entry.status.reason
    value = _refused_value(entry)
    with pytest.raises(ConfigError) as exc:
        load_config(REPO / "configs/grpo_qwen25_7b_A3.yaml", overrides=[f"{_override_path(entry)}={json.dumps(value)}"])
    text = str(exc.value)
    assert f"{entry.name}`" in text, text
    assert entry.status.reason in text or (entry.status.feature and entry.status.feature in text), text


def test_refused_keys_at_their_allowed_values_load():
    # Every allowed value is accepted (e.g. dropout 0.0, split "100,0,0", tokenizer_type PretrainedFromHF).
    overrides = ["megatron_training.split=100,0,0", "megatron_training.tokenizer_type=PretrainedFromHF",
                 "megatron_training.dataset_additional_keys=[]", "generate_config.infer_pipeline_parallel_size=1"]
    load_config(REPO / "configs/grpo_qwen25_7b_A3.yaml", overrides=overrides)


def test_docs_config_md_carries_the_current_table():
    text = (REPO / "docs/config.md").read_text()
    assert DOCS_BEGIN in text and DOCS_END in text, "docs/config.md lost its table markers"
    table = text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0].strip()
    assert table == render_status_table().strip(), (
        "docs/config.md disagrees with the schema; regenerate the table with "
        "`rlfabric config keys --markdown` and paste it between the markers")

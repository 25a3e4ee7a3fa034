"""Preprocessing the real data sets: exact prompts and labels, drop counts, errors, atomic output."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_support import DAPO_106, DEEPSCALER_803, DEEPSCALER_MATH_7474, deepscaler_config

from services.common.errors import DataError
from services.data.dataset_config import load_dataset_config
from services.data.preprocess import preprocess

FIELDS = ("input_ids", "attention_mask", "labels")


def indexed(prefix: Path, field: str):
    """megatron-core's reader; keep it referenced while using arrays from it (they are views of its mmap)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(f"{prefix}_packed_{field}_document")


def outputs_at(prefix: Path) -> list[Path]:
    """The .bin/.idx files at an output prefix (hidden temporary folders excluded)."""
    return sorted(p for p in prefix.parent.glob(prefix.name + "_*") if p.suffix in (".bin", ".idx"))


def test_deepscaler_803_rows_are_qwen_r1_prompts_with_answer_labels(deepscaler_prefix, shared_data, decode,
                                                                     qwen_r1_prompt):
    rows = json.loads((shared_data / DEEPSCALER_803).read_text())
    kept = [r for r in rows if (r["problem"] or "").strip() and (r["answer"] or "").strip()]
    prompts, masks, labels = (indexed(deepscaler_prefix, f) for f in FIELDS)
    assert len(prompts) == len(masks) == len(labels) == len(kept) == 803
    for i, row in enumerate(kept):
        assert prompts[i].dtype == np.int32
        assert decode(prompts[i]) == qwen_r1_prompt(row["problem"]), i
        assert decode(labels[i]) == row["answer"], i
        assert masks[i].tolist() == [1] * len(prompts[i])
    assert [p.name for p in outputs_at(deepscaler_prefix)] == sorted(
        f"data_packed_{f}_document{s}" for f in FIELDS for s in (".bin", ".idx"))


def test_dapo_parquet_through_math_17k_yaml(repo_root, shared_data, tiny_model_dir, tmp_path, decode):
    prefix = tmp_path / "dapo"
    cfg = load_dataset_config(repo_root / "configs/datasets/math_17k.yaml", [
        f"input={shared_data / DAPO_106}", f"tokenizer_name_or_path={tiny_model_dir}", f"output_prefix={prefix}",
        "workers=2"])
    summary = preprocess(cfg)
    rows = pq.read_table(shared_data / DAPO_106).to_pylist()
    assert (summary.rows_read, summary.rows_written, summary.rows_dropped) == (106, 106, 0)
    prompts, labels = indexed(prefix, "input_ids"), indexed(prefix, "labels")
    for i, row in enumerate(rows):
        # Template `empty`: the first chat message's content verbatim, nothing around it.
        assert decode(prompts[i]) == row["prompt"][0]["content"], i
        assert decode(labels[i]) == row["reward_model"]["ground_truth"], i


def test_math_7474_reports_exactly_the_null_answers_it_drops(shared_data, tiny_model_dir, tmp_path, decode):
    rows = json.loads((shared_data / DEEPSCALER_MATH_7474).read_text())
    null_rows = [i for i, r in enumerate(rows) if r["answer"] is None]
    blank_rows = [i for i, r in enumerate(rows) if r["answer"] is not None and not r["answer"].strip()]
    assert null_rows == [886, 1009]
    prefix = tmp_path / "math"
    summary = preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix,
                                           input=str(shared_data / DEEPSCALER_MATH_7474), workers=2))
    assert summary.dropped["null_response"] == 2
    assert summary.dropped_rows["null_response"] == null_rows
    assert summary.dropped_rows["empty_response"] == blank_rows == [5328, 5330]
    assert summary.rows_dropped == 4 and summary.rows_written == 7470 == len(indexed(prefix, "labels"))
    assert "null_response rows: 886, 1009" in summary.format()
    kept = [r for i, r in enumerate(rows) if i not in null_rows + blank_rows]
    labels = indexed(prefix, "labels")
    for i in (0, 885, 886, 1007, 5327, 5328, 7469):  # around the gaps: order is kept
        assert decode(labels[i]) == kept[i]["answer"]


def test_two_workers_write_the_same_bytes_as_one(deepscaler_prefix, shared_data, tiny_model_dir, tmp_path):
    prefix = tmp_path / "data"
    preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, workers=2, log_interval=1))
    for ours, ref in zip(outputs_at(prefix), outputs_at(deepscaler_prefix), strict=True):
        assert ours.name == ref.name and ours.read_bytes() == ref.read_bytes()


def test_seq_length_drops_rows_with_a_field_that_long(deepscaler_prefix, shared_data, tiny_model_dir, tmp_path):
    prompts, labels = indexed(deepscaler_prefix, "input_ids"), indexed(deepscaler_prefix, "labels")
    lengths, label_lengths = prompts.sequence_lengths, labels.sequence_lengths
    seq_length = int(np.median(lengths))
    too_long = [i for i in range(803) if lengths[i] >= seq_length or label_lengths[i] >= seq_length]
    prefix = tmp_path / "short"
    summary = preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, seq_length=seq_length))
    assert summary.dropped["too_long"] == len(too_long) > 0
    assert summary.rows_written == 803 - len(too_long)
    written = indexed(prefix, "input_ids")
    assert int(written.sequence_lengths.max()) < seq_length


def _write_rows(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows))
    return path


def test_failed_run_keeps_the_previous_output_and_leaves_nothing_partial(shared_data, tiny_model_dir, tmp_path):
    rows = json.loads((shared_data / DEEPSCALER_803).read_text())
    prefix = tmp_path / "out" / "data"
    good = _write_rows(tmp_path / "good.json", rows[:50])
    preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, input=str(good)))
    before = {p: p.read_bytes() for p in outputs_at(prefix)}
    assert len(before) == 6

    bad = _write_rows(tmp_path / "bad.json", rows[:300] + [{"problem": "P", "solution": "S"}] + rows[300:400])
    with pytest.raises(DataError, match=r"bad.json row 300: field 'answer' \(map_keys.response\) not found; "
                                        r"the row has fields \['problem', 'solution'\]"):
        preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, input=str(bad), workers=2))
    assert {p: p.read_bytes() for p in outputs_at(prefix)} == before
    assert sorted(p.name for p in prefix.parent.iterdir()) == sorted(p.name for p in before)

    fresh = tmp_path / "fresh" / "data"
    with pytest.raises(DataError):
        preprocess(deepscaler_config(shared_data, tiny_model_dir, fresh, input=str(bad)))
    assert list(fresh.parent.iterdir()) == []


@pytest.mark.parametrize(("change", "match"), [
    ({"handler_name": "AlpacaStyleInstructionHandler"},
     "unknown handler_name 'AlpacaStyleInstructionHandler'; valid names: Math17kAlpacaStyleInstructionHandler, "
     "R1AlpacaStyleInstructionHandler"),
    ({"prompt_type": "deepscaler"}, "unknown prompt_type 'deepscaler'.*valid names: .*qwen_r1"),
    ({"input": "/nonexistent/deepscaler.json"}, "input /nonexistent/deepscaler.json not found"),
    ({"tokenizer_name_or_path": "/nonexistent/qwen25-7b"}, "tokenizer_name_or_path '/nonexistent/qwen25-7b' not found"),
    ({"tokenizer_name_or_path": "EMPTY_DIR"}, "cannot load a tokenizer from tokenizer_name_or_path"),
])
def test_configuration_errors(shared_data, tiny_model_dir, tmp_path, change, match):
    if change.get("tokenizer_name_or_path") == "EMPTY_DIR":
        (tmp_path / "empty_model").mkdir()
        change = {"tokenizer_name_or_path": str(tmp_path / "empty_model")}
    prefix = tmp_path / "out" / "data"
    with pytest.raises(DataError, match=match):
        preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, **change))
    assert not prefix.parent.exists() or outputs_at(prefix) == []


def test_backend_encoder_gives_the_ids_of_tokenizer_encode(deepscaler_prefix, shared_data, tiny_tokenizer):
    # Preprocessing calls the Rust backend directly for speed; the ids must be those of the public encode.
    from services.data.preprocess import make_encoder
    from services.data.templates import get_template

    rows = json.loads((shared_data / DEEPSCALER_803).read_text())
    tpl = get_template("qwen_r1")
    prompts, labels = indexed(deepscaler_prefix, "input_ids"), indexed(deepscaler_prefix, "labels")
    assert type(make_encoder(tiny_tokenizer)).__name__ == "_BackendEncoder"
    for i, row in enumerate(rows):
        assert prompts[i].tolist() == tpl.encode_prompt(tiny_tokenizer, row["problem"]), i
        assert labels[i].tolist() == tiny_tokenizer.encode(row["answer"], add_special_tokens=False), i


def test_dapo_jsonl_and_parquet_give_identical_datasets(repo_root, shared_data, tiny_model_dir, tmp_path):
    outs = []
    for suffix in ("parquet", "jsonl"):
        prefix = tmp_path / suffix / "data"
        preprocess(load_dataset_config(repo_root / "configs/datasets/math_17k.yaml", [
            f"input={shared_data / DAPO_106.replace('.parquet', '.' + suffix)}",
            f"tokenizer_name_or_path={tiny_model_dir}", f"output_prefix={prefix}", "workers=1"]))
        outs.append([p.read_bytes() for p in outputs_at(prefix)])
    assert len(outs[0]) == 6 and outs[0] == outs[1]


def test_prompt_type_path_selects_a_custom_templates_file(shared_data, tiny_model_dir, tmp_path, decode):
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps([{"name": "bracket", "format_user": {"slots": ["[Q] {{content}} [A]"]},
                                      "default_system": "S: "}]))
    rows = json.loads((shared_data / DEEPSCALER_803).read_text())[:20]
    prefix = tmp_path / "data"
    preprocess(deepscaler_config(shared_data, tiny_model_dir, prefix, input=str(_write_rows(tmp_path / "in.json", rows)),
                                 prompt_type="bracket", prompt_type_path=str(templates)))
    prompts = indexed(prefix, "input_ids")
    # No format_system: the system text goes in as is ({{content}}), before the user slot.
    assert [decode(prompts[i]) for i in range(20)] == [f"S: [Q] {r['problem']} [A]" for r in rows]

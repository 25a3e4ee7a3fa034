"""Readers: every accepted layout gives the same rows; bad files fail naming the file and position."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.errors import DataError
from services.data.readers import open_rows

ROWS = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}, {"problem": "é?", "answer": None}]


def _values(path):
    src = open_rows(path)
    rows = list(src)
    assert [r.index for r in rows] == list(range(len(rows)))
    return src.kind, src.total, [r.data for r in rows]


@pytest.mark.parametrize(("name", "text", "kind"), [
    ("a.json", json.dumps(ROWS), "json_array"),
    ("a.jsonl", "\n".join(json.dumps(r) for r in ROWS) + "\n\n", "jsonl"),
    # JSON lines in a .json file, as Hugging Face datasets accepts.
    ("b.json", "\n".join(json.dumps(r) for r in ROWS), "jsonl"),
])
def test_json_layouts(tmp_path, name, text, kind):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert _values(path) == (kind, 3, ROWS)


def test_single_object_is_one_row(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(ROWS[0]))
    assert _values(path) == ("json", 1, [ROWS[0]])


def test_parquet_with_nested_fields(tmp_path):
    rows = [{"prompt": [{"content": "c", "role": "user"}], "reward_model": {"ground_truth": "-3", "style": "rule"}}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows * 3000), path)
    kind, total, values = _values(path)
    assert (kind, total, len(values)) == ("parquet", 3000, 3000)
    assert values[2999] == rows[0]


def test_directory_reads_the_majority_kind_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2]))
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]))
    (tmp_path / "notes.json").write_text("{}")
    kind, total, values = _values(tmp_path)
    assert values == ROWS
    assert total is None


def test_real_files(shared_data):
    _, total, values = _values(shared_data / "dapo/dapo-math-17k_first106rows.parquet")
    _, _, from_jsonl = _values(shared_data / "dapo/dapo-math-17k_first106rows.jsonl")
    assert total == 106 and values == from_jsonl
    kind, total, values = _values(shared_data / "deepscaler/deepscaler_subset803_meta-reason.json")
    assert (kind, total) == ("json_array", 803)
    assert values[0]["answer"] == "-\\frac{2}{3}"


@pytest.mark.parametrize(("name", "content", "match"), [
    # The byte offset counts UTF-8 bytes: "é" is two.
    ("bad.json", '[{"a": "é"},\n {"a": 1,}]', r"bad.json: invalid JSON at line 2 column 10 \(byte 23\)"),
    ("bad.jsonl", '{"a": 1}\n\n{"a": 2\n', r"bad.jsonl row 1 \(line 3\): invalid JSON at column 8"),
    ("list.json", '[{"a": 1}, [1, 2]]', r"list.json row 1: expected a JSON object.*got list"),
    ("scalar.json", "42", "got a top-level int"),
    ("latin1.json", b'[{"a": "\xe9"}]', "not UTF-8 text"),
    ("junk.parquet", b"not parquet at all", "not a readable parquet file"),
    ("data.csv", "a,b\n1,2\n", "unsupported file type '.csv'"),
])
def test_malformed_files_name_the_position(tmp_path, name, content, match):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=match):
        list(open_rows(path))


def test_missing_input(tmp_path):
    with pytest.raises(DataError, match=r"input .*nope.json not found"):
        open_rows(tmp_path / "nope.json")
    with pytest.raises(DataError, match="holds no .json, .jsonl, .parquet files"):
        open_rows(tmp_path)

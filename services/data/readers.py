"""Raw rows from the dataset files MindSpeed-RL accepts: JSON, JSON array, JSON lines and parquet.

`open_rows(path)` picks the reader from the file name (a directory means all its files of the most common
supported kind, in name order) and returns a `RowSource`: the row count when it is known up front (for
progress and ETA) and an iterator of `Row`s. Rows are numbered from 0 in file order, across files for a
directory; every error names the file and the row (and for JSON text the line, column and byte offset).

- `.json`: a JSON array of objects, a single object (one row), or JSON lines (as Hugging Face `datasets`
  also accepts in a `.json` file).
- `.jsonl`: one object per line; blank lines are skipped.
- `.parquet`: read in record batches, nested structs and lists become dicts and lists.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import DataError

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Row:
    """One raw record: its 0-based index, its fields, and where it came from (for error messages)."""

    index: int
    data: dict[str, Any]
    where: str


@dataclass
class RowSource:
    """The rows of one input; `total` is None when counting would need a second full pass."""

    path: Path
    kind: str
    total: int | None
    _rows: Iterator[Row]

    def __iter__(self) -> Iterator[Row]:
        return self._rows


def _byte_offset(text: str, char_pos: int) -> int:
    return len(text[:char_pos].encode("utf-8"))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from exc
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object with named fields, got {type(value).__name__}")
    return value


def _jsonl_rows(path: Path, text: str, start: int) -> Iterator[Row]:
    index = start
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} row {index - start} (line {lineno})"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON at column {exc.colno}: {exc.msg}") from exc
        yield Row(index, _as_object(value, where), where)
        index += 1


def _json_source(path: Path, start: int) -> tuple[str, int, Iterator[Row]]:
    text = _read_text(path)
    stripped = text.lstrip()
    if path.suffix == ".jsonl":
        return "jsonl", sum(1 for ln in text.splitlines() if ln.strip()), _jsonl_rows(path, text, start)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        # "Extra data" after a first complete object is how JSON lines look to a whole-file parse.
        if stripped.startswith("{") and exc.msg == "Extra data":
            return "jsonl", sum(1 for ln in text.splitlines() if ln.strip()), _jsonl_rows(path, text, start)
        raise DataError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} "
                        f"(byte {_byte_offset(text, exc.pos)}): {exc.msg}") from exc
    if isinstance(value, dict):
        return "json", 1, iter([Row(start, value, f"{path} row 0")])
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of objects, an object, or JSON lines; "
                        f"got a top-level {type(value).__name__}")
    rows = [Row(start + i, _as_object(v, f"{path} row {i}"), f"{path} row {i}") for i, v in enumerate(value)]
    return "json_array", len(rows), iter(rows)


def _parquet_source(path: Path, start: int) -> tuple[str, int, Iterator[Row]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file: {exc}") from exc

    def rows() -> Iterator[Row]:
        i = 0
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
                for value in batch.to_pylist():
                    yield Row(start + i, value, f"{path} row {i}")
                    i += 1
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: parquet data unreadable after row {i}: {exc}") from exc

    return "parquet", pf.metadata.num_rows, rows()


def _files_of(path: Path, as_written: str) -> list[Path]:
    if not path.exists():
        raise DataError(f"input {as_written} not found (relative paths are resolved from {Path.cwd()})")
    if path.is_file():
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"input {path}: unsupported file type {path.suffix!r}; "
                            f"supported: {', '.join(SUPPORTED_SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
    if not files:
        raise DataError(f"input directory {path} holds no {', '.join(SUPPORTED_SUFFIXES)} files")
    # As upstream: the most common kind wins, so a stray README.json does not mix formats.
    suffix = Counter(p.suffix for p in files).most_common(1)[0][0]
    return [p for p in files if p.suffix == suffix]


def open_rows(path: str | Path) -> RowSource:
    """Opens `path` (a file or a directory of files) and returns its rows; raises `DataError` on bad input."""
    root = Path(path)
    files = _files_of(root, str(path))
    if len(files) == 1:
        f = files[0]
        kind, total, rows = (_parquet_source if f.suffix == ".parquet" else _json_source)(f, 0)
        return RowSource(root, kind, total, rows)

    def chained() -> Iterator[Row]:
        start = 0
        for f in files:
            _, _, rows = (_parquet_source if f.suffix == ".parquet" else _json_source)(f, start)
            for row in rows:
                yield row
                start = row.index + 1

    return RowSource(root, f"{files[0].suffix.lstrip('.')} directory", None, chained())

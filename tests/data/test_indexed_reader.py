"""services/data/indexed_reader.py reads what megatron-core's `IndexedDataset` reads, from files megatron-core's own
builder wrote, and names the file when one is not an index or is cut short."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import DataError
from services.data.indexed_reader import IndexedReader


def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core's import warns about absent GPU extensions
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def build(prefix: Path, sequences: list[np.ndarray], dtype, documents_every: int = 1) -> None:
    builder = megatron().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, s in enumerate(sequences):
        builder.add_item(torch.from_numpy(s))
        if (i + 1) % documents_every == 0:
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_every_sequence_equals_megatrons_reader(tmp_path: Path, dtype) -> None:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 30000, size=n).astype(dtype) for n in [5, 1, 17, 0, 300, 2]]
    build(tmp_path / "d", sequences, dtype, documents_every=2)
    ours, theirs = IndexedReader(tmp_path / "d"), megatron().IndexedDataset(str(tmp_path / "d"))
    assert len(ours) == len(theirs) == 6
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(theirs)):
        assert ours[i].dtype == np.dtype(dtype) and np.array_equal(ours[i], theirs[i]) and np.array_equal(ours[i], sequences[i])
    assert np.array_equal(ours[-1], sequences[-1])


def test_the_preprocessed_deepscaler_prompts_equal_megatrons_reader(deepscaler_prefix: Path) -> None:
    prefix = f"{deepscaler_prefix}_packed_input_ids_document"
    ours, theirs = IndexedReader(prefix), megatron().IndexedDataset(prefix)
    assert len(ours) == len(theirs) == 803
    assert all(np.array_equal(ours[i], theirs[i]) for i in range(len(theirs)))


def test_a_sequence_outlives_its_reader(tmp_path: Path) -> None:
    build(tmp_path / "d", [np.arange(7, dtype=np.int32)], np.int32)
    reader = IndexedReader(tmp_path / "d")
    first = reader[0]
    del reader
    gc.collect()  # the mapped data file is closed now; a view of it would crash here
    assert first.tolist() == list(range(7))


def test_missing_bad_and_cut_files_are_data_errors_naming_the_file(tmp_path: Path) -> None:
    assert not IndexedReader.exists(tmp_path / "none")
    build(tmp_path / "d", [np.arange(50, dtype=np.int32), np.arange(9, dtype=np.int32)], np.int32)
    assert IndexedReader.exists(tmp_path / "d")
    idx, data = (tmp_path / "d.idx").read_bytes(), (tmp_path / "d.bin").read_bytes()
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + idx[8:])
    (tmp_path / "bad.bin").write_bytes(data)
    with pytest.raises(DataError, match=r"bad\.idx: not a megatron-core indexed dataset index"):
        IndexedReader(tmp_path / "bad")
    (tmp_path / "short.idx").write_bytes(idx[:-8])
    (tmp_path / "short.bin").write_bytes(data)
    with pytest.raises(DataError, match=r"short\.idx: .* cut short"):
        IndexedReader(tmp_path / "short")
    (tmp_path / "cut.idx").write_bytes(idx)
    (tmp_path / "cut.bin").write_bytes(data[:100])
    with pytest.raises(DataError, match=r"cut\.bin: 100 bytes, but .*cut\.idx points to 236"):
        IndexedReader(tmp_path / "cut")
    with pytest.raises(IndexError):
        IndexedReader(tmp_path / "d")[2]

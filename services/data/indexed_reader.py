"""Reading megatron-core's indexed datasets (the `.idx`/`.bin` pairs `rlfabric preprocess` writes with megatron-core's
own `IndexedDatasetBuilder`, services/data/indexed_output.py) without importing megatron-core.

Why not megatron-core's `IndexedDataset`: `import megatron.core` costs ~7 s of CPU (it pulls in torch and its
compiler stack), which the coordinator paid at every start-up, beside the trainers and the rollout on the same cores,
to read a format of a few fields. tests/data/test_indexed_reader.py checks this reader against `IndexedDataset` on
the same files.

The format (version 1). The index file: the magic b"MMIDIDX\\x00\\x00", the version (little-endian uint64, 1), the
token dtype's code (uint8, megatron-core's `DType`), the sequence count and the document count (uint64 each), then
one int32 length per sequence, one int64 byte offset into the data file per sequence, and one int64 per document
boundary (multimodal datasets add an int8 mode per sequence, which prompts never have). The data file: every
sequence's tokens back to back.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from services.common.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# megatron-core's DType codes.
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedReader:
    """The sequences of one indexed dataset at `prefix` (`{prefix}.idx` and `{prefix}.bin`).

    `reader[i]` is sequence i as a fresh array (never a view of the mapped file, so it outlives the reader);
    `sequence_lengths` holds every sequence's token count. A file that is not this format, or is cut short, is a
    DataError naming it.
    """

    @staticmethod
    def exists(prefix: str | Path) -> bool:
        return index_path(prefix).exists() and data_path(prefix).exists()

    def __init__(self, prefix: str | Path) -> None:
        idx, data = index_path(prefix), data_path(prefix)
        raw = idx.read_bytes()
        if len(raw) < _HEADER.size:
            raise DataError(f"{idx}: {len(raw)} bytes, shorter than an indexed dataset's header")
        magic, version, code, sequences, documents = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != 1:
            raise DataError(f"{idx}: not a megatron-core indexed dataset index (version 1); preprocess again")
        if code not in _DTYPES:
            raise DataError(f"{idx}: unknown token dtype code {code}")
        self.dtype = np.dtype(_DTYPES[code])
        end = _HEADER.size + sequences * (4 + 8) + documents * 8
        if len(raw) < end:
            raise DataError(f"{idx}: {len(raw)} bytes, but its header promises {sequences} sequences and "
                            f"{documents} documents ({end} bytes); the file is cut short, preprocess again")
        self.sequence_lengths = np.frombuffer(raw, np.int32, sequences, _HEADER.size)
        self.sequence_pointers = np.frombuffer(raw, np.int64, sequences, _HEADER.size + 4 * sequences)
        self.document_indices = np.frombuffer(raw, np.int64, documents, _HEADER.size + 12 * sequences)
        needed = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
                  if sequences else 0)
        size = data.stat().st_size
        if size < needed:
            raise DataError(f"{data}: {size} bytes, but {idx} points to {needed}; the file is cut short, "
                            "preprocess again")
        self._data = np.memmap(data, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        start, count = int(self.sequence_pointers[i]), int(self.sequence_lengths[i])
        return np.frombuffer(self._data[start:start + count * self.dtype.itemsize].tobytes(), self.dtype)

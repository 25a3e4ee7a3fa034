"""The coordinator's prompt loader: seeded, drop_last batches of prompt and label token ids, resumable.

It reads `{prefix}_packed_input_ids_document` and, when present, `{prefix}_packed_labels_document`
(megatron-core's indexed format, services/data/indexed_reader.py), and drops every prompt of `max_prompt_length`
tokens or more (prompts are never truncated; `dropped_too_long` says how many went). The kept prompts are
shuffled once per epoch with a permutation that depends only on `(seed, epoch)`, and cut into `global_batch_size`
batches, the last incomplete batch of an epoch being dropped. Batch `k` is therefore a pure function of
`(data, max_prompt_length, global_batch_size, seed, k)`: resuming from `consumed_batches=k` yields exactly the
batches an uninterrupted loader yields from its k-th batch on, across epoch boundaries too.

Each batch carries the prompts' stable indices (their sequence index in the indexed dataset) so samples,
rewards and logs can name the prompt they came from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import DataError
from services.data.indexed_reader import IndexedReader

logger = logging.getLogger(__name__)


def _dataset_prefix(data_prefix: str | Path, field_name: str) -> str:
    return f"{data_prefix}_packed_{field_name}_document"


@dataclass(frozen=True)
class PromptBatch:
    """One global batch: `prompts[i]` (int32 token ids) is dataset prompt `prompt_indices[i]`."""

    batch_index: int
    epoch: int
    prompt_indices: np.ndarray
    prompts: list[np.ndarray]
    labels: list[np.ndarray] | None

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]


class PromptLoader:
    """Seeded random batches of whole prompts (with labels), resumable at any batch.

    Args:
        data_prefix: the preprocessing `output_prefix` (files `{data_prefix}_packed_*_document.{bin,idx}`).
        global_batch_size: prompts per batch.
        max_prompt_length: prompts with this many tokens or more are dropped, not truncated.
        seed: shuffling seed; epoch e uses the permutation drawn from `(seed, e)`.
        consumed_batches: batches already used by an earlier run; iteration starts after them.
        shuffle: False (upstream's `no_shuffle: true`) keeps the dataset's order in every epoch.
    """

    def __init__(self, data_prefix: str | Path, global_batch_size: int, max_prompt_length: int, seed: int,
                 consumed_batches: int = 0, shuffle: bool = True) -> None:
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if max_prompt_length < 1:
            raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if consumed_batches < 0:
            raise DataError(f"consumed_batches must be >= 0, got {consumed_batches}")
        prompts_prefix = _dataset_prefix(data_prefix, "input_ids")
        if not IndexedReader.exists(prompts_prefix):
            raise DataError(f"no prompt dataset at {prompts_prefix}.idx/.bin; run `rlfabric preprocess` "
                            f"with output_prefix {data_prefix}")
        self.prompts = IndexedReader(prompts_prefix)
        labels_prefix = _dataset_prefix(data_prefix, "labels")
        self.labels = IndexedReader(labels_prefix) if IndexedReader.exists(labels_prefix) else None
        if self.labels is not None and len(self.labels) != len(self.prompts):
            raise DataError(f"{labels_prefix} has {len(self.labels)} rows but {prompts_prefix} has "
                            f"{len(self.prompts)}; preprocess again")

        self.data_prefix = str(data_prefix)
        self.global_batch_size = global_batch_size
        self.max_prompt_length = max_prompt_length
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_batches = consumed_batches
        lengths = self.prompts.sequence_lengths.astype(np.int64)
        self.kept_indices = np.flatnonzero(lengths < max_prompt_length).astype(np.int64)
        self.total_prompts = len(lengths)
        self.dropped_too_long = self.total_prompts - len(self.kept_indices)
        self.batches_per_epoch = len(self.kept_indices) // global_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"{data_prefix}: only {len(self.kept_indices)} of {self.total_prompts} prompts are "
                            f"shorter than max_prompt_length={max_prompt_length}, fewer than one batch of "
                            f"global_batch_size={global_batch_size}")
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        logger.info("prompt loader %s: %d prompts, %d dropped as >= %d tokens, %d batches of %d per epoch, "
                    "starting after %d consumed batches", self.data_prefix, self.total_prompts,
                    self.dropped_too_long, max_prompt_length, self.batches_per_epoch, global_batch_size,
                    consumed_batches)

    @property
    def num_prompts(self) -> int:
        """Prompts kept after the length filter."""
        return len(self.kept_indices)

    @property
    def consumed_samples(self) -> int:
        return self.consumed_batches * self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The kept prompt indices in epoch `epoch`'s order (shuffled unless `shuffle` is False)."""
        if not self.shuffle:
            return self.kept_indices
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_cache = (epoch, rng.permutation(self.kept_indices))
        return self._epoch_cache[1]

    def batch(self, batch_index: int) -> PromptBatch:
        """Batch number `batch_index` counted from the start of training (random access, no state)."""
        if batch_index < 0:
            raise IndexError(f"batch_index must be >= 0, got {batch_index}")
        epoch, pos = divmod(batch_index, self.batches_per_epoch)
        start = pos * self.global_batch_size
        indices = self.epoch_order(epoch)[start:start + self.global_batch_size].copy()
        prompts = [self.prompts[int(i)].astype(np.int32) for i in indices]
        labels = None
        if self.labels is not None:
            labels = [self.labels[int(i)].astype(np.int32) for i in indices]
        return PromptBatch(batch_index, epoch, indices, prompts, labels)

    def next_batch(self) -> PromptBatch:
        """The next unconsumed batch; advances `consumed_batches` (the cursor to journal)."""
        b = self.batch(self.consumed_batches)
        self.consumed_batches += 1
        return b

    def __iter__(self) -> Iterator[PromptBatch]:
        """Endless batches from the cursor on, epoch after epoch; each one advances the cursor."""
        while True:
            yield self.next_batch()

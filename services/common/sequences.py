"""Variable-length sequence batches on the wire: `rlfabric.v1.SequenceBatch` <-> arrays.

Sequences travel flat (all tokens concatenated, no padding) with a prompt-length and a response-length
tensor, so a batch of B sequences is three buffers whatever the lengths. Per-token response values
(log-probs, entropy) use the same flat layout over response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlfabric.v1 import trainer_pb2
from services.common.tensors import to_numpy, to_proto


@dataclass(frozen=True)
class Sequences:
    """B sequences (prompt then response), flat, with ids and lengths."""

    sample_ids: list[str]
    token_ids: np.ndarray  # int32 [sum(prompt_lengths + response_lengths)]
    prompt_lengths: np.ndarray  # int32 [B]
    response_lengths: np.ndarray  # int32 [B]
    weights_version: int = 0

    def __post_init__(self) -> None:
        b = len(self.sample_ids)
        if self.prompt_lengths.shape != (b,) or self.response_lengths.shape != (b,):
            raise ValueError(f"{b} sample ids but lengths of shape {self.prompt_lengths.shape} and "
                             f"{self.response_lengths.shape}")
        total = int(self.prompt_lengths.sum() + self.response_lengths.sum())
        if self.token_ids.shape != (total,):
            raise ValueError(f"the lengths add up to {total} tokens but token_ids has shape {self.token_ids.shape}")
        if (self.prompt_lengths < 1).any() or (self.response_lengths < 0).any():
            raise ValueError("every sequence needs a prompt of >= 1 token and a response of >= 0 tokens")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @classmethod
    def from_lists(cls, sample_ids: Sequence[str], prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                   weights_version: int = 0) -> Sequences:
        if not (len(sample_ids) == len(prompts) == len(responses)):
            raise ValueError(f"{len(sample_ids)} ids, {len(prompts)} prompts, {len(responses)} responses")
        parts = [np.asarray(x, dtype=np.int32) for pair in zip(prompts, responses, strict=True) for x in pair]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return cls(list(sample_ids), tokens, np.array([len(p) for p in prompts], dtype=np.int32),
                   np.array([len(r) for r in responses], dtype=np.int32), weights_version)

    def take(self, start: int, stop: int) -> Sequences:
        """Sequences `start` to `stop` (exclusive) as a batch of their own."""
        stop = min(stop, len(self))
        ends = np.cumsum(self.prompt_lengths.astype(np.int64) + self.response_lengths)
        begin = int(ends[start - 1]) if start > 0 else 0
        end = int(ends[stop - 1]) if stop > 0 else 0
        return Sequences(self.sample_ids[start:stop], self.token_ids[begin:end], self.prompt_lengths[start:stop],
                         self.response_lengths[start:stop], self.weights_version)

    def split(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(prompt, response) token arrays of each sequence."""
        out = []
        offset = 0
        for p, r in zip(self.prompt_lengths.tolist(), self.response_lengths.tolist(), strict=True):
            out.append((self.token_ids[offset:offset + p], self.token_ids[offset + p:offset + p + r]))
            offset += p + r
        return out

    def to_proto(self) -> trainer_pb2.SequenceBatch:
        return trainer_pb2.SequenceBatch(
            sample_ids=self.sample_ids,
            token_ids=to_proto(self.token_ids.astype(np.int32, copy=False)),
            prompt_lengths=to_proto(self.prompt_lengths.astype(np.int32, copy=False)),
            response_lengths=to_proto(self.response_lengths.astype(np.int32, copy=False)),
            weights_version=self.weights_version,
        )

    @classmethod
    def from_proto(cls, msg: trainer_pb2.SequenceBatch) -> Sequences:
        """Decodes and checks a batch; raises ValueError naming the field (TensorDecodeError is one)."""
        arrays = {}
        for field in ("token_ids", "prompt_lengths", "response_lengths"):
            arrays[field] = to_numpy(getattr(msg, field))
            if arrays[field].dtype.kind not in "iu":
                raise ValueError(f"batch.{field} must hold integers (DTYPE_INT32), got {arrays[field].dtype}")
        return cls(list(msg.sample_ids), arrays["token_ids"], arrays["prompt_lengths"], arrays["response_lengths"],
                   msg.weights_version)


def split_response_values(flat: np.ndarray, response_lengths: Sequence[int]) -> list[np.ndarray]:
    """Cuts a flat per-response-token array into one array per sequence."""
    total = int(np.sum(response_lengths))
    if flat.shape != (total,):
        raise ValueError(f"expected {total} per-token values for these responses, got shape {flat.shape}")
    return np.split(flat, np.cumsum(response_lengths)[:-1]) if len(response_lengths) else []

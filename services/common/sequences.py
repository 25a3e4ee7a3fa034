"""Variable-length sequence batches on the wire: `rlfabric.v1.SequenceBatch` <-> arrays.

Sequences travel flat (all tokens concatenated, no padding) with a prompt-length and a response-length
tensor, so a batch of B sequences is three buffers whatever the lengths. Per-token response values
(log-probs, entropy) use the same flat layout over response tokens. With routing replay (MoE), the experts
the rollout chose travel beside the tokens, one row per token (`routed_experts`).
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
    # Routing replay: int32 [sum(prompt_lengths + response_lengths), moe_layers, top_k], row t the experts
    # for token t; a row of -1 leaves the trainer's router free there. None: no replay.
    routed_experts: np.ndarray | None = None
    # Multi-turn: bool [sum(response_lengths)], False on response tokens the policy did not generate (tool
    # responses: context, never trained on). None: every response token was generated.
    response_mask: np.ndarray | None = None

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
        if self.routed_experts is not None and (self.routed_experts.ndim != 3
                                                or self.routed_experts.shape[0] != total):
            raise ValueError(f"routed_experts must be [{total} tokens, moe_layers, top_k], got shape "
                             f"{self.routed_experts.shape}")
        responses = int(self.response_lengths.sum())
        if self.response_mask is not None and self.response_mask.shape != (responses,):
            raise ValueError(f"response_mask must be [{responses} response tokens], got shape {self.response_mask.shape}")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @classmethod
    def from_lists(cls, sample_ids: Sequence[str], prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                   weights_version: int = 0, routed: Sequence[np.ndarray] | None = None,
                   response_masks: Sequence[np.ndarray] | None = None) -> Sequences:
        """`routed`: each sample's rollout routing, [prompt + response - 1, layers, top_k] (Sample.routed_experts);
        `response_masks`: each response's generated-token mask (multi-turn), [response_length] bools."""
        if not (len(sample_ids) == len(prompts) == len(responses)):
            raise ValueError(f"{len(sample_ids)} ids, {len(prompts)} prompts, {len(responses)} responses")
        parts = [np.asarray(x, dtype=np.int32) for pair in zip(prompts, responses, strict=True) for x in pair]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        routed_experts = None if routed is None else _routing_per_token(sample_ids, routed, lengths)
        mask = None if response_masks is None else np.concatenate(
            [np.asarray(m, dtype=np.bool_) for m in response_masks] or [np.zeros(0, dtype=np.bool_)])
        return cls(list(sample_ids), tokens, np.array([len(p) for p in prompts], dtype=np.int32),
                   np.array([len(r) for r in responses], dtype=np.int32), weights_version, routed_experts, mask)

    def take(self, start: int, stop: int) -> Sequences:
        """Sequences `start` to `stop` (exclusive) as a batch of their own."""
        stop = min(stop, len(self))
        ends = np.cumsum(self.prompt_lengths.astype(np.int64) + self.response_lengths)
        begin = int(ends[start - 1]) if start > 0 else 0
        end = int(ends[stop - 1]) if stop > 0 else 0
        routed = None if self.routed_experts is None else self.routed_experts[begin:end]
        mask = None
        if self.response_mask is not None:
            resp_ends = np.cumsum(self.response_lengths.astype(np.int64))
            mask = self.response_mask[(int(resp_ends[start - 1]) if start > 0 else 0):
                                      (int(resp_ends[stop - 1]) if stop > 0 else 0)]
        return Sequences(self.sample_ids[start:stop], self.token_ids[begin:end], self.prompt_lengths[start:stop],
                         self.response_lengths[start:stop], self.weights_version, routed, mask)

    def select(self, order: Sequence[int]) -> Sequences:
        """The sequences at indices `order`, in that order, as a batch of their own."""
        order = list(order)
        seq_ends = np.cumsum(self.prompt_lengths.astype(np.int64) + self.response_lengths)
        resp_ends = np.cumsum(self.response_lengths.astype(np.int64))

        def pieces(values: np.ndarray | None, ends: np.ndarray) -> np.ndarray | None:
            if values is None:
                return None
            starts = ends - np.diff(ends, prepend=0)
            taken = [values[starts[i]:ends[i]] for i in order]
            return np.concatenate(taken) if taken else values[:0]

        return Sequences([self.sample_ids[i] for i in order], pieces(self.token_ids, seq_ends),
                         self.prompt_lengths[order], self.response_lengths[order], self.weights_version,
                         pieces(self.routed_experts, seq_ends),
                         pieces(self.response_mask, resp_ends))

    def split(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(prompt, response) token arrays of each sequence."""
        out = []
        offset = 0
        for p, r in zip(self.prompt_lengths.tolist(), self.response_lengths.tolist(), strict=True):
            out.append((self.token_ids[offset:offset + p], self.token_ids[offset + p:offset + p + r]))
            offset += p + r
        return out

    def to_proto(self) -> trainer_pb2.SequenceBatch:
        msg = trainer_pb2.SequenceBatch(
            sample_ids=self.sample_ids,
            token_ids=to_proto(self.token_ids.astype(np.int32, copy=False)),
            prompt_lengths=to_proto(self.prompt_lengths.astype(np.int32, copy=False)),
            response_lengths=to_proto(self.response_lengths.astype(np.int32, copy=False)),
            weights_version=self.weights_version,
        )
        if self.routed_experts is not None:
            msg.routed_experts.CopyFrom(to_proto(self.routed_experts.astype(np.int32, copy=False)))
        if self.response_mask is not None:
            msg.response_mask.CopyFrom(to_proto(self.response_mask.astype(np.bool_, copy=False)))
        return msg

    @classmethod
    def from_proto(cls, msg: trainer_pb2.SequenceBatch) -> Sequences:
        """Decodes and checks a batch; raises ValueError naming the field (TensorDecodeError is one)."""
        arrays = {}
        for field in ("token_ids", "prompt_lengths", "response_lengths"):
            arrays[field] = to_numpy(getattr(msg, field))
            if arrays[field].dtype.kind not in "iu":
                raise ValueError(f"batch.{field} must hold integers (DTYPE_INT32), got {arrays[field].dtype}")
        routed = None
        if msg.HasField("routed_experts"):
            routed = to_numpy(msg.routed_experts)
            if routed.dtype.kind not in "iu":
                raise ValueError(f"batch.routed_experts must hold integers (DTYPE_INT32), got {routed.dtype}")
        mask = None
        if msg.HasField("response_mask"):
            mask = to_numpy(msg.response_mask)
            if mask.dtype != np.bool_:
                raise ValueError(f"batch.response_mask must be booleans (DTYPE_BOOL), got {mask.dtype}")
            mask = mask.reshape(-1)
        return cls(list(msg.sample_ids), arrays["token_ids"], arrays["prompt_lengths"], arrays["response_lengths"],
                   msg.weights_version, routed, mask)


def _routing_per_token(sample_ids: Sequence[str], routed: Sequence[np.ndarray], lengths: Sequence[int]) -> np.ndarray:
    """The samples' routing rows aligned with their tokens: each sample's L - 1 rows, then a free (-1) row.

    The last token of a sequence is never fed to the rollout's engine; in training its output predicts no
    response token, so whichever experts the trainer picks there change no log-prob.
    """
    shapes = {np.asarray(r).shape[1:] for r in routed}
    if len(shapes) > 1:
        raise ValueError(f"routed_experts: samples disagree on [moe_layers, top_k]: {sorted(shapes)}")
    out = []
    for sample_id, rows, length in zip(sample_ids, routed, lengths, strict=True):
        rows = np.asarray(rows, dtype=np.int32)
        if rows.ndim != 3 or rows.shape[0] != length - 1:
            raise ValueError(f"sample {sample_id}: routed_experts has shape {rows.shape}, expected "
                             f"[{length - 1} positions, moe_layers, top_k]")
        out += [rows, np.full((1, *rows.shape[1:]), -1, dtype=np.int32)]
    return np.concatenate(out) if out else np.zeros((0, 0, 0), dtype=np.int32)


def split_response_values(flat: np.ndarray, response_lengths: Sequence[int]) -> list[np.ndarray]:
    """Cuts a flat per-response-token array into one array per sequence."""
    total = int(np.sum(response_lengths))
    if flat.shape != (total,):
        raise ValueError(f"expected {total} per-token values for these responses, got shape {flat.shape}")
    return np.split(flat, np.cumsum(response_lengths)[:-1]) if len(response_lengths) else []

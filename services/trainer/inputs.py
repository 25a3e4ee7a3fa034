"""What the Trainer servicer checks in a client's input before any rank works on it.

Every check raises ValueError (the servicer answers INVALID_ARGUMENT) naming the field, and the first bad
value where there is one: token ids inside the model's vocabulary, a finite positive temperature, finite
advantages and log-probs of the right sizes. Rank 0 runs them on the whole request, so a bad batch never
reaches a rank, never yields NaN metrics and never moves the weights version. Client values are quoted
through services/common/status.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rlfabric.v1 import trainer_pb2
from services.common.sequences import Sequences
from services.common.status import echo
from services.common.tensors import to_numpy


def check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite value > 0, got {temperature}")


def check_kl_coef(kl_coef: float) -> None:
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef must be a finite value >= 0, got {kl_coef}")


def sequences(batch: trainer_pb2.SequenceBatch, vocab_size: int) -> Sequences:
    """The batch's sequences, each with a response token, every token id in [0, vocab_size)."""
    seqs = Sequences.from_proto(batch)
    if (seqs.response_lengths < 1).any():
        raise ValueError("every sequence needs at least one response token")
    bad = np.flatnonzero((seqs.token_ids < 0) | (seqs.token_ids >= vocab_size))
    if bad.size:
        first = int(bad[0])
        ends = np.cumsum(seqs.prompt_lengths.astype(np.int64) + seqs.response_lengths)
        row = int(np.searchsorted(ends, first, side="right"))
        raise ValueError(f"batch.token_ids[{first}] = {int(seqs.token_ids[first])} (sample "
                         f"{echo(seqs.sample_ids[row])}) is outside the vocabulary of {vocab_size} tokens "
                         f"(ids 0 to {vocab_size - 1}); {bad.size} ids are")
    return seqs


def experience_arrays(parts: Sequence[trainer_pb2.UpdateRequest], seqs: Sequence[Sequences]
                      ) -> dict[str, np.ndarray | None]:
    """The request slices of one Update call as one global batch (numpy arrays, sizes and values checked)."""
    tokens = np.concatenate([s.token_ids for s in seqs]).astype(np.int64)
    prompt = np.concatenate([s.prompt_lengths for s in seqs]).astype(np.int64)
    resp = np.concatenate([s.response_lengths for s in seqs]).astype(np.int64)
    adv = []
    for p, s in zip(parts, seqs, strict=True):
        a = to_numpy(p.advantages).astype(np.float32).reshape(-1)
        if a.shape[0] != len(s):
            raise ValueError(f"advantages has {a.shape[0]} values for {len(s)} sequences")
        adv.append(a)
    advantages = np.concatenate(adv)
    _require_finite("advantages", advantages)

    def per_token(field: str) -> np.ndarray | None:
        present = [p.HasField(field) and to_numpy(getattr(p, field)).size > 0 for p in parts]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"{field} is set on some UpdateRequests of the call but not on others")
        out = []
        for p, s in zip(parts, seqs, strict=True):
            v = to_numpy(getattr(p, field)).astype(np.float32).reshape(-1)
            if v.shape[0] != int(s.response_lengths.sum()):
                raise ValueError(f"{field} has {v.shape[0]} values for {int(s.response_lengths.sum())} response tokens")
            out.append(v)
        values = np.concatenate(out)
        _require_finite(field, values)
        return values

    return {
        "token_ids": tokens, "prompt_lengths": prompt, "response_lengths": resp, "advantages": advantages,
        "old_log_probs": per_token("old_log_probs"), "ref_log_probs": per_token("ref_log_probs"),
        "behavior_log_probs": per_token("behavior_log_probs"),
    }


def _require_finite(field: str, values: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"{field}[{int(bad[0])}] = {values[bad[0]]} is not finite ({bad.size} values are); "
                         f"nothing was trained")

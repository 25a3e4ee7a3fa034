"""What the Trainer servicer checks in a client's input before any rank works on it.

Every check raises ValueError (the servicer answers INVALID_ARGUMENT) naming the field, and the first bad
value where there is one: token ids inside the model's vocabulary, a finite positive temperature, finite
advantages, log-probs, returns and values of the right sizes, and the Update fields of the trainer's role. Rank 0 runs them on the whole request, so a bad batch never
reaches a rank, never yields NaN metrics and never moves the weights version. Client values are quoted
through services/common/status.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rlfabric.v1 import trainer_pb2
from services.common.model_spec import MoeSpec
from services.common.sequences import Sequences
from services.common.status import echo
from services.common.tensors import to_numpy


def check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite value > 0, got {temperature}")


def check_kl_coef(kl_coef: float) -> None:
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef must be a finite value >= 0, got {kl_coef}")


def sequences(batch: trainer_pb2.SequenceBatch, vocab_size: int, moe: MoeSpec | None = None) -> Sequences:
    """The batch's sequences, each with a response token, every token id in [0, vocab_size); routing to replay
    only on a MoE model (`moe`), with its MoE-layer count and top-k and expert ids in range."""
    seqs = Sequences.from_proto(batch)
    if seqs.routed_experts is not None:
        check_routed_experts(seqs.routed_experts, moe)
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


def check_routed_experts(routed: np.ndarray, moe: MoeSpec | None) -> None:
    """`batch.routed_experts` fits the model: [tokens, its MoE layers, its top_k], each row all -1 or all experts."""
    if moe is None:
        raise ValueError("batch.routed_experts is set but the model has no MoE layers (routing replay is for MoE "
                         "models)")
    want = (len(moe.moe_layers), moe.num_experts_per_tok)
    if tuple(routed.shape[1:]) != want:
        raise ValueError(f"batch.routed_experts has [moe_layers, top_k] = {list(routed.shape[1:])}; the model has "
                         f"{list(want)}")
    free = (routed == -1).all(-1)
    bad = np.argwhere(~free[..., None] & ((routed < 0) | (routed >= moe.num_experts)))
    if bad.size:
        t, layer, j = (int(v) for v in bad[0])
        raise ValueError(f"batch.routed_experts[{t}, {layer}, {j}] = {int(routed[t, layer, j])} is not an expert of "
                         f"the model (0 to {moe.num_experts - 1}; a row of -1 leaves the router free)")


# What each role's Update reads (rlfabric/v1/trainer.proto, UpdateRequest); a field of the other role is refused.
ACTOR_FIELDS = ("advantages", "token_advantages", "old_log_probs", "ref_log_probs", "behavior_log_probs")
CRITIC_FIELDS = ("returns", "values")


def experience_arrays(parts: Sequence[trainer_pb2.UpdateRequest], seqs: Sequence[Sequences], role: str = "actor"
                      ) -> dict[str, np.ndarray | None]:
    """The request slices of one Update call as one global batch (numpy arrays, sizes and values checked), with the
    inputs `role` trains on: an actor's advantages (exactly one kind) and log-probs, or a critic's returns and
    values; a field of the other role is refused."""
    routed = [s.routed_experts for s in seqs]
    if any(r is None for r in routed) and not all(r is None for r in routed):
        raise ValueError("batch.routed_experts is set on some UpdateRequests of the call but not on others")
    # A request without a mask generated every response token: all True beside the others' masks.
    masks = [s.response_mask for s in seqs]
    response_mask = None if all(m is None for m in masks) else np.concatenate(
        [np.ones(int(s.response_lengths.sum()), dtype=np.bool_) if m is None else m for s, m in zip(seqs, masks,
                                                                                                   strict=True)])
    if response_mask is not None and not response_mask.any():
        raise ValueError("batch.response_mask leaves no generated token to train on")
    arrays = {
        "token_ids": np.concatenate([s.token_ids for s in seqs]).astype(np.int64),
        "prompt_lengths": np.concatenate([s.prompt_lengths for s in seqs]).astype(np.int64),
        "response_lengths": np.concatenate([s.response_lengths for s in seqs]).astype(np.int64),
        "routed_experts": None if routed[0] is None else np.concatenate(routed),
        "response_mask": response_mask,
    }
    arrays.update(_critic_inputs(parts, seqs) if role == "critic" else _actor_inputs(parts, seqs))
    return arrays


def _actor_inputs(parts: Sequence[trainer_pb2.UpdateRequest], seqs: Sequence[Sequences]) -> dict:
    _refuse(parts, CRITIC_FIELDS, "an actor's Update reads advantages and log-probs; returns and values are the "
                                  "critic's")
    per_sequence, per_token = any(_present(parts, "advantages")), any(_present(parts, "token_advantages"))
    if per_sequence and per_token:
        raise ValueError("advantages and token_advantages are both set: an actor's Update takes one kind (one per "
                         "sequence, or one per response token with PPO's GAE)")
    if not (per_sequence or per_token):
        raise ValueError("advantages is missing: an actor's Update needs advantages (one per sequence) or "
                         "token_advantages (one per response token)")
    advantages = None
    if per_sequence:
        adv = []
        for p, s in zip(parts, seqs, strict=True):
            a = to_numpy(p.advantages).astype(np.float32).reshape(-1)
            if a.shape[0] != len(s):
                raise ValueError(f"advantages has {a.shape[0]} values for {len(s)} sequences")
            adv.append(a)
        advantages = np.concatenate(adv)
        _require_finite("advantages", advantages)
    return {"advantages": advantages, "token_advantages": _per_token(parts, seqs, "token_advantages"),
            **{f: _per_token(parts, seqs, f) for f in ("old_log_probs", "ref_log_probs", "behavior_log_probs")}}


def _critic_inputs(parts: Sequence[trainer_pb2.UpdateRequest], seqs: Sequence[Sequences]) -> dict:
    _refuse(parts, ACTOR_FIELDS, "a critic's Update reads returns and values; advantages and log-probs are the "
                                 "actor's")
    out = {f: _per_token(parts, seqs, f) for f in CRITIC_FIELDS}
    for field, v in out.items():
        if v is None:
            raise ValueError(f"{field} is missing: a critic's Update needs returns and values (one per response "
                             f"token)")
    return out


def _present(parts: Sequence[trainer_pb2.UpdateRequest], field: str) -> list[bool]:
    return [p.HasField(field) and to_numpy(getattr(p, field)).size > 0 for p in parts]


def _refuse(parts: Sequence[trainer_pb2.UpdateRequest], fields: Sequence[str], why: str) -> None:
    for field in fields:
        if any(_present(parts, field)):
            raise ValueError(f"{field} is set: {why}")


def _per_token(parts: Sequence[trainer_pb2.UpdateRequest], seqs: Sequence[Sequences], field: str) -> np.ndarray | None:
    """`field`, one value per response token, over the call's requests (None when no request sets it)."""
    present = _present(parts, field)
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


def _require_finite(field: str, values: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"{field}[{int(bad[0])}] = {values[bad[0]]} is not finite ({bad.size} values are); "
                         f"nothing was trained")

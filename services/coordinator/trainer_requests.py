"""What the coordinator sends a trainer, and how it reads the replies: samples as `SequenceBatch`es, log-prob
passes over a batch, and the actor's `Update` requests.

A log-prob pass runs either as a stream beside the rollout (generation.py `LogProbStream`) or, here, in one call
over the trained batch (`compute_log_probs`); both read the replies with `collect_log_probs`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, trainer_pb2
from services.common.sequences import Sequences, split_response_values
from services.common.tensors import to_numpy, to_proto
from services.coordinator.errors import IterationError
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.settings import IterationSettings


def sequences_of(samples: Sequence[common_pb2.Sample], prompts: Sequence[np.ndarray],
                 weights_version: int) -> Sequences:
    """Each sample's prompt followed by its response, as one flat batch (with the rollout's routing, if any)."""
    captured = [x.HasField("routed_experts") for x in samples]
    if any(captured) and not all(captured):
        missing = [x.sample_id for x, c in zip(samples, captured, strict=True) if not c]
        raise IterationError(f"routing replay: {len(missing)} samples came without routed_experts (first: "
                             f"{missing[:3]}); every rollout replica must be built with routing capture")
    routed = [to_numpy(x.routed_experts) for x in samples] if all(captured) and samples else None
    masks = None
    if any(x.HasField("response_mask") for x in samples):  # multi-turn: tool answers are context, not trained on
        masks = [to_numpy(x.response_mask).reshape(-1) if x.HasField("response_mask")
                 else np.ones(x.response_length, np.bool_) for x in samples]
    return Sequences.from_lists([x.sample_id for x in samples], prompts,
                                [to_numpy(x.response_token_ids) for x in samples], weights_version, routed, masks)


def collect_log_probs(reply: trainer_pb2.LogProbResponse, lengths: dict[str, int],
                      out: dict[str, np.ndarray]) -> None:
    """Splits a reply's flat log-probs per sample; the lengths are those of the request, by sample id."""
    ids = list(reply.sample_ids)
    parts = split_response_values(to_numpy(reply.log_probs), [lengths[x] for x in ids])
    out.update(zip(ids, parts, strict=True))


def compute_log_probs(phase: str, stub: Any, seqs: Sequences, micro: int, settings: IterationSettings,
                      clock: PhaseClock, *, adapters_off: bool = False) -> dict[str, np.ndarray]:
    """`stub`'s log-probs of every sequence, `micro` rows per request, timed as `phase`; `adapters_off`: of its
    backbone without the LoRA adapters (share_backbone's reference)."""
    requests = [trainer_pb2.LogProbRequest(batch=seqs.take(i, i + micro).to_proto(), temperature=settings.temperature,
                                           adapters_off=adapters_off)
                for i in range(0, len(seqs), micro)]
    lengths = dict(zip(seqs.sample_ids, seqs.response_lengths.tolist(), strict=True))
    out: dict[str, np.ndarray] = {}
    start = time.perf_counter()
    try:
        for reply in stub.ComputeLogProbs(iter(requests), timeout=settings.deadline_s):
            collect_log_probs(reply, lengths, out)
    except grpc.RpcError as e:
        raise IterationError(f"{phase} ComputeLogProbs: {e.code().name}: {e.details()}") from e
    clock.record(phase, start, time.perf_counter())
    return out


def update_request(chunk: Sequences, adv_of: dict[str, float] | dict[str, np.ndarray], old_lp: dict[str, np.ndarray],
                   ref_lp: dict[str, np.ndarray], behavior: dict[str, np.ndarray], *, step: int, kl_coef: float,
                   settings: IterationSettings, batch_rows: int = 0) -> trainer_pb2.UpdateRequest:
    """One `Update` request over `chunk`: its advantages (one per sample, or PPO's per token) and the log-probs the
    loss needs, by sample id; `batch_rows` the call's rows in all."""
    ids = chunk.sample_ids
    req = trainer_pb2.UpdateRequest(batch=chunk.to_proto(), temperature=settings.temperature, step=step,
                                    kl_coef=kl_coef, batch_rows=batch_rows)
    if settings.use_critic:
        req.token_advantages.CopyFrom(to_proto(np.concatenate([adv_of[x] for x in ids]).astype(np.float32)))
    else:
        req.advantages.CopyFrom(to_proto(np.array([adv_of[x] for x in ids], dtype=np.float32)))
    if behavior:
        req.behavior_log_probs.CopyFrom(to_proto(np.concatenate([behavior[x] for x in ids]).astype(np.float32)))
    if old_lp:
        req.old_log_probs.CopyFrom(to_proto(np.concatenate([old_lp[x] for x in ids]).astype(np.float32)))
    if settings.kl_in_loss:
        missing = [x for x in ids if x not in ref_lp]
        if missing:
            raise IterationError(f"reference: no log-probs for {len(missing)} samples (first: {missing[:3]})")
        req.ref_log_probs.CopyFrom(to_proto(np.concatenate([ref_lp[x] for x in ids]).astype(np.float32)))
    return req

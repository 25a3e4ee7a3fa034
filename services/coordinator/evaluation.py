"""Evaluation through the services: sample each problem n times on rollout replicas, score on reward workers.

Used by `rlfabric eval` (services/coordinator/eval_cli.py) and by periodic validation during training
(`rlfabric.val_interval`). Generation streams prompt groups (token ids) to the replicas with
`expected_weights_version` 0 (whatever weights a replica holds) and a seed of its own, so evaluation samples
never repeat training's streams; each finished sample is decoded and sent on to the reward stream at once, so
scoring overlaps generation as in a training iteration. A sample that fails (engine error) scores 0 and keeps
its error. Accuracy figures come from services/coordinator/pass_at_k.py.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2
from services.common.tensors import to_numpy, to_proto
from services.coordinator.evaluation_data import EvalProblem
from services.coordinator.pass_at_k import summarize

_DONE = object()


@dataclass(frozen=True)
class EvalSettings:
    """How to sample and score: n samples per problem at `temperature` (0 = greedy), with these verifiers."""

    n: int = 1
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # None: fresh entropy (eval samples never repeat training's)
    verifiers: tuple[tuple[str, float], ...] = (("math_equiv", 1.0),)
    ks: tuple[int, ...] = (1,)
    threshold: float = 1.0  # a sample is correct when its reward reaches this
    deadline_s: float = 600.0
    group_prefix: str = "eval"


@dataclass
class EvalSample:
    """One scored sample (a row of the eval JSONL)."""

    dataset: str
    index: int
    sample: int
    problem: str
    ground_truth: str
    response: str
    reward: float
    scores: dict[str, float]
    prompt_length: int
    response_length: int
    finish_reason: str
    weights_version: int
    error: str = ""
    score_errors: dict[str, str] = field(default_factory=dict)


class EvaluationError(RuntimeError):
    """Evaluation could not complete; the message names the service and why."""


def _drain(q: queue.Queue) -> Iterator[Any]:
    while (item := q.get()) is not _DONE:
        yield item


def evaluate(replicas: Sequence[tuple[str, Any]], score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[Any]],
             problems: Sequence[EvalProblem], decode: Callable[[list[int]], str], settings: EvalSettings,
             progress: Callable[[int, int], None] | None = None) -> list[EvalSample]:
    """Samples and scores every problem `settings.n` times; returns the samples in (problem, sample) order.

    Args:
        replicas: (address, RolloutStub) of the replicas to generate on; problems go round-robin.
        score: the reward stream (a `RewardClientPool.score` or a worker's `Score`).
        decode: token ids -> text without special tokens.
        progress: called as progress(samples scored, samples expected) now and then.
    """
    if not replicas:
        raise EvaluationError("no rollout replica to generate on")
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    sampling = common_pb2.SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                         has_temperature=True, top_p=settings.top_p, top_k=settings.top_k,
                                         seed=seed, has_seed=True)
    by_group = {f"{settings.group_prefix}/{p.dataset}/{p.index}": p for p in problems}
    samples_q: queue.Queue = queue.Queue()
    errors: list[str] = []

    def generate(address: str, stub: Any, groups: list[str]) -> None:
        requests = [rollout_pb2.GenerateRequest(
            group=common_pb2.PromptGroup(group_id=g, prompt_token_ids=to_proto(by_group[g].prompt_ids), n=settings.n),
            expected_weights_version=0, sampling=sampling) for g in groups]
        try:
            for reply in stub.Generate(iter(requests), timeout=settings.deadline_s):
                samples_q.put(reply.sample)
        except grpc.RpcError as e:
            errors.append(f"rollout {address}: {e.code().name}: {e.details()}")
        finally:
            samples_q.put(_DONE)

    group_ids = list(by_group)
    threads = [threading.Thread(target=generate, args=(addr, stub, group_ids[r::len(replicas)]), daemon=True)
               for r, (addr, stub) in enumerate(replicas) if group_ids[r::len(replicas)]]
    for t in threads:
        t.start()
    samples, scores = _score_as_generated(samples_q, len(threads), score, by_group, decode, settings, progress,
                                          errors)
    for t in threads:
        t.join()
    if errors:
        raise EvaluationError(errors[0])
    return _assemble(samples, scores, by_group, decode, settings)


def _score_as_generated(samples_q: queue.Queue, producers: int, score: Callable, by_group: dict[str, EvalProblem],
                        decode: Callable[[list[int]], str], settings: EvalSettings,
                        progress: Callable[[int, int], None] | None,
                        errors: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collects generated samples and streams the successful ones to `score` as they arrive."""
    expected = len(by_group) * settings.n
    reward_q: queue.Queue = queue.Queue()
    scores: dict[str, Any] = {}
    specs = [reward_pb2.VerifierSpec(name=name, weight=w) for name, w in settings.verifiers]

    def run_scoring() -> None:
        try:
            for reply in score(_drain(reward_q)):
                scores[reply.sample_id] = reply
                if progress is not None and len(scores) % 64 == 0:
                    progress(len(scores), expected)
        except grpc.RpcError as e:
            errors.append(f"reward: {e.code().name}: {e.details()}")

    scorer = threading.Thread(target=run_scoring, name="eval-scoring", daemon=True)
    scorer.start()
    samples: dict[str, Any] = {}
    finished = 0
    while finished < producers:
        try:
            item = samples_q.get(timeout=settings.deadline_s)
        except queue.Empty:
            errors.append(f"rollout: {expected - len(samples)} of {expected} samples missing after "
                          f"{settings.deadline_s:.0f}s")
            break
        if item is _DONE:
            finished += 1
            continue
        if item.sample_id in samples:
            continue
        samples[item.sample_id] = item
        if not item.error:
            ids = to_numpy(item.response_token_ids).tolist() if item.response_length else []
            reward_q.put(reward_pb2.ScoreRequest(
                sample_id=item.sample_id, response=decode(ids), ground_truth=by_group[item.group_id].answer,
                verifiers=specs, response_length=item.response_length))
    reward_q.put(_DONE)
    scorer.join()
    return samples, scores


def _assemble(samples: dict[str, Any], scores: dict[str, Any], by_group: dict[str, EvalProblem],
              decode: Callable[[list[int]], str], settings: EvalSettings) -> list[EvalSample]:
    out = []
    position = {g: i for i, g in enumerate(by_group)}
    for x in sorted(samples.values(), key=lambda s: (position[s.group_id], s.index)):
        p = by_group[x.group_id]
        reply = scores.get(x.sample_id)
        error = x.error or ("" if reply is not None else "no score")
        ids = to_numpy(x.response_token_ids).tolist() if x.response_length else []
        out.append(EvalSample(
            dataset=p.dataset, index=p.index, sample=int(x.index), problem=p.problem, ground_truth=p.answer,
            response=decode(ids), reward=float(reply.reward) if reply is not None and not x.error else 0.0,
            scores={s.verifier: float(s.score) for s in reply.scores} if reply is not None else {},
            score_errors={s.verifier: s.error for s in reply.scores if s.error} if reply is not None else {},
            prompt_length=int(x.prompt_length), response_length=int(x.response_length),
            finish_reason=common_pb2.FinishReason.Name(x.finish_reason).removeprefix("FINISH_REASON_").lower(),
            weights_version=int(x.weights_version), error=error))
    missing = len(by_group) * settings.n - len(out)
    if missing:
        raise EvaluationError(f"rollout: {missing} samples never came back")
    return out


def summarize_samples(samples: Sequence[EvalSample], settings: EvalSettings) -> dict[str, dict[str, float]]:
    """Per dataset: pass@k for the ks that fit n, mean@n, problems, mean response length."""
    out: dict[str, dict[str, float]] = {}
    for dataset in dict.fromkeys(s.dataset for s in samples):
        rows = [s for s in samples if s.dataset == dataset]
        per_problem: dict[int, list[float]] = {}
        for s in rows:
            per_problem.setdefault(s.index, []).append(s.reward)
        ks = [k for k in settings.ks if k <= settings.n] or [1]
        figures = summarize(list(per_problem.values()), ks, settings.threshold)
        figures["response_length/mean"] = float(np.mean([s.response_length for s in rows]))
        out[dataset] = figures
    return out

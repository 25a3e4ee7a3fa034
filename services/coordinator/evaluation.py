"""Evaluation through the services: sample each problem n times on rollout replicas, score on reward workers.

Used by `rlfabric eval` (services/launcher/eval_cli.py) and by periodic validation during training
(services/coordinator/validation.py). The sampling and scoring are the training iteration's own
(`Generator` of services/coordinator/generation.py: token ids in, each finished sample scored as it arrives),
with the evaluation's sampling values and a seed of its own, so evaluation samples never repeat training's
streams. Problems go in chunks, so a long evaluation reports progress. A sample that fails (an engine error)
scores 0 and keeps its error. Accuracy figures come from services/coordinator/pass_at_k.py.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.v1 import common_pb2, reward_pb2
from services.common.tensors import to_numpy
from services.coordinator.evaluation_data import EvalProblem
from services.coordinator.generation import Generator, GroupPrompt
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.pass_at_k import summarize
from services.coordinator.settings import IterationSettings
from services.coordinator.weight_sync import Replica

# Problems per Generate call: small enough to report progress, large enough to keep the engine busy.
CHUNK_PROBLEMS = 128


@dataclass(frozen=True)
class EvalSettings:
    """How to sample and score: n samples per problem at `temperature` (0 = greedy), with these verifiers."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None  # None: fresh entropy (evaluation samples never repeat training's)
    verifiers: tuple[tuple[str, float], ...]
    ks: tuple[int, ...]
    threshold: float  # a sample is correct when its reward reaches this
    deadline_s: float
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


def generation_settings(s: EvalSettings, base: IterationSettings | None = None) -> IterationSettings:
    """The `Generator`'s settings for an evaluation: `base` (a run's) or neutral training fields, which the
    Generator does not read, with the evaluation's sampling, seed, verifiers and deadline."""
    sampling = {"n_samples_per_prompt": s.n, "max_tokens": s.max_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k, "min_p": 0.0,
                "seed": s.seed if s.seed is not None else secrets.randbits(63), "verifiers": s.verifiers,
                "deadline_s": s.deadline_s}
    if base is not None:
        return dataclasses.replace(base, **sampling)
    neutral = {"overlong_buffer_enable": False, "overlong_buffer": 0, "overlong_buffer_penalty_factor": 0.0,
               "rollout_max_tokens": 0, "filter_groups_enable": False, "filter_groups_metric": "",
               "filter_groups_max_batches": 0, "filter_groups_train_batch_size": 0, "use_reference": False,
               "skip_old_log_probs": True, "kl_ctrl_type": "fixed", "init_kl_coef": 0.0, "kl_target": None,
               "kl_horizon": None, "ref_forward_micro_batch_size": 1, "actor_forward_micro_batch_size": 1,
               "use_integrated_worker": False, "offload_train_param": False, "offload_train_grad": False,
               "offload_train_optimizer": False, "global_batch_size": 1, "world_size": 1,
               "log_max_throughput": False, "max_staleness": 0}
    return IterationSettings(**sampling, **neutral)


def evaluate(replicas: Sequence[Replica], score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[Any]],
             problems: Sequence[EvalProblem], decode: Callable[[Sequence[int]], str], settings: EvalSettings, *,
             weights_version: int = 0, base: IterationSettings | None = None,
             progress: Callable[[int, int], None] | None = None) -> list[EvalSample]:
    """Samples and scores every problem `settings.n` times; returns the samples in (problem, sample) order.

    Args:
        replicas: the rollout replicas to generate on; problems go round-robin.
        score: the reward stream (a `RewardClientPool.score` or a worker's `Score`).
        decode: token ids -> text without special tokens.
        weights_version: the version the replicas must hold (0: whatever they hold).
        base: a run's IterationSettings (validation), else neutral ones (`rlfabric eval`).
        progress: called as progress(problems done, problems) after each chunk.
    """
    generator = Generator(replicas, score, decode, generation_settings(settings, base))
    out: list[EvalSample] = []
    for start in range(0, len(problems), CHUNK_PROBLEMS):
        chunk = problems[start:start + CHUNK_PROBLEMS]
        prompts = [GroupPrompt(f"{settings.group_prefix}/{p.dataset}/{p.index}", p.prompt_ids, p.answer)
                   for p in chunk]
        for p, group in zip(chunk, generator.generate(prompts, weights_version, PhaseClock()), strict=True):
            out += [_sample(p, x, reply, decode) for x, reply in zip(group.samples, group.scores, strict=True)]
        if progress is not None:
            progress(start + len(chunk), len(problems))
    return out


def _sample(p: EvalProblem, x: common_pb2.Sample, reply: reward_pb2.ScoreResponse,
            decode: Callable[[Sequence[int]], str]) -> EvalSample:
    ids = to_numpy(x.response_token_ids).tolist() if x.response_length else []
    return EvalSample(
        dataset=p.dataset, index=p.index, sample=int(x.index), problem=p.problem, ground_truth=p.answer,
        response=decode(ids), reward=0.0 if x.error else float(reply.reward),
        scores={s.verifier: float(s.score) for s in reply.scores},
        score_errors={s.verifier: s.error for s in reply.scores if s.error},
        prompt_length=int(x.prompt_length), response_length=int(x.response_length),
        finish_reason=common_pb2.FinishReason.Name(x.finish_reason).removeprefix("FINISH_REASON_").lower(),
        weights_version=int(x.weights_version), error=x.error)


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

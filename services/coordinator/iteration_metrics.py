"""The seed's per-iteration metric table, computed from phase spans and the batch (pure functions).

Timing semantics follow MindSpeed-RL (`metrics_post_processing` and `metrics_sort` in its utils):
- each `timing/{phase}` is the wall span from the earliest start to the latest end over every record of
  that phase (ranks, micro-batches, replicas, generation batches);
- `timing/resharding_to_infer` and `timing/resharding_to_train` add up the durations of the transitions
  recorded as `resharding_enter_infer` + `resharding_exit_infer` and `resharding_enter_train` +
  `resharding_exit_train` (services/coordinator/placement.py says which calls each one covers);
- the non-overlap timings measure what the actor's old-log-prob pass did not hide. With
  `old_end` = the end of `old_log_p`, or when old log-probs were skipped the end of `reference_model`, or
  when neither ran the iteration start (MindSpeed-RL's 0):
  `non_overlap_reference_model = max(ref_end - max(old_end, ref_start), 0)` (0 without a reference),
  the same shape for `rule_reward` and `reward_model` (0 when they did not run), and
  `non_overlap_adv = max(adv_end - old_end, 0)`, or `timing/adv` itself when neither old log-probs nor a
  reference ran;
- throughput: (response_length/mean + prompt_length/mean) x prompts x n_samples_per_prompt / world_size /
  timing/{all|update|rollout} for `e2e_tps`, `update_tps` and `vllm_tps` (see `batch_metrics`).

`timeline_metrics` gives every recorded phase's `timeline/{phase}/start` and `/end`, in seconds since the
iteration's start, for the iteration-timeline chart (`rlfabric plot`).

With rule rewards only, `grpo/score/*` and `grpo/rewards/*` both describe the final per-sample reward;
they differ once a reward model (whose scores are normalised) joins.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SPAN_PHASES = ("rollout", "old_log_p", "reference_model", "rule_reward", "reward_model", "adv", "update",
               "ref_onload", "ref_offload")
# PPO's critic passes (MindSpeed-RL's names: the values pass is `critic_model`), logged in runs that have them.
CRITIC_PHASES = ("critic_model", "update_critic")
RESHARDING = {"resharding_to_infer": ("resharding_enter_infer", "resharding_exit_infer"),
              "resharding_to_train": ("resharding_enter_train", "resharding_exit_train")}


@dataclass
class PhaseClock:
    """Collects (start, end) records per phase, from any thread, in one clock (time.perf_counter)."""

    spans: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))

    def record(self, phase: str, start: float, end: float) -> None:
        if end < start:
            raise ValueError(f"phase {phase!r} ends ({end}) before it starts ({start})")
        self.spans[phase].append((start, end))

    def start(self, phase: str) -> float | None:
        records = self.spans.get(phase)
        return min(s for s, _ in records) if records else None

    def end(self, phase: str) -> float | None:
        records = self.spans.get(phase)
        return max(e for _, e in records) if records else None

    def span(self, phase: str) -> float:
        start, end = self.start(phase), self.end(phase)
        return 0.0 if start is None or end is None else end - start

    def total(self, phase: str) -> float:
        """The sum of the phase's record durations (for transitions that happen in several pieces)."""
        return sum(e - s for s, e in self.spans.get(phase, ()))


def timing_metrics(clock: PhaseClock, iteration_start: float, iteration_end: float) -> dict[str, float]:
    """`timing/*` for one iteration; `iteration_end` excludes logging and checkpointing."""
    out = {f"timing/{p}": clock.span(p) for p in SPAN_PHASES}
    out.update({f"timing/{p}": clock.span(p) for p in CRITIC_PHASES if p in clock.spans})
    out.update({f"timing/{name}": sum(clock.total(p) for p in parts) for name, parts in RESHARDING.items()})
    out["timing/all"] = iteration_end - iteration_start
    out.update(non_overlap_metrics(clock, iteration_start))
    return out


# Phases the coordinator computes itself (the rest are waits on a service call).
OWN_PHASES = frozenset({"adv"})


def coordinator_time(start: float, end: float, *clocks: PhaseClock) -> float:
    """Seconds of `start`..`end` during which no service call recorded on `clocks` was in flight.

    That is the coordinator's own time in the iteration (building requests, decoding, advantages, metrics,
    thread hand-offs): `timing/all` minus the union of every service phase's records, clipped to the span.
    """
    spans = sorted((max(s, start), min(e, end)) for c in clocks for phase, records in c.spans.items()
                   if phase not in OWN_PHASES for s, e in records if e > start and s < end)
    busy, cursor = 0.0, start
    for s, e in spans:
        if e > cursor:
            busy += e - max(s, cursor)
            cursor = e
    return max(0.0, (end - start) - busy)


def non_overlap_metrics(clock: PhaseClock, iteration_start: float) -> dict[str, float]:
    """The `timing/non_overlap_*` metrics, as MindSpeed-RL's `metrics_sort` computes them (module docstring)."""
    ref_end, old_end = clock.end("reference_model"), clock.end("old_log_p")
    if old_end is None:
        old_end = ref_end if ref_end is not None else iteration_start
    out = {}
    for phase in ("reference_model", "rule_reward", "reward_model"):
        start, end = clock.start(phase), clock.end(phase)
        out[f"timing/non_overlap_{phase}"] = 0.0 if start is None else max(0.0, end - max(old_end, start))
    if clock.end("old_log_p") is None and ref_end is None:
        out["timing/non_overlap_adv"] = clock.span("adv")
    else:
        adv_end = clock.end("adv")
        out["timing/non_overlap_adv"] = 0.0 if adv_end is None else max(0.0, adv_end - old_end)
    return out


def timeline_metrics(clock: PhaseClock, iteration_start: float) -> dict[str, float]:
    """`timeline/{phase}/start` and `/end` of every recorded phase, in seconds since the iteration's start."""
    out = {}
    for phase in sorted(clock.spans):
        out[f"timeline/{phase}/start"] = clock.start(phase) - iteration_start
        out[f"timeline/{phase}/end"] = clock.end(phase) - iteration_start
    return out


def _stats(prefix: str, values: Sequence[float] | np.ndarray) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(arr.mean()), f"{prefix}/max": float(arr.max()), f"{prefix}/min": float(arr.min())}


def batch_metrics(
    *,
    rewards: Sequence[float],
    verifier_scores: Mapping[str, Sequence[float]],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    global_batch_size: int,
    n_samples_per_prompt: int,
    world_size: int,
    timings: Mapping[str, float],
    log_max_throughput: bool = False,
    generated_prompts: int | None = None,
) -> dict[str, float]:
    """Reward, length, size and throughput metrics of one iteration (names as in the seed).

    `global_batch_size` is the number of prompts trained on, `generated_prompts` (default: the same) the
    number generated; they differ under DAPO dynamic sampling, where MindSpeed-RL counts the generated
    prompts in `e2e_tps` and `vllm_tps` and the trained ones in `update_tps`, all with the trained
    samples' mean lengths. `verifier_scores` are taken over whatever the caller passes (every generated
    sample, as MindSpeed-RL accumulates them)."""
    out: dict[str, float] = {}
    out.update(_stats("grpo/score", rewards))
    out.update(_stats("grpo/rewards", rewards))
    for name, scores in verifier_scores.items():
        out[f"{name}_rewards/mean"] = float(np.mean(scores)) if len(scores) else 0.0
    out.update(_stats("response_length", response_lengths))
    out.update(_stats("prompt_length", prompt_lengths))
    out["global_batch_size"] = float(global_batch_size)
    out["n_samples_per_prompt"] = float(n_samples_per_prompt)
    out["world_size"] = float(world_size)
    key = "max" if log_max_throughput else "mean"
    per_sample = out[f"response_length/{key}"] + out[f"prompt_length/{key}"]
    generated = global_batch_size if generated_prompts is None else generated_prompts
    for metric, phase, prompts in (("e2e_tps", "timing/all", generated), ("update_tps", "timing/update",
                                                                          global_batch_size),
                                   ("vllm_tps", "timing/rollout", generated)):
        seconds = timings.get(phase, 0.0)
        tokens = per_sample * prompts * n_samples_per_prompt
        out[metric] = tokens / world_size / seconds if seconds > 0 else 0.0
    return out

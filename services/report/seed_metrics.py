"""The seed's per-iteration metric table (the reference page's names) and a check that a logged record holds it.

`check_record` says what is wrong with one metrics record: a metric of the table missing or not finite, or a
throughput that does not follow from the logged lengths, sizes and times. The seed defines
    e2e_tps = (response_length/mean + prompt_length/mean) x global_batch_size x n_samples_per_prompt
              / world_size / timing/all
and the same with timing/update (`update_tps`) and timing/rollout (`vllm_tps`); with `log_max_throughput`
the lengths are the maxima instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SEED_TIMINGS = ("timing/all", "timing/update", "timing/rollout", "timing/old_log_p", "timing/reference_model",
                "timing/resharding_to_train", "timing/resharding_to_infer", "timing/adv",
                "timing/non_overlap_reference_model", "timing/non_overlap_rule_reward",
                "timing/non_overlap_reward_model", "timing/non_overlap_adv", "timing/rule_reward",
                "timing/reward_model", "timing/ref_onload", "timing/ref_offload")
SEED_TRAINING = ("actor/entropy", "actor/kl_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                 "grad_norm", "actor/lr")
SEED_REWARDS = ("grpo/score/mean", "grpo/score/max", "grpo/score/min", "grpo/rewards/mean", "grpo/rewards/max",
                "grpo/rewards/min")
SEED_SIZES = ("response_length/mean", "response_length/min", "response_length/max", "prompt_length/mean",
              "prompt_length/max", "prompt_length/min", "global_batch_size", "n_samples_per_prompt", "world_size")
SEED_THROUGHPUT = {"e2e_tps": "timing/all", "update_tps": "timing/update", "vllm_tps": "timing/rollout"}


# rlfabric's metrics of wall time beside the seed's timing/* and throughputs.
CLOCK_METRICS = ("val/seconds", "tool/latency_s_mean")


def reads_the_clock(name: str) -> bool:
    """Whether metric `name` measures wall time: what two runs of `rlfabric.deterministic` may differ in."""
    return name.startswith(("timing/", "timeline/")) or name in SEED_THROUGHPUT or name in CLOCK_METRICS


def seed_metric_names(verifiers: Sequence[str]) -> list[str]:
    """Every metric of the seed's table for a run scoring with `verifiers` (rl_config.verifier_function)."""
    return [*SEED_TIMINGS, *SEED_TRAINING, *(f"{v}_rewards/mean" for v in verifiers), *SEED_REWARDS,
            *SEED_SIZES, *SEED_THROUGHPUT]


def expected_throughput(record: Mapping[str, float], metric: str, log_max_throughput: bool = False) -> float:
    """What `metric` (e2e_tps, update_tps or vllm_tps) must be, from the record's own lengths, sizes and time."""
    key = "max" if log_max_throughput else "mean"
    tokens = (record[f"response_length/{key}"] + record[f"prompt_length/{key}"]) * record["global_batch_size"] \
        * record["n_samples_per_prompt"]
    seconds = record[SEED_THROUGHPUT[metric]]
    return tokens / record["world_size"] / seconds if seconds > 0 else 0.0


def check_record(record: Mapping[str, float], verifiers: Sequence[str], *, log_max_throughput: bool = False,
                 rel_tol: float = 1e-6) -> list[str]:
    """Problems of one iteration's record (empty when it holds the whole table, consistently)."""
    problems = []
    for name in seed_metric_names(verifiers):
        if name not in record:
            problems.append(f"{name} missing")
        elif not math.isfinite(record[name]):
            problems.append(f"{name} is {record[name]}")
    if problems:
        return problems
    for metric in SEED_THROUGHPUT:
        want = expected_throughput(record, metric, log_max_throughput)
        if not math.isclose(record[metric], want, rel_tol=rel_tol, abs_tol=1e-9):
            problems.append(f"{metric} {record[metric]:.6g} but the logged lengths, sizes and "
                            f"{SEED_THROUGHPUT[metric]} give {want:.6g}")
    return problems

"""Periodic validation during training: the current weights on held-out prompts, logged as `val/*`.

MindSpeed-RL's RL trainers have no validation (Megatron's `eval_interval`/`eval_iters` are an LM-loss
evaluation they do not read), so the keys are rlfabric's own, in the `rlfabric:` section:
`val_interval` (every N iterations, and after the last one; 0: never), `val_before_train` (also before the
first iteration, logged as iteration 0), `val_data_path` (a dataset prefix preprocessed like `data_path`,
with labels), `val_n_samples` and `val_temperature` (0: greedy).

Validation samples on the run's rollout replicas at the weights version just synced (never a stale one) and
scores on the run's reward workers with the run's verifiers, through `evaluation.evaluate`; in integrated mode
the replicas are woken for it and put back to sleep, as around a rollout. Its time is not part of the
iteration's `timing/all` (it is reported as `val/seconds`). Metrics: `val/pass@1`, and for n > 1 also
`val/pass@{n}` and `val/mean@{n}`, plus `val/response_length/mean` and `val/seconds`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.coordinator.evaluation import EvalSettings, evaluate, summarize_samples
from services.coordinator.evaluation_data import EvalProblem
from services.coordinator.iteration_metrics import PhaseClock
from services.data.indexed_reader import IndexedReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationPlan:
    """When to validate, on what, and how (from `cfg.rlfabric`)."""

    interval: int
    before_train: bool
    problems: tuple[EvalProblem, ...]
    settings: EvalSettings

    def due(self, iteration: int, train_iters: int) -> bool:
        return self.interval > 0 and (iteration % self.interval == 0 or iteration == train_iters)


def plan_from_config(cfg: Any, decode: Callable[[Sequence[int]], str]) -> ValidationPlan | None:
    """The run's validation plan, or None when it validates nothing; ValueError naming the key otherwise."""
    fab = cfg.rlfabric
    if fab.val_interval < 0:
        raise ValueError(f"rlfabric.val_interval must be >= 0, got {fab.val_interval}")
    if fab.val_interval == 0 and not fab.val_before_train:
        return None
    if not fab.val_data_path:
        raise ValueError("rlfabric.val_interval / val_before_train need rlfabric.val_data_path: a dataset prefix "
                         "preprocessed like megatron_training.data_path (`rlfabric preprocess`)")
    if fab.val_n_samples < 1 or fab.val_temperature < 0:
        raise ValueError(f"rlfabric.val_n_samples must be >= 1 and val_temperature >= 0, got {fab.val_n_samples} "
                         f"and {fab.val_temperature}")
    n = fab.val_n_samples
    rl, sampling = cfg.rl_config, cfg.generate_config.sampling_config
    settings = EvalSettings(n=n, max_tokens=sampling.max_tokens, temperature=fab.val_temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, seed=None,
                            verifiers=tuple(zip(rl.verifier_function, map(float, rl.verifier_weight), strict=True)),
                            ks=tuple(sorted({1, n})), threshold=1.0, deadline_s=fab.rpc_deadline_s)
    problems = load_validation_prompts(fab.val_data_path, int(rl.max_prompt_length), decode)
    return ValidationPlan(fab.val_interval, fab.val_before_train, tuple(problems), settings)


def load_validation_prompts(prefix: str, max_prompt_length: int,
                            decode: Callable[[Sequence[int]], str]) -> list[EvalProblem]:
    """Every prompt of a preprocessed dataset shorter than `max_prompt_length`, with its decoded label."""
    from services.common.errors import DataError

    prompts_prefix, labels_prefix = f"{prefix}_packed_input_ids_document", f"{prefix}_packed_labels_document"
    for p in (prompts_prefix, labels_prefix):
        if not IndexedReader.exists(p):
            raise DataError(f"rlfabric.val_data_path: no dataset at {p}.idx/.bin; run `rlfabric preprocess` with "
                            f"output_prefix {prefix} and dataset_additional_keys [labels]")
    prompts, labels = IndexedReader(prompts_prefix), IndexedReader(labels_prefix)
    out = []
    for i in range(len(prompts)):
        ids = prompts[i].astype(np.int32)
        if len(ids) < max_prompt_length:
            out.append(EvalProblem("val", i, decode(ids.tolist()), decode(labels[i].tolist()), ids))
    if not out:
        raise DataError(f"rlfabric.val_data_path {prefix}: no prompt shorter than max_prompt_length "
                        f"{max_prompt_length}")
    return out


class Validator:
    """Runs a ValidationPlan against a run's services (see module docstring).

    Args:
        replicas, score, decode: the run's rollout replicas, reward stream and detokenizer.
        base: the run's IterationSettings (deadline and the fields evaluation does not override).
        placement: the run's Placement (wakes integrated-mode replicas around validation).
    """

    def __init__(self, plan: ValidationPlan, replicas: Sequence[Any], score: Callable, decode: Callable,
                 base: Any, placement: Any) -> None:
        self.plan = plan
        self.replicas, self.score, self.decode = list(replicas), score, decode
        self.base = base
        self.placement = placement

    def validate(self, iteration: int, version: int) -> dict[str, float]:
        """`val/*` metrics of the weights at `version`, validated after `iteration` (0: before training)."""
        started = time.perf_counter()
        clock = PhaseClock()  # validation's transitions are not the iteration's: a clock of its own
        settings = self.plan.settings
        self.placement.enter_infer(clock, version)
        try:
            samples = evaluate(self.replicas, self.score, self.plan.problems, self.decode,
                               _with_prefix(settings, f"val{iteration}"), weights_version=version, base=self.base)
        finally:
            self.placement.exit_infer(clock)
        figures = summarize_samples(samples, settings)["val"]
        # With one sample per prompt mean@1 repeats pass@1 (for 1/0 rules): only pass@1 is logged then.
        out = {f"val/{k}": v for k, v in figures.items() if k not in ("problems", "mean@1")}
        out["val/seconds"] = time.perf_counter() - started
        logger.info("validation after iteration %d: %s", iteration,
                    ", ".join(f"{k} {v:.4g}" for k, v in sorted(out.items())))
        return out


def _with_prefix(settings: EvalSettings, prefix: str) -> EvalSettings:
    import dataclasses

    return dataclasses.replace(settings, group_prefix=prefix)


class Validation:
    """The run loop's hook: `start` once the replicas hold the starting weights, then one call per iteration.

    Without a plan every call returns nothing, so the loop calls it unconditionally.
    """

    def __init__(self, plan: ValidationPlan | None) -> None:
        self.plan = plan
        self._validator: Validator | None = None

    def start(self, replicas: Sequence[Any], score: Callable, decode: Callable, base: Any, placement: Any, *,
              iteration: int, version: int, sink: Any) -> None:
        """Binds the run's services; validates the starting weights when `val_before_train` on a fresh run."""
        if self.plan is None:
            return
        self._validator = Validator(self.plan, replicas, score, decode, base, placement)
        if self.plan.before_train and iteration == 0:
            sink.write(0, {"iteration": 0.0, "weights_version": float(version),
                           **self._validator.validate(0, version)})

    def after_iteration(self, iteration: int, train_iters: int, version: int) -> dict[str, float]:
        """`val/*` metrics when validation is due after `iteration`, else {}."""
        if self._validator is None or self.plan is None or not self.plan.due(iteration, train_iters):
            return {}
        return self._validator.validate(iteration, version)

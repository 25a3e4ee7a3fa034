"""DAPO dynamic sampling: drop prompt groups without reward spread, accumulate until the batch is full.

DAPO (https://arxiv.org/abs/2503.14476, section 3.2) observes that a group whose samples all get
the same score (all right or all wrong) has zero advantage everywhere and only dilutes the
gradient. With `rl_config.filter_groups_enable`, the coordinator generates batches of
`global_batch_size` prompts, keeps the groups whose `filter_groups_metric` (the per-sample scores of
that verifier, before weighting and shaping) has a spread (std > 0), and keeps generating until
`filter_groups_train_batch_size` prompts are kept. As in MindSpeed-RL (`RayDAPOTrainer.dynamic_sampling`),
after `filter_groups_max_batches` generation batches without reaching it the run fails
(`DynamicSamplingExhaustedError`); 0 or less means no limit.

Choices:
- "std > 0" is tested as max != min, which is what it means mathematically; a computed std of
  equal floats can be a rounding residue above 0 (std of [0.1, 0.1, 0.1] is 1.4e-17), which would
  keep a group whose advantages are all 0. With 0/1 or +-1 verifier scores both tests agree.
- A group of one sample is kept (it cannot have spread, and dropping it would never fill a
  batch), as MindSpeed-RL does.
- Kept groups beyond the target are dropped, first-come first-kept, so the trained batch has
  exactly `filter_groups_train_batch_size` prompts (MindSpeed-RL truncates the kept samples to the
  free slots of its training batch the same way).
- No limit (`filter_groups_max_batches <= 0`) is bounded by the data: when `data_batches` (one pass
  over the prompt set, the loader's batches per epoch) have been generated in one iteration without
  filling the batch, it stops with `DynamicSamplingExhaustedError` naming the data, where MindSpeed-RL
  would start the data over and over for ever.

Pure bookkeeping: groups are opaque objects (the coordinator's sample records); nothing here
talks to a service.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class DynamicSamplingExhaustedError(RuntimeError):
    """Raised when `filter_groups_max_batches` generation batches did not fill the training batch."""


def select_metric(sample_metrics: Mapping[str, Sequence[float]], metric: str) -> np.ndarray:
    """The per-sample values of `rl_config.filter_groups_metric` among the metrics on hand.

    Args:
        sample_metrics: metric name -> one value per sample (e.g. `"rewards"`, or a verifier's
            `"math_17k_acc"` scores).
        metric: the configured name.
    """
    if metric not in sample_metrics:
        raise ValueError(
            f"rl_config.filter_groups_metric {metric!r} is not a per-sample metric of this run; "
            f"available: {sorted(sample_metrics)}"
        )
    return np.asarray(sample_metrics[metric], dtype=np.float64)


def groups_with_spread(metric_values: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """Which groups to keep: True where the group's metric values are not all equal.

    Args:
        metric_values: `[num_groups * n]`, grouped contiguously (samples g*n .. g*n+n-1).
        n: group size (`rl_config.n_samples_per_prompt`).

    Returns:
        `[num_groups]` bool. Groups of size 1 are always kept.
    """
    values = np.asarray(metric_values, dtype=np.float64)
    if n < 1 or values.ndim != 1 or values.size % n:
        raise ValueError(f"{values.size} metric values do not split into groups of n_samples_per_prompt={n}")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"filter_groups_metric holds non-finite values at sample indices {bad[:8].tolist()}")
    groups = values.reshape(-1, n)
    if n == 1:
        return np.ones(groups.shape[0], dtype=bool)
    return groups.max(axis=1) != groups.min(axis=1)


@dataclass(frozen=True)
class SampledBatch(Generic[T]):
    """One filled training batch and how it was obtained.

    Attributes:
        groups: exactly `train_batch_size` groups, in the order they were kept.
        num_gen_batches: generation batches it took (logged as `train/num_gen_batches`, as
            MindSpeed-RL does).
        num_groups_seen: groups generated in those batches.
        num_groups_kept: groups with spread among them (>= len(groups); the surplus is dropped).
    """

    groups: list[T]
    num_gen_batches: int
    num_groups_seen: int
    num_groups_kept: int


@dataclass
class GroupAccumulator(Generic[T]):
    """Collects kept groups over generation batches until a training batch is full.

    Use per training iteration::

        acc = GroupAccumulator(train_batch_size=cfg.filter_groups_train_batch_size,
                               n_samples_per_prompt=n, max_batches=cfg.filter_groups_max_batches)
        while not acc.ready:
            groups, metric_values = generate_and_score_one_batch()
            acc.add(groups, metric_values)   # raises DynamicSamplingExhaustedError when out of tries
        batch = acc.take()                    # batch.groups: exactly train_batch_size groups

    Attributes:
        num_gen_batches: generation batches consumed so far this iteration.
        num_groups_seen: groups offered to `add` so far this iteration.
    """

    train_batch_size: int
    n_samples_per_prompt: int
    max_batches: int = 0
    data_batches: int = 0  # generation batches in one pass over the data; 0 = unknown
    num_gen_batches: int = field(default=0, init=False)
    num_groups_seen: int = field(default=0, init=False)
    _kept: list[T] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.train_batch_size < 1:
            raise ValueError(
                f"rl_config.filter_groups_train_batch_size must be >= 1, got {self.train_batch_size}"
            )

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    @property
    def ready(self) -> bool:
        return len(self._kept) >= self.train_batch_size

    def add(self, groups: Sequence[T], metric_values: Sequence[float] | np.ndarray) -> int:
        """Offer one generation batch; keep its groups with spread.

        Args:
            groups: `[num_groups]` group records, in the order of `metric_values`.
            metric_values: `[num_groups * n]` per-sample values of `filter_groups_metric`.

        Returns:
            How many of these groups were kept.

        Raises:
            DynamicSamplingExhaustedError: the batch is still not full after `max_batches` batches.
        """
        keep = groups_with_spread(metric_values, self.n_samples_per_prompt)
        if keep.size != len(groups):
            raise ValueError(
                f"{len(groups)} groups but {keep.size * self.n_samples_per_prompt} metric values; "
                f"pass n_samples_per_prompt={self.n_samples_per_prompt} values per group"
            )
        self.num_gen_batches += 1
        self.num_groups_seen += len(groups)
        kept = [group for group, k in zip(groups, keep, strict=True) if k]
        self._kept.extend(kept)
        if self.ready:
            return len(kept)
        if 0 < self.max_batches <= self.num_gen_batches:
            limit = f"generation batches (rl_config.filter_groups_max_batches={self.max_batches})"
        elif self.max_batches <= 0 and 0 < self.data_batches <= self.num_gen_batches:
            limit = (f"generation batches, every prompt of the data set once (filter_groups_max_batches="
                     f"{self.max_batches}, no limit, stops when the data runs out)")
        else:
            return len(kept)
        raise DynamicSamplingExhaustedError(
            f"dynamic sampling kept {len(self._kept)} of the {self.train_batch_size} prompts "
            f"needed (rl_config.filter_groups_train_batch_size) after {self.num_gen_batches} {limit}; "
            f"{self.num_groups_seen - len(self._kept)} of {self.num_groups_seen} groups had no spread in "
            "filter_groups_metric. Check that the rewards vary within a group (a too easy or too hard "
            "dataset, a broken verifier), raise filter_groups_max_batches (-1 = no limit), or lower "
            "filter_groups_train_batch_size."
        )

    def take(self) -> SampledBatch[T]:
        """The first `train_batch_size` kept groups and this iteration's counts; resets for the next."""
        if not self.ready:
            raise RuntimeError(
                f"take() before the batch is full: {len(self._kept)} of {self.train_batch_size} groups kept"
            )
        batch = SampledBatch(
            groups=self._kept[: self.train_batch_size],
            num_gen_batches=self.num_gen_batches,
            num_groups_seen=self.num_groups_seen,
            num_groups_kept=len(self._kept),
        )
        self._kept = []
        self.num_gen_batches = 0
        self.num_groups_seen = 0
        return batch

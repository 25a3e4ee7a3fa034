"""The estimator, loss and rollout-correction keys rlfabric takes from verl (`rlfabric.*`, verl's names), where
MindSpeed-RL has none: their value sets, the parsing of `rollout_rs`, and the rules `config check` applies.

- `rl_config.adv_estimator` (MindSpeed-RL's key) also takes verl's `rloo`, `reinforce_plus_plus`,
  `reinforce_plus_plus_baseline`; `rlfabric.norm_adv_by_std_in_grpo: false` is Dr.GRPO's group_norm (no std).
- `rlfabric.policy_loss_mode` (verl `actor.policy_loss.loss_mode`): vanilla | gspo;
  `rlfabric.loss_agg_mode` (verl `actor.loss_agg_mode`) and `loss_scale_factor` (its seq-mean-token-sum-norm
  divisor). Dr.GRPO = `norm_adv_by_std_in_grpo: false` + `loss_agg_mode: seq-mean-token-sum-norm`.
- `rlfabric.rollout_is`, `rollout_is_threshold`, `rollout_rs`, `rollout_rs_threshold` (verl
  `algorithm.rollout_correction.*`): services/trainer/rollout_correction.py applies them.

What verl would ignore (a key another choice makes unused) is refused here, naming both keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig
POLICY_LOSS_MODES = ("vanilla", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")
_ESTIMATORS = ("k1", "k2", "k3")
RS_OPTIONS = tuple(f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean") for k in _ESTIMATORS) + (
    "seq_max_k2", "seq_max_k3")
# Estimators whose advantages whiten returns over tokens: with a discount each token's return differs.
WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclasses.dataclass(frozen=True)
class RsOption:
    """One rejection criterion: `name` (a value of RS_OPTIONS) and its bounds on the statistic (k1: bounds on
    the log-ratio; k2, k3: `upper` only)."""

    name: str
    upper: float
    lower: float | None = None


def parse_rs(rollout_rs: str | None, threshold: str | float | None) -> tuple[RsOption, ...]:
    """`rlfabric.rollout_rs` and `rollout_rs_threshold` -> the criteria, as verl reads them.

    Options comma-separated; one threshold for all of them or one per option, comma-separated; a k1 option takes
    `lower_upper` ratio bounds, or `upper` meaning 1/upper .. upper. Raises ValueError naming the key.
    """
    if rollout_rs is None:
        return ()
    names = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    bad = [o for o in names if o not in RS_OPTIONS]
    if not names or bad:
        raise ValueError(f"rlfabric.rollout_rs: unknown option(s) {bad or [rollout_rs]}; "
                         f"options: {', '.join(RS_OPTIONS)}")
    if threshold is None:
        raise ValueError("rlfabric.rollout_rs needs rlfabric.rollout_rs_threshold")
    specs = [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rlfabric.rollout_rs_threshold: {len(specs)} thresholds for {len(names)} rollout_rs "
                         "options; give one for all or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_option(name, spec) for name, spec in zip(names, specs, strict=True))


def _option(name: str, spec: str) -> RsOption:
    try:
        if name.endswith("k1"):
            lower_s, upper_s = spec.split("_", 1) if "_" in spec else ("", spec)
            upper = float(upper_s)
            lower = float(lower_s) if lower_s else 1.0 / upper
            if "_" in upper_s:
                raise ValueError
            if lower <= 0 or upper <= 0:
                raise ValueError
            return RsOption(name, math.log(upper), math.log(lower))
        upper = float(spec)
        if upper <= 0 or "_" in spec:  # float() reads "0.5_1" as 0.51; verl refuses bounds on a k2/k3 option
            raise ValueError
    except ValueError:
        raise ValueError(f"rlfabric.rollout_rs_threshold: {spec!r} is not a positive threshold for {name} "
                         "(k1: `upper` or `lower_upper` ratio bounds; k2, k3: one number)") from None
    return RsOption(name, upper)


def loss_variant_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    """Refuse verl key combinations whose one key would do nothing, and bad values (module docstring)."""
    rl, fab, sources = cfg.rl_config, cfg.rlfabric, cfg.provenance.sources
    if rl.adv_estimator in WHITENED and rl.gamma != 1.0:
        yield Problem(("rl_config.gamma", "rl_config.adv_estimator"),
                      f"rl_config.gamma is {rl.gamma} with adv_estimator {rl.adv_estimator}: rlfabric trains one "
                      "advantage per sample (outcome rewards), so only gamma 1.0 (no discount) is supported")
    if not fab.norm_adv_by_std_in_grpo and rl.adv_estimator != "group_norm":
        yield Problem(("rlfabric.norm_adv_by_std_in_grpo", "rl_config.adv_estimator"),
                      f"rlfabric.norm_adv_by_std_in_grpo: false only changes group_norm, but adv_estimator is "
                      f"{rl.adv_estimator}; remove it or use group_norm")
    if fab.policy_loss_mode == "gspo" and fab.loss_agg_mode not in (None, "seq-mean-token-mean"):
        yield Problem(("rlfabric.loss_agg_mode", "rlfabric.policy_loss_mode"),
                      f"rlfabric.loss_agg_mode {fab.loss_agg_mode} with policy_loss_mode gspo: GSPO always "
                      "aggregates seq-mean-token-mean (as verl); remove loss_agg_mode")
    if fab.loss_agg_mode is not None and "rl_config.token_level_loss" in sources:
        yield Problem(("rlfabric.loss_agg_mode", "rl_config.token_level_loss"),
                      "rlfabric.loss_agg_mode and rl_config.token_level_loss both choose the loss aggregation; "
                      "set one of them")
    if fab.loss_scale_factor is not None and (fab.loss_scale_factor <= 0
                                              or fab.loss_agg_mode != "seq-mean-token-sum-norm"):
        yield Problem(("rlfabric.loss_scale_factor",),
                      f"rlfabric.loss_scale_factor ({fab.loss_scale_factor}) must be > 0 and is only read by "
                      "loss_agg_mode: seq-mean-token-sum-norm")
    yield from _correction_rules(fab, sources)


def _correction_rules(fab, sources: dict) -> Iterable[Problem]:
    if not fab.rollout_is_threshold > 0:
        yield Problem(("rlfabric.rollout_is_threshold",),
                      f"rlfabric.rollout_is_threshold must be > 0, got {fab.rollout_is_threshold}")
    if fab.rollout_is is None and "rlfabric.rollout_is_threshold" in sources:
        yield Problem(("rlfabric.rollout_is_threshold",),
                      "rlfabric.rollout_is_threshold is only read with rlfabric.rollout_is (token or sequence)")
    if fab.rollout_is is not None and "rlfabric.importance_sampling_cap" in sources:
        yield Problem(("rlfabric.importance_sampling_cap", "rlfabric.rollout_is"),
                      "rlfabric.rollout_is sets the importance weight in every mode, with rollout_is_threshold as "
                      "its truncation; remove importance_sampling_cap")
    if fab.rollout_rs is None and fab.rollout_rs_threshold is not None:
        yield Problem(("rlfabric.rollout_rs_threshold",),
                      "rlfabric.rollout_rs_threshold is only read with rlfabric.rollout_rs")
    try:
        parse_rs(fab.rollout_rs, fab.rollout_rs_threshold)
    except ValueError as e:
        keys = ("rlfabric.rollout_rs", "rlfabric.rollout_rs_threshold")
        keys = keys[::-1] if str(e).startswith(keys[1]) else keys
        yield Problem(keys, str(e).removeprefix(f"{keys[0]}: "))  # the report names the key already


def rollout_correction_on(fab) -> bool:
    """Whether the rollout's log-probs travel with every batch (any mode), for `rollout_is` / `rollout_rs`."""
    return fab.rollout_is is not None or fab.rollout_rs is not None

"""verl's estimator, loss and rollout-correction keys: what they load into, where they go, what is refused."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.config import loss_variants as lv
from services.common.config.rl import ADV_ESTIMATORS
from services.common.config.sections import LossAggMode, PolicyLossMode, RolloutIsLevel
from services.coordinator.settings import settings_from_config
from services.trainer import loss_agg
from services.trainer.options import loss_variant_from_config, worker_options_from_config

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "configs" / "grpo_tiny_cpu.yaml"
DAPO = REPO / "configs" / "dapo_tiny_cpu.yaml"


def test_value_sets_have_one_spelling() -> None:
    assert typing.get_args(PolicyLossMode) == lv.POLICY_LOSS_MODES
    assert typing.get_args(LossAggMode) == lv.LOSS_AGG_MODES == tuple(loss_agg.LOSS_AGG_MODES)
    assert typing.get_args(RolloutIsLevel) == lv.IS_LEVELS
    assert ADV_ESTIMATORS == ("group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def test_unset_is_the_mindspeed_run() -> None:
    cfg = load_config(GRPO)
    s, variant = settings_from_config(cfg), loss_variant_from_config(cfg)
    assert (s.adv_estimator, s.norm_adv_by_std_in_grpo, s.rollout_correction) == ("group_norm", True, False)
    assert (variant.policy_loss_mode, variant.loss_agg_mode, variant.loss_scale_factor) == ("vanilla", None, None)
    # the rollout's log-probs may come with the batch for rollout_mismatch/*; no weight, no rejection touch the loss
    assert (variant.correction.is_level, variant.correction.rs) == (None, ())


def test_dr_grpo_keys_reach_the_coordinator_and_the_trainer() -> None:
    cfg = load_config(GRPO, overrides=["rlfabric.norm_adv_by_std_in_grpo=false",
                                       "rlfabric.loss_agg_mode=seq-mean-token-sum-norm"])
    assert not settings_from_config(cfg).norm_adv_by_std_in_grpo
    opts, _ = worker_options_from_config(cfg)
    assert opts.update.variant.loss_agg_mode == "seq-mean-token-sum-norm"
    # verl divides by its padded response width, its max response length: here sampling_config.max_tokens
    assert opts.update.variant.loss_scale_factor == float(cfg.generate_config.sampling_config.max_tokens) == 64.0
    chosen = load_config(GRPO, overrides=["rlfabric.loss_agg_mode=seq-mean-token-sum-norm",
                                          "rlfabric.loss_scale_factor=100"])
    assert loss_variant_from_config(chosen).loss_scale_factor == 100.0


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_every_estimator_loads_and_reaches_the_coordinator(estimator: str) -> None:
    assert settings_from_config(load_config(GRPO, overrides=[f"rl_config.adv_estimator={estimator}"])).adv_estimator \
        == estimator


def test_gspo_under_dapo() -> None:
    cfg = load_config(DAPO, overrides=["rlfabric.policy_loss_mode=gspo"])
    assert loss_variant_from_config(cfg).policy_loss_mode == "gspo"


def test_rollout_correction_in_synchronous_mode() -> None:
    cfg = load_config(GRPO, overrides=["rlfabric.rollout_is=sequence", "rlfabric.rollout_is_threshold=3.0",
                                       "rlfabric.rollout_rs=token_k1,seq_max_k2", "rlfabric.rollout_rs_threshold=0.5_2,1"])
    assert cfg.rlfabric.max_staleness == 0 and settings_from_config(cfg).rollout_correction  # log-probs travel
    corr = loss_variant_from_config(cfg).correction
    assert (corr.is_level, corr.is_threshold) == ("sequence", 3.0)
    assert [o.name for o in corr.rs] == ["token_k1", "seq_max_k2"] and corr.rs[1].upper == 1.0


def test_rejection_alone_keeps_pipelined_modes_truncation() -> None:
    cfg = load_config(GRPO, overrides=["rl_config.use_integrated_worker=false", "rlfabric.max_staleness=1",
                                       "rlfabric.importance_sampling_cap=1.7", "rlfabric.rollout_rs=token_k2",
                                       "rlfabric.rollout_rs_threshold=0.4"])
    corr = loss_variant_from_config(cfg).correction
    assert (corr.is_level, corr.is_threshold, corr.rs[0].name) == ("token", 1.7, "token_k2")
    sync = loss_variant_from_config(load_config(GRPO, overrides=["rlfabric.rollout_rs=token_k2",
                                                                 "rlfabric.rollout_rs_threshold=0.4"]))
    assert sync.correction.is_level is None  # synchronous: no weight unless rollout_is asks for one


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["rl_config.adv_estimator=reinforce_plus_plus", "rl_config.gamma=0.99"], "rl_config.gamma", "only gamma 1.0"),
    (["rl_config.adv_estimator=rloo", "rlfabric.norm_adv_by_std_in_grpo=false"], "rlfabric.norm_adv_by_std_in_grpo",
     "only changes group_norm"),
    (["rlfabric.policy_loss_mode=gspo", "rlfabric.loss_agg_mode=token-mean"], "rlfabric.loss_agg_mode",
     "GSPO always aggregates"),
    (["rlfabric.loss_agg_mode=token-mean", "rl_config.token_level_loss=true"], "rlfabric.loss_agg_mode", "set one"),
    (["rlfabric.loss_scale_factor=10"], "rlfabric.loss_scale_factor", "seq-mean-token-sum-norm"),
    (["rlfabric.rollout_is_threshold=3.0"], "rlfabric.rollout_is_threshold", "only read with rlfabric.rollout_is"),
    (["rlfabric.rollout_is=token", "rlfabric.rollout_is_threshold=0"], "rlfabric.rollout_is_threshold", "> 0"),
    (["rlfabric.rollout_is=token", "rlfabric.importance_sampling_cap=3.0"], "rlfabric.importance_sampling_cap",
     "remove importance_sampling_cap"),
    (["rlfabric.rollout_rs_threshold=2.0"], "rlfabric.rollout_rs_threshold", "only read with rlfabric.rollout_rs"),
    (["rlfabric.rollout_rs=token_k9", "rlfabric.rollout_rs_threshold=2.0"], "rlfabric.rollout_rs", "unknown option"),
    (["rlfabric.rollout_rs=token_k2"], "rlfabric.rollout_rs", "needs rlfabric.rollout_rs_threshold"),
    (["rlfabric.rollout_rs=token_k2", "rlfabric.rollout_rs_threshold=abc"], "rlfabric.rollout_rs_threshold",
     "not a positive threshold"),
    (["rlfabric.rollout_is=tokens"], "rlfabric.rollout_is", "token"),
    (["rlfabric.policy_loss_mode=sapo"], "rlfabric.policy_loss_mode", "gspo"),
    (["rl_config.adv_estimator=gae"], "rl_config.adv_estimator", "needs a critic"),
])
def test_refused_naming_the_key(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(GRPO, overrides=overrides)
    assert key in [i.key for i in exc.value.issues], str(exc.value)
    assert words in str(exc.value)


def test_token_level_loss_is_reported_unused_under_gspo() -> None:
    from services.common.config.algorithm import inactive_keys

    cfg = load_config(DAPO, overrides=["rlfabric.policy_loss_mode=gspo", "rl_config.token_level_loss=true"])
    assert "gspo" in inactive_keys(cfg)["rl_config.token_level_loss"]

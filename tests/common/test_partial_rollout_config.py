"""MindSpeed-RL's partial rollout (`rl_config.partial_rollout_max_split` N > 1), on the config and trainer side.

A response is generated in chunks of max_tokens // N over at most N iterations, a cut one continued with newer
weights: the config accepts it where rlfabric can continue responses (max_tokens divisible by N, single turn, no
dynamic sampling, no critic), the staleness fence allows N - 1 more versions of lag, and the loss weights the
off-policy tokens by the token-level truncated importance ratio by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.weight_version import outside_fence, staleness_bound
from services.trainer.options import (
    loss_variant_from_config,
    update_options_from_config,
    worker_options_from_config,
)

SPLIT = "rl_config.partial_rollout_max_split"


def _issues(path: Path, overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides=overrides)
    return [(issue.key, issue.message) for issue in exc.value.issues]


@pytest.mark.parametrize(("max_staleness", "split", "bound"),
                         [(0, 1, 0), (1, 1, 1), (0, 2, 1), (1, 2, 2), (0, 3, 2), (1, 3, 3), (0, 8, 7)])
def test_staleness_bound_adds_split_minus_one(max_staleness: int, split: int, bound: int) -> None:
    assert staleness_bound(max_staleness, split) == bound


def test_the_fence_at_the_bound_admits_a_continued_response_and_nothing_older() -> None:
    # Synchronous, split 3: at actor version 10 a response started with version 8 and finished with 10 trains.
    bound = staleness_bound(0, 3)
    assert outside_fence([8, 9, 10], 10, bound) == []
    assert outside_fence([7, 8, 10], 10, bound) == [7]


def test_an_upstream_config_with_partial_rollout_loads(repo_root: Path) -> None:
    # grpo_qwen25_7b_A3: max_tokens 2048, integrated mode (synchronous), GRPO.
    cfg = load_config(repo_root / "configs/grpo_qwen25_7b_A3.yaml", overrides=[f"{SPLIT}=2"])
    assert cfg.rl_config.partial_rollout_max_split == 2
    assert cfg.generate_config.sampling_config.max_tokens == 2048
    assert not [w for w in cfg.warnings if "partial_rollout" in w]


def test_require_max_age_all_finished_is_accepted_either_way(repo_root: Path) -> None:
    for value in ("true", "false"):
        cfg = load_config(repo_root / "configs/grpo_qwen25_7b_A3.yaml",
                          overrides=[f"{SPLIT}=2", f"rl_config.require_max_age_all_finished={value}"])
        assert cfg.rl_config.require_max_age_all_finished is (value == "true")


def test_partial_rollout_is_allowed_deterministic_in_synchronous_mode(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml",
                      overrides=[f"{SPLIT}=4", "rlfabric.deterministic=true", "rlfabric.max_staleness=0"])
    assert (cfg.rl_config.partial_rollout_max_split, cfg.rlfabric.deterministic) == (4, True)


def test_partial_rollout_in_pipelined_mode_loads_and_max_staleness_goes_to_4(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[f"{SPLIT}=2", "rlfabric.max_staleness=1"])
    assert (cfg.rlfabric.max_staleness, cfg.rl_config.partial_rollout_max_split) == (1, 2)
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[f"{SPLIT}=2", "rlfabric.max_staleness=4"])
    assert staleness_bound(cfg.rlfabric.max_staleness, cfg.rl_config.partial_rollout_max_split) == 5
    for depth in (5, -1):
        issues = _issues(repo_root / "configs/grpo_tiny_cpu.yaml", [f"{SPLIT}=2", f"rlfabric.max_staleness={depth}"])
        assert [key for key, _ in issues] == ["rlfabric.max_staleness"]
        assert f"must be 0 (synchronous) to 4 (pipelined: the rollout runs up to that many iterations ahead), " \
               f"got {depth}" in issues[0][1]


def test_max_tokens_not_divisible_by_the_split_is_refused(repo_root: Path) -> None:
    # grpo_tiny_cpu: max_tokens 64.
    issues = _issues(repo_root / "configs/grpo_tiny_cpu.yaml", [f"{SPLIT}=5"])
    assert [key for key, _ in issues] == [SPLIT]
    message = issues[0][1]
    assert "partial_rollout_max_split (5) must divide generate_config.sampling_config.max_tokens (64)" in message
    assert "(e.g. 60)" in message
    # max_tokens below the split: the example is the split itself.
    issues = _issues(repo_root / "configs/grpo_tiny_cpu.yaml",
                     [f"{SPLIT}=8", "generate_config.sampling_config.max_tokens=6"])
    assert [key for key, _ in issues] == [SPLIT] and "(e.g. 8)" in issues[0][1]


@pytest.mark.parametrize("value", [0, -1])
def test_a_split_below_one_is_refused(repo_root: Path, value: int) -> None:
    issues = _issues(repo_root / "configs/grpo_tiny_cpu.yaml", [f"{SPLIT}={value}"])
    assert issues == [(SPLIT, f"rl_config.partial_rollout_max_split must be at least 1 (1: no partial rollout; "
                              f"N > 1: a response is generated over at most N iterations), got {value}")]


@pytest.mark.parametrize(("config", "extra", "needles"), [
    ("dapo_tiny_cpu.yaml", [], ["DAPO's dynamic sampling", "set filter_groups_enable: false"]),
    ("ppo_demo_cpu.yaml", [], ["PPO's critic", "train GRPO or DAPO (no critic_config)"]),
    ("grpo_multi_turn_demo_cpu.yaml", [], ["multi-turn rollouts", "set multi_turn_enable: false"]),
    ("grpo_demo_moe_cpu.yaml", [], ["routing replay", "set routing_replay: none"]),
], ids=["dynamic-sampling", "ppo-critic", "multi-turn", "routing-replay"])
def test_partial_rollout_is_refused_with_what_it_cannot_continue(repo_root: Path, config: str, extra: list[str],
                                                                 needles: list[str]) -> None:
    issues = _issues(repo_root / "configs" / config, [f"{SPLIT}=2", *extra])
    assert [key for key, _ in issues] == [SPLIT]
    message = issues[0][1]
    assert message.startswith("rl_config.partial_rollout_max_split (2) asks for partial rollout with ")
    for needle in needles:
        assert needle in message
    # Each config loads without partial rollout.
    load_config(repo_root / "configs" / config, overrides=extra)


def test_dapo_without_dynamic_sampling_takes_partial_rollout(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs/dapo_tiny_cpu.yaml",
                      overrides=[f"{SPLIT}=2", "rl_config.filter_groups_enable=false"])
    assert cfg.rl_config.partial_rollout_max_split == 2 and not cfg.derived.dynamic_sampling


@pytest.mark.parametrize(("max_staleness", "split", "fence"), [(0, 1, 0), (1, 1, 1), (0, 2, 1), (1, 3, 3)])
def test_the_update_fence_allows_the_split_minus_one_more_versions(repo_root: Path, max_staleness: int, split: int,
                                                                   fence: int) -> None:
    # grpo_tiny_cpu is disaggregated (use_integrated_worker: false), so max_staleness 1 loads; max_tokens 64 -> 60.
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml",
                      overrides=[f"rlfabric.max_staleness={max_staleness}", f"{SPLIT}={split}",
                                 "generate_config.sampling_config.max_tokens=60"])
    assert update_options_from_config(cfg).max_staleness == fence
    opts, _ = worker_options_from_config(cfg, "actor")
    assert opts.update.max_staleness == fence


def test_synchronous_partial_rollout_weights_tokens_by_the_truncated_ratio(repo_root: Path) -> None:
    path = repo_root / "configs/grpo_tiny_cpu.yaml"
    plain = loss_variant_from_config(load_config(path, overrides=["rlfabric.max_staleness=0"])).correction
    assert plain.is_level is None  # synchronous without partial rollout: measured only
    cfg = load_config(path, overrides=["rlfabric.max_staleness=0", f"{SPLIT}=2",
                                       "rlfabric.importance_sampling_cap=3.5"])
    correction = loss_variant_from_config(cfg).correction
    assert (correction.is_level, correction.is_threshold) == ("token", 3.5)
    assert update_options_from_config(cfg).variant.correction.is_level == "token"


def test_an_explicit_rollout_is_wins_over_the_partial_rollout_default(repo_root: Path) -> None:
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml",
                      overrides=[f"{SPLIT}=2", "rlfabric.rollout_is=sequence", "rlfabric.rollout_is_threshold=1.5"])
    correction = loss_variant_from_config(cfg).correction
    assert (correction.is_level, correction.is_threshold) == ("sequence", 1.5)


def test_deterministic_refuses_the_asynchronous_engine_and_not_the_chunked_scheme(repo_root: Path) -> None:
    """Where an interrupt lands depends on timing; the chunked rounds do not."""
    config = repo_root / "configs" / "grpo_tiny_cpu.yaml"
    common = [f"{SPLIT}=2", "rlfabric.deterministic=true", "generate_config.sampling_config.seed=1"]
    issues = _issues(config, [*common, "rl_config.async_engine=true"])
    assert [key for key, _ in issues] == ["rlfabric.deterministic"]
    assert "asynchronous engine" in issues[0][1] and "async_engine: false" in issues[0][1]
    load_config(config, overrides=common)

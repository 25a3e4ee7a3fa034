"""The seed-table check: complete, finite, and throughputs that follow from the logged lengths, sizes and times."""

from __future__ import annotations

import pytest

from services.report.seed_metrics import check_record, expected_throughput, seed_metric_names


def record() -> dict[str, float]:
    r = {name: 0.0 for name in seed_metric_names(["my_rule"])}
    r.update({"response_length/mean": 4.0, "prompt_length/mean": 6.0, "response_length/max": 8.0,
              "prompt_length/max": 7.0, "global_batch_size": 8.0, "n_samples_per_prompt": 8.0, "world_size": 2.0,
              "timing/all": 0.5, "timing/update": 0.1, "timing/rollout": 0.2})
    # (4 + 6) x 8 x 8 / 2 = 320 tokens per device: / 0.5 s, / 0.1 s, / 0.2 s.
    r.update({"e2e_tps": 640.0, "update_tps": 3200.0, "vllm_tps": 1600.0})
    return r


def test_a_consistent_record_passes() -> None:
    assert check_record(record(), ["my_rule"]) == []
    assert "my_rule_rewards/mean" in seed_metric_names(["my_rule"])


def test_missing_and_non_finite_metrics_are_named() -> None:
    r = record()
    del r["actor/ppo_kl"]
    r["grad_norm"] = float("nan")
    assert check_record(r, ["my_rule"]) == ["actor/ppo_kl missing", "grad_norm is nan"]
    assert check_record(record(), ["other_rule"]) == ["other_rule_rewards/mean missing"]


def test_an_inconsistent_throughput_is_caught() -> None:
    r = record()
    r["e2e_tps"] = 1280.0  # as if world_size were ignored
    (problem,) = check_record(r, ["my_rule"])
    assert problem.startswith("e2e_tps 1280 but") and "640" in problem


def test_log_max_throughput_uses_the_maxima() -> None:
    # (8 + 7) x 8 x 8 / 2 / 0.5 = 960.
    assert expected_throughput(record(), "e2e_tps", log_max_throughput=True) == pytest.approx(960.0)

"""The seed's metric semantics, worked by hand."""

from __future__ import annotations

import pytest

from services.coordinator.iteration_metrics import PhaseClock, batch_metrics, timeline_metrics, timing_metrics


def test_spans_run_from_earliest_start_to_latest_end() -> None:
    clock = PhaseClock()
    clock.record("rollout", 1.0, 4.0)  # replica 0
    clock.record("rollout", 2.0, 6.0)  # replica 1
    t = timing_metrics(clock, iteration_start=0.0, iteration_end=12.0)
    assert t["timing/rollout"] == 5.0  # 6 - 1, not 3 + 4
    assert t["timing/all"] == 12.0
    assert t["timing/update"] == 0.0  # phases that did not run report 0


def test_resharding_timings_add_up_their_transitions() -> None:
    # Integrated mode: enter inference (wake, sync, offload) 0.5 s before the rollout, exit (sleep) 0.25 s after
    # it; enter training (onload) 0.75 s before the update, exit (offload) 0.125 s after it.
    clock = PhaseClock()
    clock.record("resharding_enter_infer", 0.0, 0.5)
    clock.record("rollout", 0.5, 4.0)
    clock.record("resharding_exit_infer", 4.0, 4.25)
    clock.record("resharding_enter_train", 6.0, 6.75)
    clock.record("update", 6.75, 9.0)
    clock.record("resharding_exit_train", 9.0, 9.125)
    t = timing_metrics(clock, 0.0, 9.5)
    assert t["timing/resharding_to_infer"] == 0.75  # 0.5 + 0.25, not the 4.25 s wall span around the rollout
    assert t["timing/resharding_to_train"] == 0.875  # 0.75 + 0.125


def test_non_overlap_is_what_old_log_p_did_not_hide() -> None:
    clock = PhaseClock()
    clock.record("rollout", 0.0, 5.0)
    clock.record("old_log_p", 5.0, 7.0)
    clock.record("reference_model", 3.0, 8.5)  # overlaps rollout and old_log_p; 1.5 s sticks out
    clock.record("rule_reward", 1.0, 6.0)  # fully hidden
    clock.record("adv", 8.5, 8.75)
    t = timing_metrics(clock, 0.0, 9.0)
    assert t["timing/non_overlap_reference_model"] == 1.5  # 8.5 - max(7.0, 3.0)
    assert t["timing/non_overlap_rule_reward"] == 0.0  # 6 - 7 clipped at 0
    assert t["timing/non_overlap_adv"] == 1.75  # 8.75 - 7.0
    assert t["timing/non_overlap_reward_model"] == 0.0  # did not run


def test_without_old_log_p_the_reference_end_stands_in_for_it() -> None:
    # MindSpeed-RL's metrics_sort: old_log_p_end_time = reference_end_time when old log-probs were skipped.
    clock = PhaseClock()
    clock.record("rollout", 10.0, 15.0)
    clock.record("reference_model", 14.0, 16.0)
    clock.record("rule_reward", 11.0, 17.0)  # ends 1 s after the reference
    clock.record("adv", 15.0, 15.5)  # computed before the log-prob passes end: hidden
    t = timing_metrics(clock, 10.0, 18.0)
    assert t["timing/non_overlap_reference_model"] == 0.0  # 16 - max(16, 14)
    assert t["timing/non_overlap_rule_reward"] == 1.0  # 17 - max(16, 11)
    assert t["timing/non_overlap_adv"] == 0.0  # 15.5 - 16 clipped at 0


def test_with_neither_pass_the_iteration_start_stands_in_and_adv_is_all_exposed() -> None:
    # No reference (DAPO), old log-probs skipped: old_log_p_end is MindSpeed-RL's 0 (here the iteration start),
    # so the reward's non-overlap is its whole span and non_overlap_adv is timing/adv.
    clock = PhaseClock()
    clock.record("rollout", 10.0, 15.0)
    clock.record("rule_reward", 11.0, 15.5)
    clock.record("adv", 15.5, 15.75)
    t = timing_metrics(clock, 10.0, 18.0)
    assert t["timing/non_overlap_reference_model"] == 0.0
    assert t["timing/non_overlap_rule_reward"] == 4.5  # 15.5 - max(10, 11)
    assert t["timing/non_overlap_adv"] == 0.25 == t["timing/adv"]


def test_timeline_gives_every_phase_in_seconds_since_the_iteration_start() -> None:
    clock = PhaseClock()
    clock.record("rollout", 101.0, 104.0)
    clock.record("rollout", 101.5, 105.0)
    clock.record("update", 106.0, 107.5)
    assert timeline_metrics(clock, 100.0) == {
        "timeline/rollout/start": 1.0, "timeline/rollout/end": 5.0,
        "timeline/update/start": 6.0, "timeline/update/end": 7.5}


def test_a_phase_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="ends"):
        PhaseClock().record("update", 2.0, 1.0)


def test_batch_metrics_and_throughput() -> None:
    m = batch_metrics(
        rewards=[1.0, 0.0, 1.0, 0.0],
        verifier_scores={"math_17k_acc": [1.0, 0.0, 1.0, 0.0]},
        prompt_lengths=[10, 10, 14, 14],
        response_lengths=[20, 30, 40, 10],
        global_batch_size=2,
        n_samples_per_prompt=2,
        world_size=2,
        timings={"timing/all": 4.0, "timing/update": 1.0, "timing/rollout": 2.0},
    )
    assert m["grpo/score/mean"] == 0.5 and m["grpo/rewards/max"] == 1.0 and m["grpo/rewards/min"] == 0.0
    assert m["math_17k_acc_rewards/mean"] == 0.5
    assert (m["response_length/mean"], m["response_length/min"], m["response_length/max"]) == (25.0, 10.0, 40.0)
    assert m["prompt_length/mean"] == 12.0
    # (25 + 12) * 2 * 2 / 2 = 74 tokens per device
    assert m["e2e_tps"] == 74 / 4.0 and m["update_tps"] == 74.0 and m["vllm_tps"] == 37.0
    assert (m["global_batch_size"], m["n_samples_per_prompt"], m["world_size"]) == (2.0, 2.0, 2.0)


def test_log_max_throughput_uses_max_lengths() -> None:
    m = batch_metrics(rewards=[0.0, 0.0], verifier_scores={}, prompt_lengths=[10, 20], response_lengths=[5, 15],
                      global_batch_size=1, n_samples_per_prompt=2, world_size=1, timings={"timing/all": 2.0},
                      log_max_throughput=True)
    assert m["e2e_tps"] == (15 + 20) * 2 / 2.0


def test_dapo_throughputs_count_generated_prompts_for_rollout_and_e2e_and_trained_ones_for_update() -> None:
    # 2 prompts trained (n 2), 6 generated; trained lengths: response mean 25, prompt mean 12 -> 37 per sample.
    m = batch_metrics(rewards=[1.0, 0.0, 1.0, 0.0], verifier_scores={"acc": [1.0, 0.0] * 6},
                      prompt_lengths=[10, 10, 14, 14], response_lengths=[20, 30, 40, 10], global_batch_size=2,
                      generated_prompts=6, n_samples_per_prompt=2, world_size=1,
                      timings={"timing/all": 4.0, "timing/update": 1.0, "timing/rollout": 2.0})
    assert m["e2e_tps"] == 37 * 6 * 2 / 4.0  # generated prompts
    assert m["vllm_tps"] == 37 * 6 * 2 / 2.0  # generated prompts
    assert m["update_tps"] == 37 * 2 * 2 / 1.0  # trained prompts
    assert m["global_batch_size"] == 2.0 and m["acc_rewards/mean"] == 0.5  # verifier mean over all 12 passed


def test_coordinator_time_is_the_span_no_service_call_covers() -> None:
    from services.coordinator.iteration_metrics import coordinator_time

    a, b = PhaseClock(), PhaseClock()
    a.record("rollout", 1.0, 3.0)
    a.record("rule_reward", 2.0, 4.0)  # overlaps the rollout: counted once
    a.record("adv", 4.0, 5.0)  # the coordinator's own computation
    a.record("update", 6.0, 8.0)
    b.record("rollout", 7.0, 9.5)  # the next iteration's rollout, beside this one; clipped at the end
    # span 0..10: busy 1..4 and 6..9.5 (3 + 3.5), own 3.5
    assert coordinator_time(0.0, 10.0, a, b) == pytest.approx(3.5)
    assert coordinator_time(0.0, 10.0, a) == pytest.approx(5.0)

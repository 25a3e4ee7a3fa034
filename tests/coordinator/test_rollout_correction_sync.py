"""The coordinator's side of verl's keys: the estimator it computes, and the rollout's log-probs it sends to the
trainer in synchronous mode (GrpoIteration._train, with the services faked)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlfabric.v1 import common_pb2, reward_pb2
from services.common.config import load_config
from services.common.tensors import to_proto
from services.coordinator.errors import IterationError
from services.coordinator.generation import Group, GroupPrompt
from services.coordinator.iteration import GrpoIteration, Rollout
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.off_policy import behavior_log_probs
from services.coordinator.rewards import TrainBatch
from services.coordinator.settings import settings_from_config

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"


def _group(rewards: list[float], lengths: list[int]) -> Group:
    samples = [common_pb2.Sample(sample_id=f"g/{i}", group_id="g", index=i, weights_version=7, response_length=n,
                                 response_token_ids=to_proto(np.arange(n, dtype=np.int32)),
                                 response_log_probs=to_proto(np.full(n, -0.25 * (i + 1), np.float32)))
               for i, n in enumerate(lengths)]
    return Group(GroupPrompt("g", np.array([1], np.int32), ""), samples,
                 [reward_pb2.ScoreResponse(reward=r) for r in rewards])


def _loop(*overrides: str, old_lp: dict | None = None) -> tuple[GrpoIteration, dict]:
    loop = GrpoIteration.__new__(GrpoIteration)
    loop.settings = dataclasses.replace(settings_from_config(load_config(GRPO, overrides=list(overrides))),
                                        n_samples_per_prompt=2)
    sent: dict = {}
    group = _group([1.0, 0.0], [3, 1])
    loop._score = lambda groups, version: TrainBatch([group], np.array([1.0, 0.0]), None)
    loop._log_prob_passes = lambda seqs, ref_stream, clock, join=True: (old_lp or {}, {})

    def update(seqs, adv_of, old_lp, ref_lp, iteration, clock, behavior, streamed=None):
        sent.update(advantages=adv_of, behavior=behavior)
        return {}

    loop._update = update
    rollout = Rollout(SimpleNamespace(trained=[group]), PhaseClock(), 0.0, 7, None)
    loop._train(rollout, 1, 7)
    return loop, sent


SENT = {"g/0": [-0.25] * 3, "g/1": [-0.5]}
PASS = {"g/0": np.zeros(3, np.float32), "g/1": np.zeros(1, np.float32)}  # what an old-log-prob pass returns


def test_synchronous_mode_sends_the_rollouts_log_probs_with_a_correction() -> None:
    for keys in (["rlfabric.rollout_is=token"], ["rlfabric.rollout_rs=token_k2", "rlfabric.rollout_rs_threshold=1"]):
        for old_lp in (None, PASS):
            loop, sent = _loop(*keys, old_lp=old_lp)
            assert loop.settings.max_staleness == 0
            assert {k: v.tolist() for k, v in sent["behavior"].items()} == SENT


def test_without_a_correction_they_travel_only_for_the_trainer_to_measure() -> None:
    # the old-log-prob pass skipped: the trainer's update measures rollout_mismatch/*; run: measured here instead
    assert {k: v.tolist() for k, v in _loop()[1]["behavior"].items()} == SENT
    assert _loop(old_lp=PASS)[1]["behavior"] == {}


def test_a_sample_without_log_probs_costs_the_measurement_not_the_iteration() -> None:
    group = _group([1.0, 0.0], [3, 1])
    group.samples[1].response_log_probs.CopyFrom(to_proto(np.zeros(0, np.float32)))
    assert behavior_log_probs([group], required=False) == {}
    with pytest.raises(IterationError, match="g/1 has 0 log-probs for 1 tokens"):
        behavior_log_probs([group])


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], 0.5 / (np.sqrt(0.5) + 1e-6)),  # group_norm: +-0.5 / (unbiased std 0.7071 + 1e-6)
    (["rlfabric.norm_adv_by_std_in_grpo=false"], 0.5),  # Dr.GRPO: r - mean
    (["rl_config.adv_estimator=rloo"], 1.0),  # r - the other sample's reward
])
def test_the_configured_estimator_makes_the_advantages(overrides: list[str], expected: float) -> None:
    _, sent = _loop(*overrides)
    assert sent["advantages"]["g/0"] == pytest.approx(expected) and sent["advantages"]["g/1"] == pytest.approx(-expected)


def test_reinforce_plus_plus_weighs_each_sample_by_its_tokens() -> None:
    # rewards [1, 0] on 3 and 1 tokens: whitened over the 4 tokens -> sample 1 at -1.5 (tests/coordinator/
    # test_advantages_verl.py works it out), not the -0.707 a per-sample whitening gives
    _, sent = _loop("rl_config.adv_estimator=reinforce_plus_plus")
    assert sent["advantages"]["g/1"] == pytest.approx(-1.5, abs=1e-6)

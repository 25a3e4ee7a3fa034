"""The coordinator's PPO steps (services/coordinator/ppo.py) on a hand-made batch: GAE over the trainable samples
only (a failed sample trains nothing and gets no targets), whitened over all of their tokens together, split back
per sample; MindSpeed-RL's `critic/*` data metrics; and the critic's Update requests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.common.kl import kl_penalty
from services.common.sequences import Sequences
from services.common.tensors import to_numpy
from services.coordinator.errors import IterationError
from services.coordinator.gae import apply_kl_in_reward, gae_advantages_and_returns, token_level_scores
from services.coordinator.ppo import critic_update_requests, gae_targets
from services.coordinator.rewards import TrainBatch


def _settings(**kw) -> SimpleNamespace:
    defaults = {"gamma": 0.9, "lam": 0.8, "update_chunk_size": 2}
    return SimpleNamespace(**{**defaults, **kw})


def _batch() -> tuple[TrainBatch, dict[str, np.ndarray]]:
    """Three samples in one group; `b` failed (no tokens train), `a` and `c` train 3 and 2 tokens."""
    samples = [SimpleNamespace(sample_id=x) for x in ("a", "b", "c")]
    rewards = np.array([1.0, 0.0, 0.5])
    seqs = Sequences.from_lists(["a", "c"], [np.array([5, 6]), np.array([7])],
                                [np.array([1, 2, 3]), np.array([4, 9])])
    values = {"a": np.array([0.1, -0.2, 0.3], np.float32), "c": np.array([0.05, 0.4], np.float32)}
    return TrainBatch([SimpleNamespace(samples=samples)], rewards, seqs), values


def test_gae_targets_are_gae_over_the_trainable_samples_split_back_per_sample() -> None:
    batch, values = _batch()
    targets = gae_targets(batch, values, _settings())
    scores = token_level_scores([1.0, 0.5], [3, 2], 3)
    vals = np.array([[0.1, -0.2, 0.3], [0.05, 0.4, 0.0]], dtype=np.float32).astype(np.float64)
    mask = np.array([[1, 1, 1], [1, 1, 0]], dtype=bool)
    adv, ret = gae_advantages_and_returns(scores, vals, mask, 0.9, 0.8)
    assert set(targets.advantages) == {"a", "c"} == set(targets.returns)
    np.testing.assert_array_equal(targets.advantages["a"], adv[0].astype(np.float32))
    np.testing.assert_array_equal(targets.advantages["c"], adv[1, :2].astype(np.float32))
    np.testing.assert_array_equal(targets.returns["c"], ret[1, :2].astype(np.float32))
    # Whitened over the five tokens together.
    flat = np.concatenate([targets.advantages["a"], targets.advantages["c"]]).astype(np.float64)
    assert abs(flat.mean()) < 1e-6 and flat.std(ddof=1) == pytest.approx(1.0, rel=1e-5)
    m = targets.metrics
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.75, 1.0, 0.5)
    assert m["critic/values/max"] == pytest.approx(0.4) and m["critic/values/min"] == pytest.approx(-0.2)
    assert m["critic/returns/max"] == pytest.approx(ret[mask].max())
    assert m["critic/advantages/mean"] == pytest.approx(0.0, abs=1e-6)


def test_a_sample_without_values_fails_the_iteration_naming_it() -> None:
    batch, values = _batch()
    with pytest.raises(IterationError, match=r"no values for 1 samples \(first: \['c'\]\)"):
        gae_targets(batch, {"a": values["a"]}, _settings())


def test_critic_requests_carry_returns_and_the_rollout_values_in_chunks() -> None:
    batch, values = _batch()
    targets = gae_targets(batch, values, _settings())
    requests = critic_update_requests(batch.seqs, targets, values, step=7, chunk=1)
    assert [list(r.batch.sample_ids) for r in requests] == [["a"], ["c"]]
    assert all(r.step == 7 and not r.HasField("advantages") and not r.HasField("token_advantages") for r in requests)
    np.testing.assert_array_equal(to_numpy(requests[1].returns), targets.returns["c"])
    np.testing.assert_array_equal(to_numpy(requests[0].values), values["a"])


def test_the_actors_request_carries_token_advantages_under_ppo() -> None:
    from services.coordinator.trainer_requests import update_request

    batch, values = _batch()
    targets = gae_targets(batch, values, _settings())
    settings = _settings(use_critic=True, temperature=1.0, kl_in_loss=False)
    req = update_request(batch.seqs, targets.advantages, {}, {}, {}, step=3, kl_coef=0.0, settings=settings)
    assert not req.HasField("advantages")
    np.testing.assert_array_equal(to_numpy(req.token_advantages),
                                  np.concatenate([targets.advantages["a"], targets.advantages["c"]]))


def test_the_kl_in_the_reward_comes_off_each_tokens_reward_before_gae() -> None:
    batch, values = _batch()
    old = {"a": np.array([-0.5, -1.0, -0.2]), "c": np.array([-0.3, -2.0])}
    ref = {"a": np.array([-0.6, -0.7, -0.2]), "c": np.array([-0.1, -2.5])}
    targets = gae_targets(batch, values, _settings(kl_penalty="kl"), (old, ref, 0.1))
    kl = kl_penalty(torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -2.0, 0.0]], dtype=torch.float64),
                    torch.tensor([[-0.6, -0.7, -0.2], [-0.1, -2.5, 0.0]], dtype=torch.float64), "kl").numpy()
    rewards, current_kl = apply_kl_in_reward(token_level_scores([1.0, 0.5], [3, 2], 3), kl, [3, 2], 0.1)
    vals = np.array([[0.1, -0.2, 0.3], [0.05, 0.4, 0.0]], dtype=np.float32).astype(np.float64)
    adv, _ = gae_advantages_and_returns(rewards, vals, np.array([[1, 1, 1], [1, 1, 0]], dtype=bool), 0.9, 0.8)
    np.testing.assert_array_equal(targets.advantages["a"], adv[0].astype(np.float32))
    assert targets.metrics["actor/reward_kl_penalty"] == current_kl
    assert targets.metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # The score metrics stay the verifier's: the KL is a shaping of the reward, not a score.
    assert targets.metrics["critic/score/mean"] == 0.75

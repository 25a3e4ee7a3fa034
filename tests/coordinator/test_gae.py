"""PPO's token-level rewards and GAE against MindSpeed-RL's own code, then hand-worked cases.

tests/coordinator/mindspeed_ppo.json holds fixed float64 inputs and what MindSpeed-RL's `apply_kl_penalty` and
`compute_advantage` (adv_estimator gae) wrote back for them, run end to end (tests/mindspeed_expected.py): rule-score
placement, the KL penalty in the reward, GAE, whitening. Every value must be equal: maximum difference 0. The same
file holds verl's `compute_gae_advantage_return` on the same inputs: equal to MindSpeed-RL's for contiguous masks,
different where a multi-turn mask has holes (rlfabric follows MindSpeed-RL).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.kl import kl_penalty
from services.coordinator.gae import apply_kl_in_reward, gae_advantages_and_returns, token_level_scores
from tests.verl_expected import unhex

FIXTURE = json.loads((Path(__file__).parent / "mindspeed_ppo.json").read_text())
CASES = FIXTURE["cases"]


def rewards_of(case: dict) -> tuple[np.ndarray, float | None]:
    x = case["inputs"]
    lengths, mask = np.asarray(x["lengths"]), np.asarray(x["mask"])
    scores = token_level_scores(unhex(x["scores"]), lengths, width=mask.shape[1])
    if case["kl_penalty"] is None:
        return scores, None
    kld = kl_penalty(torch.tensor(unhex(x["old_log_probs"])), torch.tensor(unhex(x["ref_log_probs"])),
                     case["kl_penalty"]).numpy()
    return apply_kl_in_reward(scores, kld, lengths, case["kl_coef"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_equal_to_mindspeed_rl_in_float64(case: dict) -> None:
    mask = np.asarray(case["inputs"]["mask"]).astype(bool)
    rewards, current_kl = rewards_of(case)
    if case["kl_penalty"] is not None:
        assert np.array_equal(rewards, unhex(case["expected"]["token_level_rewards"]))
        assert current_kl == float.fromhex(case["expected"]["current_kl"])
    advantages, returns = gae_advantages_and_returns(rewards, unhex(case["inputs"]["values"]), mask,
                                                     case["gamma"], case["lam"])
    for got, name in ((advantages, "advantages"), (returns, "returns")):
        expected = unhex(case["expected"][name])
        assert got.dtype == np.float64 and got.shape == expected.shape
        assert float(np.max(np.abs(got[mask] - expected[mask]))) == 0.0, name
        assert not got[~mask].any(), name  # positions outside the mask hold 0


@pytest.mark.parametrize("case", [c for c in CASES if c["kl_penalty"]], ids=lambda c: c["name"])
def test_the_trainers_kl_estimators_are_mindspeed_rls(case: dict) -> None:
    x = case["inputs"]
    got = kl_penalty(torch.tensor(unhex(x["old_log_probs"])), torch.tensor(unhex(x["ref_log_probs"])),
                     case["kl_penalty"]).numpy()
    assert np.array_equal(got, unhex(case["expected"]["kld"]))


def test_verl_agrees_on_contiguous_masks_and_not_on_holes() -> None:
    for case in CASES:
        mask = np.asarray(case["inputs"]["mask"]).astype(bool)
        same = all(np.array_equal(unhex(case["verl"][k])[mask], unhex(case["expected"][k])[mask])
                   for k in ("advantages", "returns"))
        assert same == ("holes" not in case["name"]), case["name"]


def test_the_fixture_covers_what_it_claims() -> None:
    assert FIXTURE["mindspeed_rl_commit"] == "05a90d77cb6cfad8999e2aee21068284db959579"
    assert {c["kl_penalty"] for c in CASES} == {None, "kl", "low_var_kl", "mse"}
    assert any(c["gamma"] < 1 and c["lam"] < 1 for c in CASES)
    assert any(len(set(c["inputs"]["lengths"])) > 2 for c in CASES)  # ragged
    assert any(max(c["inputs"]["lengths"]) == 1 for c in CASES)


# ----------------------------------------------------------------------------- hand-worked


def unwhitened(rewards, values, mask, gamma, lam) -> np.ndarray:
    """The advantages before whitening: returns - values (returns are not whitened)."""
    _, returns = gae_advantages_and_returns(rewards, values, mask, gamma, lam)
    return returns - np.where(np.asarray(mask, bool), values, 0.0)


def test_gamma_1_lam_1_gives_returns_to_go() -> None:
    # rewards [0, 0, 1] and [0, 2 (then padding)]: with gamma = lam = 1 the value terms telescope away, so
    # return_t = the sum of the rewards from t on, whatever the values are.
    rewards = [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]
    values = [[0.3, -0.7, 0.25], [1.5, 0.5, 9.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    _, returns = gae_advantages_and_returns(rewards, values, mask, 1.0, 1.0)
    assert returns.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]


def test_discounted_recursion_by_hand() -> None:
    # one response of 2 tokens, r = [0, 1], V = [0.5, 0.25], gamma 0.5, lam 0.5:
    #   delta_1 = 1 + 0.5 * 0 - 0.25 = 0.75;          A_1 = 0.75
    #   delta_0 = 0 + 0.5 * 0.25 - 0.5 = -0.375;      A_0 = -0.375 + 0.25 * 0.75 = -0.1875
    # returns = A + V = [0.3125, 1.0]; whitened over the 2 tokens: mean 0.28125, unbiased var 2 * 0.46875^2 -> +-1/sqrt(2)
    rewards, values, mask = [[0.0, 1.0]], [[0.5, 0.25]], [[1, 1]]
    advantages, returns = gae_advantages_and_returns(rewards, values, mask, 0.5, 0.5)
    assert returns.tolist() == [[0.3125, 1.0]]
    assert advantages[0] == pytest.approx([-2 ** -0.5, 2 ** -0.5], abs=1e-7)


def test_a_one_token_response() -> None:
    # A = r - V; two one-token responses whiten to -+1/sqrt(2) (n = 2, unbiased variance)
    advantages, returns = gae_advantages_and_returns([[1.0], [0.0]], [[0.25], [0.5]], [[1], [1]], 0.9, 0.8)
    assert returns.tolist() == [[1.0], [0.0]]
    assert advantages[:, 0] == pytest.approx([2 ** -0.5, -2 ** -0.5], abs=1e-7)
    # a lone token: biased variance 0, so 0 * rsqrt(1e-8) = 0 (upstream keeps n = 1 rather than dividing by 0)
    assert gae_advantages_and_returns([[1.0]], [[0.25]], [[1]], 1.0, 1.0)[0].tolist() == [[0.0]]


def test_padding_never_affects_the_result() -> None:
    rng = np.random.default_rng(5)
    rewards, values = rng.normal(size=(4, 7)), rng.normal(size=(4, 7))
    mask = (np.arange(7)[None, :] < np.array([7, 3, 5, 1])[:, None]).astype(int)
    base = gae_advantages_and_returns(rewards, values, mask, 0.95, 0.9)
    noisy_r, noisy_v = rewards.copy(), values.copy()
    noisy_r[mask == 0], noisy_v[mask == 0] = 1e6, -3e5
    again = gae_advantages_and_returns(noisy_r, noisy_v, mask, 0.95, 0.9)
    assert all(np.array_equal(a, b) for a, b in zip(base, again, strict=True))
    # a wider padding changes the returns not at all, the whitened advantages by the rounding of the batch sums
    # only (torch sums the padded matrix, whose layout orders the additions, as upstream's masked_whiten does)
    wide = gae_advantages_and_returns(np.pad(rewards, ((0, 0), (0, 3))), np.pad(values, ((0, 0), (0, 3))),
                                      np.pad(mask, ((0, 0), (0, 3))), 0.95, 0.9)
    assert np.array_equal(wide[1][:, :7], base[1]) and not wide[1][:, 7:].any()
    assert np.allclose(wide[0][:, :7], base[0], rtol=0, atol=1e-14) and not wide[0][:, 7:].any()


def test_a_hole_inside_a_response_stays_in_the_recursion() -> None:
    # MindSpeed-RL runs GAE through tool tokens: the value at a masked position inside the response matters
    rewards, mask = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.5]], [[1, 0, 1], [1, 1, 1]]
    a = unwhitened(rewards, [[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]], mask, 1.0, 0.9)
    b = unwhitened(rewards, [[0.1, 0.9, 0.3], [0.0, 0.0, 0.0]], mask, 1.0, 0.9)
    assert a[0, 0] != b[0, 0] and a[0, 2] == b[0, 2]


def test_rule_score_on_the_last_token_and_kl_in_reward() -> None:
    scores = token_level_scores([1.0, 0.5], [3, 1])
    assert scores.tolist() == [[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]
    kl = [[0.1, 0.2, 0.3], [0.4, 7.0, 7.0]]  # the 7s lie past the second response and are ignored
    rewards, current_kl = apply_kl_in_reward(scores, kl, [3, 1], 0.5)
    assert rewards == pytest.approx(np.array([[-0.05, -0.1, 0.85], [0.3, 0.0, 0.0]]), abs=1e-15)
    assert current_kl == pytest.approx((0.2 + 0.4) / 2, abs=1e-15)  # mean over samples of each one's mean KL


def test_refusals() -> None:
    with pytest.raises(ValueError, match="selects none"):
        gae_advantages_and_returns([[1.0]], [[0.0]], [[0]], 1.0, 1.0)
    with pytest.raises(ValueError, match="only 0 and 1"):
        gae_advantages_and_returns([[1.0]], [[0.0]], [[2]], 1.0, 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        gae_advantages_and_returns([[np.nan]], [[0.0]], [[1]], 1.0, 1.0)
    with pytest.raises(ValueError, match="response lengths in 1..2"):
        token_level_scores([1.0], [0], width=2)

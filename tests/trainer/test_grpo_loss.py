"""The GRPO loss against a loop-based plain-torch reference written from parity.md, plus hand-worked cases.

The reference below walks token by token with Python scalars-as-tensors, so each line reads as the
formula in `../shared/design/parity.md` ("GRPO loss"); autograd through it gives the reference
gradients. Everything runs in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.grpo_loss import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_log_probs,
    grpo_loss,
    kl_penalty,
    policy_loss,
)

torch.set_num_threads(1)
TOL = 1e-6
DT = torch.float64


# ----------------------------------------------------------------------------- reference


def ref_kl_token(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """One token's KL penalty, straight from parity.md / Schulman's k1, k2, k3."""
    if kind == "low_var_kl":
        d = ref - logp
        d = min(max(d, torch.tensor(-20.0, dtype=DT)), torch.tensor(20.0, dtype=DT))
        k3 = torch.exp(d) - d - 1
        return min(max(k3, torch.tensor(-10.0, dtype=DT)), torch.tensor(10.0, dtype=DT))
    if kind == "kl":
        return logp - ref
    if kind == "abs":
        return abs(logp - ref)
    if kind == "mse":
        return 0.5 * (logp - ref) ** 2
    raise AssertionError(kind)


def ref_loss(
    logp, old, ref, adv, mask, *, eps_low, eps_high, kind, kl_coef, use_kl, ent_coef, entropy, token_level
):
    """loss = agg(max(-A r, -A clip(r))) + kl_coef * token_mean(kl) - ent_coef * token_mean(H), by loops."""
    batch, seq = logp.shape
    pg_rows, kl_terms, ent_terms = [], [], []
    for i in range(batch):
        row = []
        for t in range(seq):
            if not mask[i, t]:
                continue
            a = adv[i] if adv.dim() == 1 else adv[i, t]
            ratio = torch.exp(logp[i, t] - old[i, t])
            clipped_ratio = min(
                max(ratio, torch.tensor(1 - eps_low, dtype=DT)), torch.tensor(1 + eps_high, dtype=DT)
            )
            row.append(max(-a * ratio, -a * clipped_ratio))
            if use_kl:
                kl_terms.append(ref_kl_token(logp[i, t], ref[i, t], kind))
            if entropy is not None:
                ent_terms.append(entropy[i, t])
        pg_rows.append(row)
    if token_level:
        tokens = [x for row in pg_rows for x in row]
        pg = sum(tokens) / len(tokens)
    else:
        pg = sum(sum(row) / len(row) for row in pg_rows) / len(pg_rows)
    loss = pg
    if use_kl:
        loss = loss + kl_coef * sum(kl_terms) / len(kl_terms)
    if entropy is not None and ent_coef != 0:
        loss = loss - ent_coef * sum(ent_terms) / len(ent_terms)
    return loss


def assert_values(actual: torch.Tensor, expected: list[list[float]], tol: float = 1e-6) -> None:
    assert (actual.detach() - torch.tensor(expected, dtype=actual.dtype)).abs().max() < tol, actual


def random_inputs(seed: int, batch: int = 5, seq: int = 9, adv_per_token: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, seq, generator=gen, dtype=DT) * 3 - 0.01
    old = logp + 0.3 * torch.randn(batch, seq, generator=gen, dtype=DT)  # ratios well outside [0.8, 1.2]
    ref = logp + torch.randn(batch, seq, generator=gen, dtype=DT)
    ref[0, 0] = logp[0, 0] - 40.0  # exercises both k3 clamps
    ref[0, 1] = logp[0, 1] + 40.0
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    mask = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    adv = (
        torch.randn(batch, seq, generator=gen, dtype=DT)
        if adv_per_token
        else torch.randn(batch, generator=gen, dtype=DT)
    )
    entropy = torch.rand(batch, seq, generator=gen, dtype=DT) * 2
    return logp, old, ref, adv, mask, entropy


def loss_and_grads(fn, logp, entropy):
    logp = logp.clone().requires_grad_(True)
    entropy = entropy.clone().requires_grad_(True)
    loss = fn(logp, entropy)
    g_logp, g_ent = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    g_ent = torch.zeros_like(entropy) if g_ent is None else g_ent
    return loss.detach(), g_logp, g_ent


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", sorted(KL_PENALTIES))
@pytest.mark.parametrize("token_level", [True, False])
def test_loss_and_gradients_match_reference(seed, kind, token_level):
    logp, old, ref, adv, mask, entropy = random_inputs(seed, adv_per_token=seed % 2 == 1)
    opts = dict(
        eps_low=0.2,
        eps_high=0.28,
        kind=kind,
        kl_coef=0.05,
        use_kl=True,
        ent_coef=0.01,
        token_level=token_level,
    )

    def ours(lp, ent):
        loss, _ = grpo_loss(
            lp,
            old,
            ref,
            adv,
            mask,
            clip_ratio=0.2,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            kl_penalty=kind,
            kl_coef=0.05,
            entropy_coeff=0.01,
            entropy=ent,
            token_level_loss=token_level,
        )
        return loss

    def theirs(lp, ent):
        return ref_loss(lp, old, ref, adv, mask, entropy=ent, **opts)

    loss_a, g_a, ge_a = loss_and_grads(ours, logp, entropy)
    loss_b, g_b, ge_b = loss_and_grads(theirs, logp, entropy)
    assert abs(loss_a - loss_b) < TOL
    assert (g_a - g_b).abs().max() < TOL
    assert (ge_a - ge_b).abs().max() < TOL
    assert g_a[~mask].abs().max() == 0  # padding never gets gradient


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("token_level", [True, False])
def test_dapo_setting_without_kl_matches_reference(seed, token_level):
    logp, old, _, adv, mask, entropy = random_inputs(seed)

    def ours(lp, ent):
        loss, _ = grpo_loss(
            lp,
            old,
            None,
            adv,
            mask,
            clip_ratio=0.2,
            clip_ratio_high=0.28,
            use_kl=False,
            token_level_loss=token_level,
        )
        return loss

    def theirs(lp, ent):
        return ref_loss(
            lp,
            old,
            None,
            adv,
            mask,
            eps_low=0.2,
            eps_high=0.28,
            kind="",
            kl_coef=0.0,
            use_kl=False,
            ent_coef=0.0,
            entropy=None,
            token_level=token_level,
        )

    loss_a, g_a, _ = loss_and_grads(ours, logp, entropy)
    loss_b, g_b, _ = loss_and_grads(theirs, logp, entropy)
    assert abs(loss_a - loss_b) < TOL
    assert (g_a - g_b).abs().max() < TOL


@pytest.mark.parametrize("seed", range(3))
def test_metrics_match_reference(seed):
    logp, old, ref, adv, mask, entropy = random_inputs(seed)
    _, metrics = grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, kl_coef=0.1, entropy=entropy)
    ratio = torch.exp(logp - old)
    a = adv.unsqueeze(-1).expand_as(logp)
    clipped = (-a * ratio.clamp(0.8, 1.2) > -a * ratio)[mask]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped.double().mean().item(), abs=1e-12)
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    assert metrics["actor/ppo_kl"] == pytest.approx((old - logp)[mask].mean().item(), abs=1e-12)
    kl = torch.stack([ref_kl_token(logp[i, t], ref[i, t], "low_var_kl") for i, t in mask.nonzero().tolist()])
    assert metrics["actor/kl_loss"] == pytest.approx(kl.mean().item(), abs=1e-12)
    assert metrics["actor/entropy"] == pytest.approx(entropy[mask].mean().item(), abs=1e-12)
    assert metrics["actor/loss"] == pytest.approx(
        metrics["actor/pg_loss"] + 0.1 * metrics["actor/kl_loss"], abs=1e-12
    )
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize("seed", range(3))
def test_log_probs_and_entropy_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, seq, vocab, temperature = 2, 4, 11, 0.7
    logits = torch.randn(batch, seq, vocab, generator=gen, dtype=DT) * 3
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    weights = torch.randn(batch, seq, generator=gen, dtype=DT)

    def ours(z):
        lp, ent = compute_log_probs(z, tokens, temperature, with_entropy=True)
        return lp, ent

    def theirs(z):
        lp = torch.zeros(batch, seq, dtype=DT)
        ent = torch.zeros(batch, seq, dtype=DT)
        for i in range(batch):
            for t in range(seq):
                scaled = [z[i, t, v] / temperature for v in range(vocab)]
                log_z = torch.log(sum(torch.exp(s) for s in scaled))
                lp[i, t] = scaled[int(tokens[i, t])] - log_z
                ent[i, t] = -sum(torch.exp(s - log_z) * (s - log_z) for s in scaled)
        return lp, ent

    results = []
    for fn in (ours, theirs):
        z = logits.clone().requires_grad_(True)
        lp, ent = fn(z)
        (grad,) = torch.autograd.grad((lp * weights).sum() + (ent * weights).sum(), [z])
        results.append((lp.detach(), ent.detach(), grad))
    for a, b in zip(results[0], results[1], strict=True):
        assert (a - b).abs().max() < TOL


def test_log_probs_upcast_half_precision_and_skip_entropy():
    logits = torch.randn(1, 3, 7).to(torch.bfloat16)
    lp, ent = compute_log_probs(logits, torch.tensor([[0, 3, 6]]))
    assert lp.dtype == torch.float32 and ent is None
    assert (lp <= 0).all()


def test_log_probs_reject_zero_temperature():
    with pytest.raises(ValueError, match="temperature"):
        compute_log_probs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)


# ----------------------------------------------------------------------------- hand-worked


def test_aggregation_modes_by_hand():
    # Two samples, on-policy (ratio 1), so each token's pg term is -A:
    #   row 0: A = +1, 3 tokens -> -1, -1, -1
    #   row 1: A = -2, 1 token  -> +2   (two padding positions)
    # token-mean          = (-1 - 1 - 1 + 2) / 4          = -0.25
    # seq-mean-token-mean = mean(-3 / 3, 2 / 1) = (-1 + 2) / 2 = 0.5
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -9.0, -9.0]], dtype=DT, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=DT)
    tok, m_tok = grpo_loss(logp, None, None, adv, mask, clip_ratio=0.2, use_kl=False, token_level_loss=True)
    seq, _ = grpo_loss(logp, None, None, adv, mask, clip_ratio=0.2, use_kl=False, token_level_loss=False)
    assert tok.item() == pytest.approx(-0.25)
    assert seq.item() == pytest.approx(0.5)
    assert m_tok["actor/pg_loss"] == pytest.approx(-0.25)
    # d(token-mean)/d logp = -A / 4 on each real token: row 0 -> -0.25, row 1 -> +0.5.
    (grad,) = torch.autograd.grad(tok, [logp])
    assert_values(grad, [[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]])
    # d(seq-mean)/d logp = -A / (len_i * 2): row 0 -> -1/6, row 1 -> +1.
    (grad,) = torch.autograd.grad(seq, [logp])
    assert_values(grad, [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]])


def test_clipping_by_hand():
    # One sample, A = +1, two tokens with ratios 1.5 and 0.5 (old log-prob 0):
    #   token 0: max(-1.5, -clip(1.5) = -1.2) = -1.2  -> clipped, no gradient
    #   token 1: max(-0.5, -clip(0.5) = -0.8) = -0.5  -> unclipped, d/dlogp = -ratio / 2 = -0.25
    # pg = (-1.2 - 0.5) / 2 = -0.85; clipfrac = 1/2
    # ppo_kl = mean(old - new) = (-ln 1.5 - ln 0.5) / 2 = (-0.405465 + 0.693147) / 2 = 0.143841
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=DT, requires_grad=True)
    old = torch.zeros(1, 2, dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = grpo_loss(
        logp, old, None, torch.tensor([1.0], dtype=DT), mask, clip_ratio=0.2, use_kl=False
    )
    assert loss.item() == pytest.approx(-0.85)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.143841, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, [logp])
    assert_values(grad, [[0.0, -0.25]])


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A = +1: symmetric 0.2 clips it to 1.2 (loss -1.2, clipped);
    #   clip_ratio_high 0.28 lets it through (loss -1.25, gradient -1.25).
    # ratio 0.75 with A = -1: clip_ratio_low 0.2 clips it to 0.8: max(0.75, 0.8) = 0.8, clipped,
    #   whatever clip_ratio_high is.
    mask = torch.ones(1, 1, dtype=torch.bool)
    old = torch.zeros(1, 1, dtype=DT)
    up = torch.tensor([[math.log(1.25)]], dtype=DT)
    down = torch.tensor([[math.log(0.75)]], dtype=DT)
    pos, neg = torch.tensor([1.0], dtype=DT), torch.tensor([-1.0], dtype=DT)

    sym, m = grpo_loss(up, old, None, pos, mask, clip_ratio=0.2, use_kl=False)
    assert sym.item() == pytest.approx(-1.2) and m["actor/pg_clipfrac"] == 1.0
    high, m = grpo_loss(up, old, None, pos, mask, clip_ratio=0.2, clip_ratio_high=0.28, use_kl=False)
    assert high.item() == pytest.approx(-1.25) and m["actor/pg_clipfrac"] == 0.0
    low, m = grpo_loss(down, old, None, neg, mask, clip_ratio=0.2, clip_ratio_high=0.28, use_kl=False)
    assert low.item() == pytest.approx(0.8) and m["actor/pg_clipfrac"] == 1.0
    # and policy_loss takes the two bounds independently
    per_token, _ = policy_loss(up, old, pos, mask, clip_ratio_low=0.5, clip_ratio_high=0.1)
    assert per_token.item() == pytest.approx(-1.1)


def test_kl_penalties_by_hand():
    # p = 0.5, p_ref = 0.25: logp - ref = ln 2 = 0.693147
    #   low_var_kl: d = ref - logp = -ln 2; exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    #   kl: 0.693147; abs: 0.693147; mse: 0.5 * 0.693147^2 = 0.240227
    logp = torch.tensor([[math.log(0.5)]], dtype=DT)
    ref = torch.tensor([[math.log(0.25)]], dtype=DT)
    expected = {"low_var_kl": 0.193147, "kl": 0.693147, "abs": 0.693147, "mse": 0.240227}
    for kind, value in expected.items():
        assert kl_penalty(logp, ref, kind).item() == pytest.approx(value, abs=1e-6), kind
    # abs differs from kl when the policy is below the reference
    assert kl_penalty(ref, logp, "kl").item() == pytest.approx(-0.693147, abs=1e-6)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(0.693147, abs=1e-6)


def test_low_var_kl_clamps_by_hand():
    # d = ref - logp = +50 -> clamp 20 -> exp(20) - 21 = 4.85e8 -> clamp 10
    # d = -50 -> clamp -20 -> exp(-20) + 20 - 1 = 19.000000002 -> clamp 10
    # d = -5 (inside) -> exp(-5) + 5 - 1 = 4.006738
    logp = torch.tensor([[-50.0, 0.0, 0.0]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[0.0, -50.0, -5.0]], dtype=DT)
    k3 = kl_penalty(logp, ref, "low_var_kl")
    assert_values(k3, [[10.0, 10.0, 4.006738]])
    (grad,) = torch.autograd.grad(k3.sum(), [logp])
    # clamped tokens get no gradient; inside, d k3 / d logp = 1 - exp(d) = 1 - exp(-5) = 0.993262
    assert_values(grad, [[0.0, 0.0, 0.993262]])


def test_low_var_kl_stays_finite_far_off_support():
    # The inner +-20 clamp never changes a value (the outer clamp caps k3 at 10 from |d| ~ 11 on);
    # it keeps exp() finite so the gradient is 0, not 0 * inf = NaN, e.g. d = 1000 in float32.
    logp = torch.tensor([[-1000.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1000.0]])
    k3 = kl_penalty(logp, ref, "low_var_kl")
    (grad,) = torch.autograd.grad(k3.sum(), [logp])
    assert k3.tolist() == [[10.0, 10.0]]
    assert grad.tolist() == [[0.0, 0.0]]


def test_full_loss_by_hand():
    # One sample, two tokens, on-policy, A = 0.5; logp = ln 0.5 on both; ref = ln 0.25 on both;
    # entropy 1.0 and 3.0; kl_coef 0.1; entropy_coeff 0.01; low_var_kl.
    #   pg      = mean(-0.5, -0.5)             = -0.5
    #   kl      = mean(0.193147, 0.193147)     = 0.193147
    #   entropy = mean(1, 3)                   = 2
    #   loss    = -0.5 + 0.1 * 0.193147 - 0.01 * 2 = -0.500685
    logp = torch.full((1, 2), math.log(0.5), dtype=DT)
    ref = torch.full((1, 2), math.log(0.25), dtype=DT)
    entropy = torch.tensor([[1.0, 3.0]], dtype=DT)
    loss, m = grpo_loss(
        logp,
        None,
        ref,
        torch.tensor([0.5], dtype=DT),
        torch.ones(1, 2),
        clip_ratio=0.2,
        kl_coef=0.1,
        entropy_coeff=0.01,
        entropy=entropy,
    )
    assert loss.item() == pytest.approx(-0.500685, abs=1e-6)
    assert m["actor/pg_loss"] == pytest.approx(-0.5)
    assert m["actor/kl_loss"] == pytest.approx(0.193147, abs=1e-6)
    assert m["actor/entropy"] == pytest.approx(2.0)
    assert m["actor/loss"] == pytest.approx(-0.500685, abs=1e-6)


# ----------------------------------------------------------------------------- behaviours


@pytest.mark.parametrize("seed", range(3))
def test_on_policy_skip_equals_detached_current(seed):
    logp, _, ref, adv, mask, _ = random_inputs(seed)
    results = []
    for old in (None, logp.detach().clone()):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = grpo_loss(lp, old, ref, adv, mask, clip_ratio=0.2)
        (grad,) = torch.autograd.grad(loss, [lp])
        results.append((loss.item(), grad, metrics))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert loss_a == loss_b and torch.equal(grad_a, grad_b)
    assert m_a["actor/pg_clipfrac"] == 0.0 and m_a["actor/ppo_kl"] == 0.0
    # with ratio 1, the pg gradient on a token is -A / token count (plus the KL term's)
    _, m_nokl = grpo_loss(logp, None, None, adv, mask, clip_ratio=0.2, use_kl=False)
    lp = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, None, None, adv, mask, clip_ratio=0.2, use_kl=False)
    (grad,) = torch.autograd.grad(loss, [lp])
    expected = (-adv.unsqueeze(-1) / mask.sum().item()).expand_as(lp) * mask.to(DT)
    assert (grad - expected).abs().max() < 1e-12
    assert m_nokl["actor/pg_loss"] == pytest.approx((-adv.unsqueeze(-1).expand_as(lp))[mask].mean().item())


def test_entropy_bonus_lowers_loss_by_coeff_times_mean_entropy():
    logp, old, ref, adv, mask, entropy = random_inputs(7)
    base, _ = grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, entropy=entropy)
    ent = entropy.clone().requires_grad_(True)
    bonus, _ = grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, entropy_coeff=0.03, entropy=ent)
    assert (base - bonus).item() == pytest.approx(0.03 * entropy[mask].mean().item(), abs=1e-12)
    (grad,) = torch.autograd.grad(bonus, [ent])
    assert (grad - (-0.03 / mask.sum().item()) * mask.to(DT)).abs().max() < 1e-12


def test_errors_name_the_choice():
    logp, old, ref, adv, mask, _ = random_inputs(0)
    with pytest.raises(ValueError, match=r"unsupported kl_penalty 'k9'.*abs.*kl.*low_var_kl.*mse"):
        grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, kl_penalty="k9")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate_loss(logp, mask, "seq-sum")
    with pytest.raises(ValueError, match="ref_log_probs"):
        grpo_loss(logp, old, None, adv, mask, clip_ratio=0.2)
    with pytest.raises(ValueError, match="with_entropy=True"):
        grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        grpo_loss(logp, old, ref, adv, mask, clip_ratio=0.2, clip_ratio_low=-0.1)


def test_variant_tables_are_complete():
    assert sorted(KL_PENALTIES) == ["abs", "kl", "low_var_kl", "mse"]
    assert sorted(LOSS_AGG_MODES) == ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                      "token-mean"]


def test_empty_rows_contribute_zero_not_nan():
    logp = torch.zeros(2, 3, dtype=DT)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(aggregate_loss(logp + 1, mask, mode))
    # A row without tokens is not a sample of the mean (as verl; it only arises when rejection empties a row).
    assert aggregate_loss(logp + 1, mask, "seq-mean-token-mean").item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------- properties

finite_logp = st.floats(min_value=-60.0, max_value=0.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(logp=finite_logp, ref=finite_logp)
def test_kl_estimator_properties(logp, ref):
    lp = torch.tensor([[logp]], dtype=DT)
    rf = torch.tensor([[ref]], dtype=DT)
    k1 = kl_penalty(lp, rf, "kl").item()
    # e^d - d - 1 >= 0 exactly; in float64 it rounds to -1e-16 near d = 0. Then clamped at 10.
    assert -1e-12 <= kl_penalty(lp, rf, "low_var_kl").item() <= 10.0
    assert kl_penalty(lp, rf, "abs").item() == abs(k1)
    assert kl_penalty(lp, rf, "mse").item() == pytest.approx(0.5 * k1 * k1)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 6),
    values=st.lists(st.floats(-5, 5, allow_nan=False), min_size=24, max_size=24),
)
def test_modes_agree_when_rows_have_equal_length(rows, length, values):
    per_token = torch.tensor(values[: rows * length], dtype=DT).reshape(rows, length)
    padded = torch.cat([per_token, torch.full((rows, 2), 99.0, dtype=DT)], dim=1)
    mask = torch.cat([torch.ones(rows, length), torch.zeros(rows, 2)], dim=1)
    a = aggregate_loss(padded, mask, "token-mean").item()
    b = aggregate_loss(padded, mask, "seq-mean-token-mean").item()
    # seq-mean-token-mean divides by count + 1e-8 (verl's formula): 1e-8 relative in float64; in float32, the
    # trainer's dtype, count + 1e-8 rounds to count and the two are MindSpeed-RL's sum / count exactly.
    assert a == pytest.approx(b, rel=1e-8, abs=1e-12)
    f32 = padded.float()
    mindspeed = ((f32 * mask).sum(-1) / mask.sum(-1)).mean()
    assert aggregate_loss(f32, mask, "seq-mean-token-mean").item() == mindspeed.item()
    assert a == pytest.approx(per_token.mean().item(), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    adv=st.floats(-3, 3, allow_nan=False),
    log_ratio=st.floats(-2, 2, allow_nan=False),
    low=st.floats(0, 0.9),
    high=st.floats(0, 2),
)
def test_pg_loss_never_below_unclipped_pessimism(adv, log_ratio, low, high):
    # The clipped surrogate is a pessimistic bound: loss >= -A * ratio, with equality when unclipped.
    logp = torch.tensor([[log_ratio]], dtype=DT)
    per_token, metrics = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=DT),
        torch.tensor([adv], dtype=DT),
        torch.ones(1, 1),
        clip_ratio_low=low,
        clip_ratio_high=high,
    )
    unclipped = -adv * math.exp(log_ratio)
    assert per_token.item() >= unclipped - 1e-12
    if metrics["actor/pg_clipfrac"] == 0.0:
        assert per_token.item() == pytest.approx(unclipped, abs=1e-12)

"""The critic's clipped value loss against MindSpeed-RL's own `CriticLossFunc._compute_value_loss`, then by hand.

tests/trainer/mindspeed_value_loss.json holds fixed float64 inputs and upstream's loss, clipfrac and gradient with
respect to vpreds (tests/mindspeed_expected.py), beside verl's `compute_value_loss` on the same inputs. Loss and
gradient must be equal in float64, clipfrac equal to upstream's float32 value: maximum difference 0. One case,
every response one token long, shows upstream's squeeze broadcasting `[B, 1]` into `[B, B]`: there rlfabric equals
verl instead (services/trainer/value_loss.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.value_loss import VALUE_LOSS_METRICS, value_loss, value_loss_metrics
from tests.verl_expected import unhex

FIXTURE = json.loads((Path(__file__).parent / "mindspeed_value_loss.json").read_text())
CASES = FIXTURE["cases"]
UPSTREAM_BROADCASTS = "one_token_responses"  # the case where MindSpeed-RL's squeeze() broadcasts


def run(case: dict) -> tuple[torch.Tensor, float, np.ndarray]:
    x = case["inputs"]
    vpreds = torch.tensor(unhex(x["vpreds"]), requires_grad=True)
    loss, clipfrac = value_loss(vpreds, torch.tensor(unhex(x["returns"])), torch.tensor(unhex(x["values"])),
                                torch.tensor(x["mask"]), case["cliprange_value"])
    loss.backward()
    return loss, clipfrac, vpreds.grad.numpy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_equal_to_mindspeed_rl_in_float64(case: dict) -> None:
    reference = case["verl"] if case["name"] == UPSTREAM_BROADCASTS else case["expected"]
    loss, clipfrac, grad = run(case)
    assert loss.dtype == torch.float64 and loss.item() == float.fromhex(reference["loss"])
    assert clipfrac == float.fromhex(reference["clipfrac"])
    assert float(np.max(np.abs(grad - unhex(reference["grad"])))) == 0.0


def test_verl_agrees_except_where_upstream_broadcasts() -> None:
    for case in CASES:
        same = all(case["verl"][k] == case["expected"][k] for k in ("loss", "clipfrac", "grad"))
        assert same == (case["name"] != UPSTREAM_BROADCASTS), case["name"]
    broadcast = next(c for c in CASES if c["name"] == UPSTREAM_BROADCASTS)
    assert float.fromhex(broadcast["expected"]["clipfrac"]) > 1.0  # not a fraction: a [B, B] matrix over B tokens


def test_the_fixture_covers_what_it_claims() -> None:
    assert FIXTURE["mindspeed_rl_commit"] == "05a90d77cb6cfad8999e2aee21068284db959579"
    assert all(c["expected"]["clipfrac_dtype"] == "torch.float32" for c in CASES)
    clipfracs = [float.fromhex(c["expected"]["clipfrac"]) for c in CASES if c["name"] != UPSTREAM_BROADCASTS]
    assert min(clipfracs) == 0.0 and max(clipfracs) > 0.3
    assert any(0 in np.asarray(c["inputs"]["mask"])[:, 0] or "holes" in c["name"] for c in CASES)


def test_hand_worked_loss_clipfrac_and_gradient() -> None:
    # 3 tokens, the third masked; V = 0, R = 1, cliprange 0.5:
    #   token 0: vpred 0.2 (inside the range): both squares 0.64, not clipped; d/dvpred = 0.5 * 2 (0.2 - 1) / 2 = -0.4
    #   token 1: vpred 2.0 -> clipped to 0.5: (2 - 1)^2 = 1 vs (0.5 - 1)^2 = 0.25, max 1, not clipped: grad 0.5
    # loss = 0.5 * (0.64 + 1) / 2 = 0.41
    vpreds = torch.tensor([[0.2, 2.0, 5.0]], dtype=torch.float64, requires_grad=True)
    values = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    returns = torch.ones(1, 3, dtype=torch.float64, requires_grad=True)
    loss, clipfrac = value_loss(vpreds, returns, values, torch.tensor([[1, 1, 0]]), 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(0.41, abs=1e-15) and clipfrac == 0.0
    assert vpreds.grad[0].tolist() == pytest.approx([-0.4, 0.5, 0.0], abs=1e-15)
    assert values.grad is None and returns.grad is None  # the gradient flows through vpreds only


def test_a_clipped_token_gets_no_gradient() -> None:
    # The clipped square wins when vpred moved toward R beyond the range: V = 0, R = 1, cliprange 0.2, vpred 0.9
    # -> clipped to 0.2: (0.2 - 1)^2 = 0.64 > (0.9 - 1)^2 = 0.01, so the loss is 0.5 * 0.64, constant in vpred.
    vpreds = torch.tensor([[0.9]], dtype=torch.float64, requires_grad=True)
    loss, clipfrac = value_loss(vpreds, torch.ones(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64),
                                torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 0.64, abs=1e-15) and clipfrac == 1.0
    assert vpreds.grad.item() == 0.0


def test_value_head_shape_metrics_and_refusals() -> None:
    vpreds = torch.tensor([[[0.2], [2.0]]], dtype=torch.float64)
    loss, clipfrac = value_loss(vpreds, torch.ones(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
                                torch.ones(1, 2, dtype=torch.bool), 0.5)
    assert loss.item() == pytest.approx(0.41, abs=1e-15)
    assert value_loss_metrics(-loss, clipfrac) == {"critic/vf_loss": pytest.approx(0.41), "critic/vf_clipfrac": 0.0}
    assert VALUE_LOSS_METRICS == ("critic/vf_loss", "critic/vf_clipfrac")
    empty = value_loss(vpreds, torch.ones(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), 0.5)
    assert empty[0].item() == 0.0 and empty[1] == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2), 0.5)
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), -0.1)

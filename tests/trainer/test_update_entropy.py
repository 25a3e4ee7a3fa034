"""The `actor/entropy` metric's no-grad, chunked pass (services/trainer/update.py) equals the loss's own."""

from __future__ import annotations

import torch

from services.trainer import update
from services.trainer.grpo_loss import compute_log_probs


def test_chunked_entropy_equals_the_full_vocabulary_pass(monkeypatch) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True) * 4
    tokens = torch.randint(0, 50, (3, 7))
    _, expected = compute_log_probs(logits, tokens, 0.7, with_entropy=True)
    monkeypatch.setattr(update, "ENTROPY_CHUNK_BYTES", 4 * 50 * 2)  # two tokens per chunk: 11 chunks of 21 tokens
    got = update.entropy_without_grad(logits, 0.7)
    assert got.shape == (3, 7) and not got.requires_grad
    torch.testing.assert_close(got, expected.detach(), rtol=1e-4, atol=1e-4)  # float32, |z| ~ 20


def test_entropy_by_hand() -> None:
    # Uniform over 4 tokens: H = log 4; one certain token (logits 0, -inf...): H = 0 (temperature 1).
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]]])
    got = update.entropy_without_grad(logits, 1.0)
    torch.testing.assert_close(got, torch.tensor([[torch.log(torch.tensor(4.0)).item(), 0.0]]))

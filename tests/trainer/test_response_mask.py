"""Multi-turn loss mask: response tokens the policy did not generate (tool responses the coordinator inserted)
are context. Through the update's own loss function (services/trainer/update.py) on logits that require grad: those
positions get exactly zero gradient, with the PPO term, the KL term and the entropy bonus on, and the token mean
counts only generated tokens (the loss equals the loss of a batch where the masked tokens never were response
tokens of any weight). Also the mask on the wire and in padded and packed micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sequences import Sequences
from services.trainer import inputs
from services.trainer.packing import make_packed_micro_batch
from services.trainer.step import SequenceRows, make_micro_batch
from services.trainer.update import Experience, UpdateOptions, micro_batch_loss

VOCAB = 11
# Two rows: prompt 3 + response 6 (tokens 2-3 of the response a tool's answer), prompt 2 + response 4 (all generated).
PROMPTS, RESPONSES = [3, 2], [6, 4]
MASK = [True, True, False, False, True, True, True, True, True, True]


def rows(mask: list[bool] | None = MASK) -> SequenceRows:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (sum(PROMPTS) + sum(RESPONSES),), generator=g)
    out = SequenceRows(tokens, torch.tensor(PROMPTS), torch.tensor(RESPONSES))
    out.response_mask = None if mask is None else torch.tensor(mask)
    return out


def experience(r: SequenceRows) -> Experience:
    g = torch.Generator().manual_seed(1)
    n = sum(RESPONSES)
    old = -1.0 - torch.rand(n, generator=g)
    return Experience(r, torch.tensor([0.7, -0.4]), old, old + 0.1 * torch.randn(n, generator=g))


def loss_and_grad(r: SequenceRows, opts: UpdateOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mb = make_micro_batch(r, [0, 1])
    logits = torch.randn((2, mb["input_ids"].shape[1], VOCAB), generator=torch.Generator().manual_seed(2),
                         requires_grad=True)
    loss, metrics = micro_batch_loss(experience(r), opts, temperature=1.0, kl_coef=0.05)(logits, mb)
    loss.backward()
    return loss.detach(), logits.grad, metrics


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_tool_tokens_get_zero_gradient_and_leave_the_token_mean(token_level_loss: bool) -> None:
    opts = UpdateOptions(entropy_coeff=0.01, use_kl=True, token_level_loss=token_level_loss)
    loss, grad, metrics = loss_and_grad(rows(), opts)
    # The logit at prompt - 1 + c predicts response token c; row 0's tool tokens are c = 2, 3 -> positions 4, 5.
    assert torch.equal(grad[0, 4], torch.zeros(VOCAB)) and torch.equal(grad[0, 5], torch.zeros(VOCAB))
    assert grad[0, 3].abs().sum() > 0 and grad[0, 6].abs().sum() > 0 and grad[1, 1:5].abs().sum() > 0
    # Without the mask the same positions do get gradient (the mask is what zeroes them) ...
    _, unmasked_grad, _ = loss_and_grad(rows(None), opts)
    assert unmasked_grad[0, 4].abs().sum() > 0
    # ... the loss's token count is the 8 generated tokens ...
    mb = make_micro_batch(rows(), [0, 1])
    assert mb["response_mask"].sum().item() == 8
    assert mb["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 1]
    assert torch.isfinite(loss) and metrics["actor/entropy"] > 0
    # ... and nothing about the tool tokens reaches the loss: other old / reference log-probs there, and other logits
    # at the positions that predict them, give the same loss bitwise.
    r = rows()
    exp = experience(r)
    exp.old_log_probs[2:4] -= 3.0
    exp.ref_log_probs[2:4] += 2.0
    logits = torch.randn((2, mb["input_ids"].shape[1], VOCAB), generator=torch.Generator().manual_seed(2))
    moved = logits.clone()
    moved[0, 4:6] += 5.0
    fn = micro_batch_loss(exp, opts, temperature=1.0, kl_coef=0.05)
    assert torch.equal(fn(moved, make_micro_batch(r, [0, 1]))[0], loss)


def test_the_mask_rides_in_packed_micro_batches_per_row() -> None:
    mb = make_packed_micro_batch(rows(), [0, 1], one_row=True)
    assert mb["response_mask"].tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert mb["unpack_index"].numel() == 10  # unpacking still places every response token


def test_the_mask_travels_on_the_wire_and_is_checked() -> None:
    seqs = Sequences.from_lists(["a", "b"], [np.array([1, 2, 3]), np.array([4, 5])],
                                [np.arange(6), np.arange(4)], 0, response_masks=[MASK[:6], MASK[6:]])
    back = Sequences.from_proto(seqs.to_proto())
    assert back.response_mask.tolist() == MASK
    assert seqs.take(1, 2).response_mask.tolist() == MASK[6:]
    assert inputs.sequences(seqs.to_proto(), vocab_size=VOCAB).response_mask.tolist() == MASK
    with pytest.raises(ValueError, match=r"response_mask must be \[10 response tokens\]"):
        Sequences(["a", "b"], seqs.token_ids, seqs.prompt_lengths, seqs.response_lengths, response_mask=np.ones(9, bool))

"""Routing replay's plumbing without a model: the rollout's per-sample routing aligned with the tokens
(Sequences), on the wire and back, checked against the model at the trainer's door, laid out beside input_ids in
padded and packed micro-batches; and the config rules of `rlfabric.routing_replay`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import ConfigError, load_config
from services.common.model_spec import MoeSpec
from services.common.sequences import Sequences
from services.trainer import inputs
from services.trainer.packing import make_packed_micro_batch
from services.trainer.step import SequenceRows, make_micro_batch

MOE = MoeSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, moe_layers=(0, 1),
              router_aux_loss_coef=0.001)


def two_samples() -> Sequences:
    prompts = [np.array([5, 6, 7]), np.array([8, 9])]
    responses = [np.array([1, 2]), np.array([3, 4, 5, 6])]
    # the rollout's rows: prompt + response - 1 positions each; expert e at position p of sample s is 10s+p mod 8
    routed = [np.stack([np.stack([[(10 * s + p) % 8, (10 * s + p + 1) % 8]] * 2) for p in range(len(pr) + len(r) - 1)])
              for s, (pr, r) in enumerate(zip(prompts, responses, strict=True))]
    return Sequences.from_lists(["a/0", "a/1"], prompts, responses, 3, routed)


def test_routing_rows_align_with_tokens_and_the_last_position_is_free() -> None:
    seqs = two_samples()
    assert seqs.routed_experts.shape == (11, 2, 2)
    assert seqs.routed_experts[0, 0].tolist() == [0, 1] and seqs.routed_experts[3, 1].tolist() == [3, 4]
    assert (seqs.routed_experts[4] == -1).all() and (seqs.routed_experts[10] == -1).all()  # last of each sample
    assert seqs.routed_experts[5, 0].tolist() == [2, 3]  # sample 1, position 0: (10 + 0) % 8
    tail = seqs.take(1, 2)
    assert np.array_equal(tail.routed_experts, seqs.routed_experts[5:])
    back = Sequences.from_proto(seqs.to_proto())
    assert np.array_equal(back.routed_experts, seqs.routed_experts)
    assert Sequences.from_proto(Sequences.from_lists(["x"], [np.array([1])], [np.array([2])]).to_proto()
                                ).routed_experts is None


def test_a_sample_with_the_wrong_number_of_routing_rows_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"sample b/0: routed_experts has shape \(3, 2, 2\), expected \[4"):
        Sequences.from_lists(["b/0"], [np.array([1, 2])], [np.array([3, 4, 5])], 0, [np.zeros((3, 2, 2))])


def test_the_trainer_checks_routing_against_its_model() -> None:
    batch = two_samples().to_proto()
    assert inputs.sequences(batch, vocab_size=16, moe=MOE).routed_experts.shape == (11, 2, 2)
    with pytest.raises(ValueError, match="no MoE layers"):
        inputs.sequences(batch, vocab_size=16, moe=None)
    with pytest.raises(ValueError, match=r"\[moe_layers, top_k\] = \[2, 2\]; the model has \[3, 2\]"):
        inputs.sequences(batch, vocab_size=16, moe=MoeSpec(8, 2, 16, True, (0, 1, 2), 0.001))
    with pytest.raises(ValueError, match=r"routed_experts\[0, 0, 1\] = 1 is not an expert of the model \(0 to 0"):
        inputs.sequences(batch, vocab_size=16, moe=MoeSpec(1, 2, 16, True, (0, 1), 0.001))


def rows_with_routing() -> SequenceRows:
    seqs = two_samples()
    return SequenceRows(torch.from_numpy(seqs.token_ids.astype(np.int64)), torch.from_numpy(seqs.prompt_lengths),
                        torch.from_numpy(seqs.response_lengths), torch.from_numpy(seqs.routed_experts))


def test_padded_micro_batches_carry_each_tokens_experts_beside_it() -> None:
    rows = rows_with_routing()
    mb = make_micro_batch(rows, [1, 0], pad_rows_to=3)
    routed = mb["routed_experts"]
    assert routed.shape == (3, 6, 2, 2)
    assert torch.equal(routed[0], rows.routed_experts[5:11])  # row 1: all 6 tokens
    assert torch.equal(routed[1, :5], rows.routed_experts[0:5]) and (routed[1, 5:] == -1).all()  # padding: free
    assert (routed[2] == -1).all()  # a padding row


def test_packed_micro_batches_carry_each_tokens_experts_beside_it() -> None:
    rows = rows_with_routing()
    mb = make_packed_micro_batch(rows, [0, 1], one_row=True)
    assert mb["input_ids"].shape == (1, 11)
    assert torch.equal(mb["routed_experts"][0], rows.routed_experts)


def _config(repo_root: Path, *overrides: str, path: str = "configs/grpo_tiny_moe_cpu.yaml"):
    return load_config(repo_root / path, overrides=["rlfabric.routing_replay=rollout", *overrides])


def test_routing_replay_is_accepted_for_a_moe_model_and_refused_where_it_cannot_work(repo_root: Path) -> None:
    assert _config(repo_root).rlfabric.routing_replay == "rollout"
    with pytest.raises(ConfigError, match="the model has none"):
        _config(repo_root, path="configs/grpo_tiny_cpu.yaml")
    with pytest.raises(ConfigError, match="enable_prefix_caching false"):
        _config(repo_root, "generate_config.enable_prefix_caching=true")

"""Activation memory: recompute and sequence parallelism change what a forward keeps, never the numbers.

Two module-scoped runs of tests/trainer/activation_checks.py on the tiny model: one process at TP 1 through
every recompute variant (and the plain trainer), two gloo processes at TP 2 with sequence parallelism (alone
and with full recompute). Each case records log-probs, the gradients of one backward over the batch (HF
names), the activation bytes a training forward leaves for backward, and two GRPO updates. Unit tests of the
pieces (TP 1 turns sequence parallelism off, padding, MindSpeed's switches) follow.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import run_ranks

from services.trainer import activation_memory, sequence_parallel
from services.trainer.activation_memory import ActivationMemory

RECOMPUTE = ["full_uniform_1", "full_block_1", "selective", "activation", "full_and_activation"]


def _launch(world: int, tp: int, cases: list[str], hf: Path, out: Path, timeout_s: float = 300) -> dict:
    run_ranks("activation_checks.py", world, ["--tp", str(tp), "--hf", str(hf), "--out", str(out),
                                              *[a for c in cases for a in ("--case", c)]], timeout_s=timeout_s)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tp1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(1, 1, ["none", *RECOMPUTE], tiny_model_dir, tmp_path_factory.mktemp("recompute") / "tp1.pt")


@pytest.fixture(scope="module")
def tp2_sp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(2, 2, ["sp", "sp_full"], tiny_model_dir, tmp_path_factory.mktemp("sequence_parallel") / "tp2.pt")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _worst_grad(got: dict, want: dict) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((_rel(got[n], want[n]), n) for n in want)


@pytest.mark.parametrize("case", RECOMPUTE)
def test_recompute_gives_the_same_log_probs_and_gradients(tp1, case):
    base, got = tp1["none"], tp1[case]
    assert torch.isfinite(base["log_probs"]).all() and base["log_probs"].abs().max() > 0
    assert _rel(got["log_probs"], base["log_probs"]) <= 1e-6
    assert _worst_grad(got["grads"], base["grads"])[0] <= 1e-6
    for a, b in zip(got["metrics"], base["metrics"], strict=True):
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert _rel(got["log_probs_after"], base["log_probs_after"]) <= 1e-6
    # The updates moved the policy, so equal numbers are not equal constants.
    assert (base["log_probs_after"] - base["log_probs"]).abs().max() > 1e-4


def test_recompute_keeps_fewer_activations(tp1):
    saved = {case: r["saved_bytes"] for case, r in tp1.items()}
    # Full recompute of every layer keeps only each layer's input; of one layer of two, about half.
    assert saved["full_uniform_1"] < 0.15 * saved["none"]
    assert 0.3 * saved["none"] < saved["full_block_1"] < 0.7 * saved["none"]
    # Selective frees the core attention; the activation function its SwiGLU output.
    assert saved["selective"] < saved["none"]
    assert saved["activation"] < 0.8 * saved["none"]
    assert saved["full_and_activation"] < 0.15 * saved["none"]


def test_sequence_parallel_at_tp2_equals_tp1(tp1, tp2_sp):
    base = tp1["none"]
    for case in ("sp", "sp_full"):
        got = tp2_sp[case]
        assert got["sequence_parallel"] is True
        # Rows of odd length run too: the forward pads them to a multiple of TP.
        assert (got["log_probs"] - base["log_probs"]).abs().max().item() < 1e-5
        worst, name = _worst_grad(got["grads"], base["grads"])
        assert worst < 1e-5, name
        for a, b in zip(got["metrics"], base["metrics"], strict=True):
            assert abs(a["actor/loss"] - b["actor/loss"]) < 1e-5
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert (got["log_probs_after"] - base["log_probs_after"]).abs().max().item() < 1e-5


def test_sequence_parallel_tags_every_norm_for_the_tp_sum(tp2_sp):
    # Megatron's rule: these weights' gradients are partial per TP rank and the optimizer sums them.
    assert tp2_sp["sp"]["tagged"] == sorted(
        [f"decoder.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "pre_mlp_layernorm")]
        + ["decoder.final_layernorm.weight"])
    assert tp2_sp["sp_full"]["saved_bytes"] < 0.2 * tp2_sp["sp"]["saved_bytes"]


# ---- the pieces ---------------------------------------------------------------------------------------

def test_tp1_turns_sequence_parallel_off_as_megatron_does():
    memory = ActivationMemory(sequence_parallel=True)
    assert activation_memory.transformer_config_kwargs(memory, tp=1, layers_per_stage=2)["sequence_parallel"] is False
    assert activation_memory.transformer_config_kwargs(memory, tp=2, layers_per_stage=2)["sequence_parallel"] is True


def test_recompute_options_reach_the_transformer_config():
    full = ActivationMemory(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    kw = activation_memory.transformer_config_kwargs(full, tp=1, layers_per_stage=4)
    assert (kw["recompute_granularity"], kw["recompute_method"], kw["recompute_num_layers"]) == ("full", "block", 2)
    with pytest.raises(ValueError, match="recompute_num_layers"):
        activation_memory.transformer_config_kwargs(full, tp=1, layers_per_stage=1)


@pytest.mark.parametrize(("kwargs", "key"), [
    (dict(recompute_granularity="full"), "recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_method="block"), "recompute_method"),
    (dict(recompute_granularity="partial"), "recompute_granularity"),
])
def test_options_built_in_code_are_checked_like_the_config(kwargs, key):
    with pytest.raises(ValueError, match=key):
        ActivationMemory(**kwargs)


def test_padding_keeps_real_tokens_blind_to_it():
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.arange(3)[None]
    mask = torch.ones(3, 3, dtype=torch.bool).triu(1)[None, None]
    mask[..., 2, 0] = True  # a non-causal pattern (e.g. packed sequences) is kept as it is
    out = sequence_parallel.pad_to(4, ids, pos, mask)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]]
    m = out["attention_mask"][0, 0]
    assert torch.equal(m[:3, :3], mask[0, 0])
    assert m[:3, 3].all()  # real rows never see the padding
    assert not m[3].all()  # the padding row attends to something (no fully masked softmax row)


def test_swap_attention_is_passed_to_mindspeed_on_its_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trainer"])
    monkeypatch.delitem(sys.modules, "mindspeed.megatron_adaptor", raising=False)
    activation_memory.pass_to_mindspeed(ActivationMemory())
    assert sys.argv == ["trainer"]
    activation_memory.pass_to_mindspeed(ActivationMemory(swap_attention=True))
    activation_memory.pass_to_mindspeed(ActivationMemory(swap_attention=True))
    assert sys.argv == ["trainer", "--swap-attention"]


def test_swap_attention_after_mindspeed_was_imported_is_an_error(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trainer"])
    monkeypatch.setitem(sys.modules, "mindspeed.megatron_adaptor", object())
    with pytest.raises(RuntimeError, match="swap_attention"):
        activation_memory.pass_to_mindspeed(ActivationMemory(swap_attention=True))


def test_swap_attention_off_ascend_is_logged_not_dropped(caplog):
    with caplog.at_level(logging.WARNING, logger=activation_memory.__name__):
        activation_memory.note_platform_only(ActivationMemory(swap_attention=True), on_ascend=False)
        activation_memory.note_platform_only(ActivationMemory(swap_attention=True), on_ascend=True)
    assert len(caplog.records) == 1 and "swap_attention" in caplog.records[0].getMessage()

"""LoRA on the trainer's Megatron model (services/trainer/lora.py) against plain torch on the HF model.

One run of tests/trainer/lora_checks.py on two gloo ranks goes through TP 1, TP 1 with full recompute, TP 2 and
TP 2 with sequence parallelism, on the tiny model's HF weights (fp32). Each case applies LoRA (rank 4, alpha 8),
then loads the same random adapters. The reference is built here, independently of lora.py: the Megatron base
weights (converted from HF) plus (alpha / r) B A for every adapted weight, converted to HF names and run through
the HF model with torch.func.functional_call, its adapter gradients taken by autograd through the merge.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lora_checks import ALPHA, CASES, RANK, batch
from trainer_helpers import run_ranks

from services.common.model_spec import read_hf_config
from services.trainer.lora import TARGET_KINDS, LoraOptions, is_adapter_name

SCALING = ALPHA / RANK
LAYERS, TARGETS = 2, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("lora")
    run_ranks("lora_checks.py", 2, ["--hf", str(tiny_model_dir), "--work", str(work)])
    return {name: torch.load(work / f"lora_{name}.pt", weights_only=False) for name, _, _ in CASES}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, runs) -> dict:
    """The HF model with weights W + (alpha / r) B A: logits, adapter gradients of the test loss, merged weights."""
    import transformers

    from services.trainer.convert import hf_to_mcore, load_hf_state, mcore_to_hf

    torch.set_num_threads(1)
    spec, _ = read_hf_config(tiny_model_dir)
    base = hf_to_mcore(load_hf_state(tiny_model_dir), spec, 1, 1)[(0, 0, 0)]
    adapters = {n: t.clone().requires_grad_(True) for n, t in runs["tp1"]["adapters"].items()}
    merged = dict(base)
    for layer in {n.rsplit(".lora_", 1)[0] for n in adapters}:
        merged[f"{layer}.weight"] = base[f"{layer}.weight"] + SCALING * (
            adapters[f"{layer}.lora_B.weight"] @ adapters[f"{layer}.lora_A.weight"])
    hf_state = mcore_to_hf({(0, 0): merged}, spec, 1, 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids, loss_weights = batch(spec.vocab_size)
    logits = torch.func.functional_call(model, hf_state, (ids,)).logits
    (logits * loss_weights).sum().backward()
    return {"logits": logits.detach(), "grads": {n: t.grad for n, t in adapters.items()}, "base": base,
            "merged": {n: t.detach() for n, t in merged.items()},
            "merged_hf": {n: t.detach() for n, t in hf_state.items()}}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _expected_adapter_names() -> list[str]:
    parent = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
    return sorted(f"decoder.layers.{i}.{parent[t]}.{t}.lora_{m}.weight" for i in range(LAYERS) for t in TARGETS
                  for m in "AB")


# ---- 1. a fresh adapter changes nothing; only adapters train -----------------------------------------------------
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_fresh_adapters_leave_the_logits_bitwise_and_only_they_require_grad(runs, case):
    r = runs[case]
    assert r["adapted_layers"] == LAYERS * len(TARGETS)
    assert torch.equal(r["zero_adapter_logits"], r["base_logits"])
    assert r["zero_merged_equal"]  # the export of a fresh adapter is the base weights, bitwise
    assert r["trainable"] == r["adapter_names"] == _expected_adapter_names()


def test_fresh_adapters_are_initialised_as_peft_and_the_same_in_every_layout(runs):
    init = runs["tp1"]["initial_adapters"]
    for name, t in init.items():
        if name.endswith("lora_B.weight"):
            assert not t.any(), name
            continue
        bound = 1 / math.sqrt(t.shape[1])  # kaiming_uniform_(a=sqrt(5)) over fan_in = the layer's whole input
        assert t.shape[0] == RANK and t.abs().max() <= bound and t.abs().max() > 0.9 * bound, name
    assert len({t.sum().item() for n, t in init.items() if n.endswith("lora_A.weight")}) == LAYERS * len(TARGETS)
    for case in ("tp2", "tp2_sp"):
        assert _max_diff(runs[case]["initial_adapters"], init) == 0.0


# ---- 2. the LoRA forward is the merged model's --------------------------------------------------------------------
def test_lora_logits_equal_the_hf_model_with_merged_weights(runs, reference):
    got = runs["tp1"]["lora_logits"]
    assert (got - reference["logits"]).abs().max().item() < 1e-5
    # The adapters matter: the merged model is another model.
    assert (got - runs["tp1"]["base_logits"]).abs().max().item() > 0.1


# ---- 3. adapters off: the base model, bitwise ---------------------------------------------------------------------
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_disabled_adapters_give_the_base_model_bitwise(runs, case):
    r = runs[case]
    assert torch.equal(r["disabled_logits"], r["base_logits"])
    assert torch.equal(r["enabled_again_logits"], r["lora_logits"])


# ---- 4. backward: adapters only, the plain-torch gradients --------------------------------------------------------
def test_backward_reaches_adapters_only_with_the_plain_torch_gradients(runs, reference):
    r = runs["tp1"]
    assert r["with_grad"] == r["adapter_names"]
    assert max(g.abs().max().item() for g in reference["grads"].values()) > 1e-2  # gradients worth comparing
    assert _max_diff(r["grads"], reference["grads"]) < 1e-5


# ---- 5. tensor / sequence parallelism (and full recompute) equal TP 1 ---------------------------------------------
@pytest.mark.parametrize(("case", "sp"), [("tp1_recompute", False), ("tp2", False), ("tp2_sp", True)])
def test_parallel_layouts_equal_tp1(runs, case, sp):
    r, base = runs[case], runs["tp1"]
    assert r["sequence_parallel"] is sp
    assert r["with_grad"] == r["adapter_names"]
    assert (r["lora_logits"] - base["lora_logits"]).abs().max().item() < 1e-5
    assert _max_diff(r["grads"], base["grads"]) < 1e-5
    # Matrices held whole on every TP rank end the backward with equal, whole gradients.
    assert r["replica_grad_spread"] < 1e-7


# ---- 6. merged export: base names, W + scaling B A ----------------------------------------------------------------
def test_merged_export_is_base_plus_delta_under_the_base_names(runs, reference):
    r = runs["tp1"]
    assert r["merged_names"] == r["base_names"]
    assert not any(is_adapter_name(n) or "lora" in n for n in r["merged_names"])
    assert _max_diff(r["merged"], reference["merged"]) < 1e-6
    adapted = {n.rsplit(".lora_", 1)[0] + ".weight" for n in r["adapter_names"]}
    assert all(torch.equal(t, r["base"][n]) for n, t in r["merged"].items() if n not in adapted)
    assert all(not torch.equal(r["merged"][n], r["base"][n]) for n in adapted)


@pytest.mark.parametrize("case", ["tp2", "tp2_sp"])
def test_merged_export_at_tp2_carries_shard_layout_and_assembles_to_tp1(runs, reference, case):
    r = runs[case]
    assert all(got == want for got, want in r["merged_partition_dims"].values())
    assert {0, 1} <= {want for _, want in r["merged_partition_dims"].values()}  # column and row weights among them
    assert _max_diff(r["merged_hf"], reference["merged_hf"]) < 1e-6


# ---- 7. adapter state: round trip, whole tensors, refusals --------------------------------------------------------
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_adapter_state_round_trip_restores_the_outputs_exactly(runs, case):
    r = runs[case]
    assert torch.equal(r["zeroed_logits"], r["base_logits"])  # other adapter values were really loaded in between
    assert torch.equal(r["restored_logits"], r["lora_logits"])
    assert _max_diff(r["adapters_gathered_back"], r["adapters"]) == 0.0  # whole -> shards -> whole
    refusals = r["refusals"]
    assert "missing ['decoder.layers.0.self_attention.linear_proj.lora_A.weight']" in refusals["missing"]
    assert "has shape (4, 1), the model expects" in refusals["shape"]
    assert "already has LoRA adapters" in refusals["again"]


# ---- the optimizer keeps nothing for frozen weights; sizes --------------------------------------------------------
@pytest.mark.parametrize("case", ["tp1", "tp2"])
def test_optimizer_holds_state_for_adapters_only(runs, case):
    r = runs[case]
    assert r["slots"] == r["adapter_names"]
    assert r["grad_buffer_numel"] == r["adapter_numel"]
    assert r["adam_state_numel"] == 2 * r["adapter_numel"]  # exp_avg and exp_avg_sq
    mem = r["optimizer_memory"]
    assert mem["master"] == 0 and mem["grads"] == r["adapter_bytes"]
    assert r["moved"] == r["adapter_names"] and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert r["grad_norm"] == pytest.approx(runs["tp1"]["grad_norm"], rel=1e-5)


def test_adapter_size_is_counted_and_planned(runs):
    # Per layer, r x (in + out) per target: qkv 128 -> (4 + 2 x 2) x 32, proj 128 -> 128, fc1 128 -> 2 x 512,
    # fc2 512 -> 128; at TP 2 the split side halves.
    whole = LAYERS * RANK * ((128 + 256) + (128 + 128) + (128 + 1024) + (512 + 128))
    tp2 = LAYERS * RANK * ((128 + 128) + (64 + 128) + (128 + 512) + (256 + 128))
    for case, want in (("tp1", whole), ("tp2", tp2), ("tp2_sp", tp2)):
        r = runs[case]
        assert r["adapter_numel"] == r["planned_numel"] == want
        assert r["adapter_bytes"] == 4 * want


# ---- options ------------------------------------------------------------------------------------------------------
def test_options_follow_upstream_names_and_are_checked():
    opts = LoraOptions(rank=16, alpha=32, target_modules=["linear_qkv", "linear_qkv", "linear_fc2"])
    assert opts.scaling == 2.0 and opts.target_modules == ("linear_qkv", "linear_fc2")
    assert LoraOptions(rank=8, alpha=16).target_modules == tuple(TARGET_KINDS) == TARGETS
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['q_proj'\].*linear_qkv"):
        LoraOptions(rank=8, alpha=16, target_modules=("linear_qkv", "q_proj"))
    with pytest.raises(ValueError, match="is empty"):
        LoraOptions(rank=8, alpha=16, target_modules=())
    with pytest.raises(ValueError, match="not the string"):
        LoraOptions(rank=8, alpha=16, target_modules="linear_qkv")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="lora_r must be a positive integer"):
            LoraOptions(rank=bad, alpha=16)
    for bad in (0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lora_alpha must be a positive number"):
            LoraOptions(rank=8, alpha=bad)


def test_adapter_names_are_recognised():
    assert is_adapter_name("decoder.layers.0.mlp.linear_fc1.lora_A.weight")
    assert is_adapter_name("module.decoder.layers.3.self_attention.linear_proj.lora_B.weight")
    assert not is_adapter_name("decoder.layers.0.mlp.linear_fc1.weight")
    assert not is_adapter_name("decoder.layers.0.self_attention.linear_q_down_proj.weight")

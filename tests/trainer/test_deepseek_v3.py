"""The trainer's DeepSeek-V3 on Megatron-core's MLA and MoE (tests/trainer/deepseek_checks.py, two gloo ranks), against
transformers in fp32: log-probs equal HF's at expert parallel 1 and 2 (EP 2 with both token dispatchers, the two
data-parallel ranks' micro-batches holding different token counts); one backward at EP 2 gives EP 1's gradients,
which for the last layer's routed and shared experts (no aux loss reaches them) equal HF's plain-torch gradients;
the aux-loss-free expert-bias update moves each bias by the rate towards balance, as Megatron's; and a plain-rope
variant of the model (slow; the tiny has YaRN, as DeepSeek-V3's releases) gives HF's log-probs too. Plus the MLA /
routing configuration Megatron gets.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from deepseek_checks import BIAS_RATE
from hf_reference import hf_log_probs
from moe_checks import TEMPERATURE
from rank_checks import make_rows
from trainer_helpers import run_ranks

from services.common.model_spec import read_hf_config

CASES = ("1:allgather", "2:allgather", "2:alltoall")


@pytest.fixture(scope="module")
def ds_results(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{"EP:DISPATCHER": rank 0's results, "bias": the expert-bias update at EP 2} (deepseek_checks.py)."""
    work = tmp_path_factory.mktemp("deepseek_work")
    cases = [arg for case in CASES for arg in ("--case", case)]
    run_ranks("deepseek_checks.py", 2, ["--hf", str(tiny_deepseek_dir), "--work", str(work), *cases, "--bias-ep", "2"],
              timeout_s=300)
    out = {case: torch.load(work / f"moe_ep{case.replace(':', '_')}.pt", weights_only=False) for case in CASES}
    out["bias"] = torch.load(work / "bias_ep2.pt", weights_only=False)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_deepseek_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_deepseek_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", CASES)
def test_log_probs_equal_transformers(ds_results, hf_model, case: str) -> None:
    rows = make_rows(hf_model.config.vocab_size, 1)
    expected = hf_log_probs(hf_model, rows, TEMPERATURE)
    got = ds_results[case]["log_probs"]
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["2:allgather", "2:alltoall"])
def test_ep2_gradients_equal_ep1(ds_results, case: str) -> None:
    g1, g2 = ds_results["1:allgather"]["grads"], ds_results[case]["grads"]
    assert set(g1) == set(g2)
    experts = [n for n in g1 if ".mlp.experts." in n]
    assert len(experts) == 1 * 8 * 2  # one MoE layer (layer 0 is dense) x experts x (fc1, fc2)
    mla = [n for n in g1 if "linear_kv_up_proj" in n or "linear_q_down_proj" in n]
    assert len(mla) == 2 * 2 and "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in g1
    diffs = {n: (g1[n] - g2[n]).abs().max().item() for n in g1}
    assert max(diffs.values()) < 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    assert max(g.abs().max().item() for g in g1.values()) > 1e-3  # the step did produce gradients


def test_expert_gradients_equal_plain_torch(ds_results, hf_model) -> None:
    """Layer 1's routed and shared experts get no gradient from its aux loss (which depends on the router's input,
    produced before them), so theirs is the NLL's alone: HF's in plain torch (moe_checks' weighting: each
    micro-batch of 2 rows weighs 1/4)."""
    from services.trainer import grpo_loss

    rows = make_rows(hf_model.config.vocab_size, 1)
    model = hf_model.train()
    model.zero_grad(set_to_none=True)
    for m in range(4):
        logps = []
        for i in (2 * m, 2 * m + 1):
            seq = rows.token_ids[rows.seq_offsets[i]: rows.seq_offsets[i + 1]]
            p = int(rows.prompt_lengths[i])
            lp, _ = grpo_loss.compute_log_probs(model(seq[None]).logits[:, p - 1: len(seq) - 1], seq[None, p:],
                                                TEMPERATURE)
            logps.append(lp[0])
        (-torch.cat(logps).mean() / 4).backward()
    model.eval()
    got, params = ds_results["2:allgather"]["grads"], dict(model.named_parameters())
    hf = "model.layers.1.mlp."
    for e in range(8):
        gate_up = params[hf + "experts.gate_up_proj"].grad[e]  # transformers 5 keeps the experts fused: [E, 2F, H]
        assert (got[f"{hf}experts.{e}.linear_fc1"] - gate_up).abs().max().item() < 1e-6
        assert (got[f"{hf}experts.{e}.linear_fc2"] - params[hf + "experts.down_proj"].grad[e]).abs().max().item() < 1e-6
    shared = "decoder.layers.1.mlp.shared_experts."
    gate_up = torch.cat([params[hf + "shared_experts.gate_proj.weight"].grad,
                         params[hf + "shared_experts.up_proj.weight"].grad])
    assert (got[shared + "linear_fc1.weight"] - gate_up).abs().max().item() < 1e-6
    assert (got[shared + "linear_fc2.weight"] - params[hf + "shared_experts.down_proj.weight"].grad).abs().max() < 1e-6


def test_moe_metrics_agree_over_expert_parallel_sizes(ds_results) -> None:
    for case in CASES:
        fwd, upd = ds_results[case]["forward_metrics"], ds_results[case]["update_metrics"]
        assert "moe/aux_loss" not in fwd and upd["moe/aux_loss"] > 0
        assert upd["moe/expert_load_max_over_mean"] >= 1.0
    for case in CASES[1:]:
        for kind in ("update_metrics", "forward_metrics"):
            assert ds_results[case][kind] == pytest.approx(ds_results[CASES[0]][kind], rel=1e-6)


def test_expert_bias_moves_towards_balance(ds_results, tiny_deepseek_dir: Path) -> None:
    """Megatron's update: bias += rate * sign(mean tokens per expert - tokens of the expert), over all DP ranks."""
    from safetensors.torch import load_file

    r = ds_results["bias"]
    loaded = load_file(str(tiny_deepseek_dir / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(r["before"], loaded) and loaded.abs().max() > 0  # the HF bias, as loaded
    counts = r["counts"]  # top-2: two choices per token of the training pass (padding included, as Megatron counts)
    assert counts.sum() > 0 and counts.sum() % 2 == 0 and counts.max() > counts.min()
    expected = r["before"] + BIAS_RATE * torch.sign(counts.mean() - counts)
    assert torch.allclose(r["after"], expected, atol=1e-7, rtol=0)
    assert not r["counts_left"].any()  # the token counts start afresh for the next step


def test_mla_and_router_config(tiny_deepseek_dir: Path) -> None:
    """transformers' DeepSeek-V3: MLA sizes, YaRN rope; sigmoid router (logits in fp32) with expert bias, 2 groups
    of which 1 is chosen, top-2 renormalised, times 2.5; one shared expert; layer 0 dense."""
    from services.trainer import mla, moe

    spec, _ = read_hf_config(tiny_deepseek_dir)
    kw = mla.transformer_config_kwargs(spec)
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"]) == (
        64, 512, 16, 64, 32)
    assert (kw["rope_type"], kw["rotary_scaling_factor"], kw["original_max_position_embeddings"]) == ("yarn", 4.0, 512)
    assert (kw["mscale"], kw["mscale_all_dim"], kw["beta_fast"], kw["beta_slow"]) == (1.0, 1.0, 32.0, 1.0)
    assert spec.head_dim == 32  # Megatron's kv_channels for MLA: v_head_dim
    plain = mla.transformer_config_kwargs(dataclasses.replace(spec, yarn=None))
    assert plain["rope_type"] == "rope" and plain["mscale_all_dim"] == 0.0  # softmax scale 1 / sqrt(q head dim)
    kw = moe.transformer_config_kwargs(spec, moe.MoeOptions(), ep=2)
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"] is True
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"], kw["moe_router_topk"]) == (2, 1, 2)
    assert kw["moe_router_topk_scaling_factor"] == 2.5 and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_shared_expert_intermediate_size"] == 64 and kw["moe_layer_freq"] == [0, 1]
    assert kw["moe_router_bias_update_rate"] == 0.0  # the bias stays as loaded unless the YAML enables its update
    kw = moe.transformer_config_kwargs(spec, moe.MoeOptions(moe_router_enable_expert_bias=True), ep=1)
    assert kw["moe_router_bias_update_rate"] == 1e-3
    assert mla.transformer_config_kwargs(dataclasses.replace(spec, mla=None)) == {}


@pytest.fixture(scope="module")
def rope_variant_dir(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 with plain rope, and with YaRN in DeepSeek's legacy `rope_scaling` spelling with
    mscale != mscale_all_dim (transformers' ratio of the two on cos/sin), the same weights."""
    out = Path(shutil.copytree(tiny_deepseek_dir, tmp_path_factory.mktemp("rope") / "model"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    legacy = Path(shutil.copytree(tiny_deepseek_dir, out.parent / "legacy"))
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
    (legacy / "config.json").write_text(json.dumps(cfg, indent=2))
    return out.parent


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["model", "legacy"])
def test_other_rope_settings_give_transformers_log_probs(rope_variant_dir: Path, tiny_deepseek_dir: Path,
                                                         tmp_path: Path, variant: str) -> None:
    import transformers

    hf_dir = rope_variant_dir / variant
    spec, _ = read_hf_config(hf_dir)
    assert spec.yarn is None if variant == "model" else (spec.yarn.factor, spec.yarn.mscale_all_dim) == (4.0, 0.8)
    run_ranks("deepseek_checks.py", 1, ["--hf", str(hf_dir), "--work", str(tmp_path), "--case", "1:allgather"])
    got = torch.load(tmp_path / "moe_ep1_allgather.pt", weights_only=False)["log_probs"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tiny = transformers.AutoModelForCausalLM.from_pretrained(tiny_deepseek_dir, dtype=torch.float32)
    rows = make_rows(model.config.vocab_size, 1)
    expected = hf_log_probs(model, rows, TEMPERATURE)
    assert (got - expected).abs().max().item() < 1e-5
    assert (hf_log_probs(tiny.eval(), rows, TEMPERATURE) - expected).abs().max().item() > 1e-3  # the rope mattered

"""`rlfabric plan`: the memory arithmetic by hand, every upstream config planned, MoE models, refusals and advice.

The activation formulas are checked against measured peaks of real Megatron models in
tests/trainer/test_memory.py; here the state, KV-cache and placement arithmetic is checked by hand.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.planning.activations import Kernels, MicroBatch, Recompute, TrainShape, stage_activations
from services.planning.arithmetic import (
    GIB,
    ModelShape,
    parse_size,
    rank_expert_params,
    rank_params,
    rollout_memory,
    training_state,
)
from services.planning.experts import ExpertLayout, Experts
from services.planning.plan import model_shape, plan_config

UPSTREAM = Path(__file__).resolve().parents[3] / "shared/reference/mindspeed_rl"
# Qwen2.5-7B as its model block describes it (configs/model/qwen25_7b.yaml).
QWEN25_7B = ModelShape(num_layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                       tied=False, qkv_bias=True)


def _upstream(name: str) -> Path:
    path = UPSTREAM / name
    if not path.is_file():
        pytest.skip(f"{path} is not here (../shared/reference/mindspeed_rl)")
    return path


def _rlfabric(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=repo_root, capture_output=True,
                          text=True, timeout=120)


def test_qwen25_7b_parameters_by_hand() -> None:
    per_layer = (3584 * (3584 + 2 * 512) + 4608  # QKV weight and bias (28 query + 2 x 4 KV heads of 128)
                 + 3584 * 3584  # attention output projection
                 + 3 * 3584 * 18944  # SwiGLU: gate, up, down
                 + 2 * 3584)  # two RMSNorm weights
    assert QWEN25_7B.total_params() == 28 * per_layer + 2 * 152064 * 3584 + 3584 == 7_615_616_512
    # TP 2, PP 1: the matrices and the (untied) embedding and output layer halve; norms are whole on each rank.
    n = rank_params(QWEN25_7B, tp=2, pp=1, stage=0)
    assert n == 28 * ((per_layer - 2 * 3584) // 2 + 2 * 3584) + 152064 * 3584 + 3584
    state = training_state(n, params_bytes=2, distributed_optimizer=False, dp=4)
    assert state.params == 2 * n == pytest.approx(2 * QWEN25_7B.total_params() / 2, rel=1e-3)  # bf16: 2 B/param / TP
    assert (state.grads, state.master, state.optimizer_states) == (4 * n, 4 * n, 8 * n)  # fp32 grads, master, Adam


def test_distributed_optimizer_shards_master_weights_and_adam_over_dp() -> None:
    n = rank_params(QWEN25_7B, tp=2, pp=2, stage=0)
    plain = training_state(n, params_bytes=2, distributed_optimizer=False, dp=2)
    sharded = training_state(n, params_bytes=2, distributed_optimizer=True, dp=2)
    assert sharded.optimizer * 2 == plain.optimizer == 12 * n  # DP 2: half the master weights and moments
    assert (sharded.params, sharded.grads) == (plain.params, plain.grads)  # the fp32 grad buffer stays whole
    assert training_state(n, params_bytes=2, distributed_optimizer=True, dp=1) == plain
    fp32 = training_state(n, params_bytes=4, distributed_optimizer=False, dp=1)
    assert (fp32.params, fp32.grads, fp32.master, fp32.optimizer_states) == (4 * n, 4 * n, 0, 8 * n)


def test_pipeline_stages_hold_the_embedding_and_the_output_layer() -> None:
    first, last = (rank_params(QWEN25_7B, tp=2, pp=2, stage=s) for s in (0, 1))
    assert last - first == 3584  # the final norm; the embedding and the output layer have the same shape
    tied = ModelShape(num_layers=2, hidden=8, ffn=16, heads=2, kv_heads=2, head_dim=4, vocab=10, tied=True)
    assert rank_params(tied, tp=1, pp=1, stage=0) == tied.total_params()  # one copy of the tied weights
    both = rank_params(tied, tp=1, pp=2, stage=0) + rank_params(tied, tp=1, pp=2, stage=1)
    assert both == tied.total_params() + 10 * 8  # across stages the last keeps its own copy


def test_seed_32b_layout_per_die_matches_the_issue() -> None:
    # The upstream DAPO 32B config: TP 8, DP 2 on 16 dies. Issue 23: ~69 GiB without the distributed
    # optimizer, ~46 GiB with it (bf16 weights + fp32 master + Adam + fp32 grads).
    plan, _ = plan_config(_upstream("configs/dapo_qwen25_32b_A3.yaml"), 64 * GIB,
                          ["megatron_training.use_distributed_optimizer=false"])
    assert plan.actor.n_params == rank_params(plan.inputs.model, tp=8, pp=1, stage=0)
    assert plan.actor.state.total / GIB == pytest.approx(68.66, abs=0.01)
    plan, _ = plan_config(_upstream("configs/dapo_qwen25_32b_A3.yaml"), 64 * GIB)
    assert plan.actor.state.total / GIB == pytest.approx(45.77, abs=0.01)
    assert plan.inputs.model.total_params() == pytest.approx(32.76e9, rel=1e-3)


def test_full_recompute_keeps_one_input_per_layer_korthikanti() -> None:
    # Korthikanti et al.: full recompute with sequence parallelism keeps 2 s b h / t bytes per layer (bf16).
    flash = Kernels(flash_attention=True, fused_norm=True, fused_swiglu=True, fused_rope=True)
    mb, ts = MicroBatch(rows=2, seq=4096, response=2048), TrainShape(
        tp=4, sequence_parallel=True, act_bytes=2, kernels=flash, recompute=Recompute("full", "uniform", 1))
    st = stage_activations(QWEN25_7B, mb, ts, pp=2, stage=0)
    assert st.per_layer == 2 * 4096 * 2 * 3584 // 4
    assert st.held == 14 * st.per_layer + 2 * 4096 * 8 + 4096 * 128 * 4  # + token ids, fp32 rotary frequencies
    # Without recompute, Korthikanti's sbh/t (34 + 5as/h) becomes, for flash attention, SwiGLU of width f and
    # no dropout, per token in bytes: two norms (bf16 input, fp32 rstd) and two linear inputs, all / t with SP;
    # Q and K after RoPE, the QKV output V views and the attention output (bf16, heads / t); the fp32
    # log-sum-exp per head; SwiGLU's input and output (3f, bf16, / t).
    plain = stage_activations(QWEN25_7B, mb, dataclasses.replace(ts, recompute=Recompute()), pp=2, stage=0)
    tok, h, f, a, g, d = 2 * 4096, 3584, 18944, 28 // 4, 1, 128
    per_token = ((2 * (2 * h + 4) + 2 * 2 * h) // 4 + ((a + g) + (a + 2 * g) + a) * d * 2 + 4 * a
                 + 3 * f * 2 // 4)
    assert plain.per_layer == tok * per_token


def test_kv_cache_arithmetic() -> None:
    r = rollout_memory(QWEN25_7B, infer_tp=1, weight_bytes=2, kv_bytes=2, device_memory=64 * GIB,
                       gpu_memory_utilization=0.5, max_num_batched_tokens=8192, max_num_seqs=256)
    assert r.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    assert r.budget == 32 * GIB and r.weights == 2 * QWEN25_7B.total_params()
    assert r.kv_cache == r.budget - r.weights - r.activations and r.kv_tokens == r.kv_cache // 57344
    # An engine TP beyond the 4 KV heads replicates them: the per-token KV stops shrinking.
    wide = rollout_memory(QWEN25_7B, infer_tp=8, weight_bytes=2, kv_bytes=2, device_memory=64 * GIB,
                          gpu_memory_utilization=0.5, max_num_batched_tokens=8192, max_num_seqs=256)
    assert wide.kv_bytes_per_token == 2 * 28 * 1 * 128 * 2


# Every upstream config (the four of the seed when ../shared is there).
UPSTREAM_CONFIGS = sorted(f"configs/{p.name}" for p in (UPSTREAM / "configs").glob("*.yaml")) or [
    "configs/grpo_qwen25_7b_A3.yaml"]


@pytest.mark.parametrize("name", UPSTREAM_CONFIGS)
def test_every_upstream_config_is_planned(name: str, repo_root: Path) -> None:
    out = _rlfabric(repo_root, "plan", str(_upstream(name)), "--json")
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["device_memory"] == 64 * GIB
    actor = doc["actor"]
    assert actor["weights"] == 2 * actor["params"] and actor["grads"] == 4 * actor["params"]  # bf16, fp32 grads
    dp = actor["layout"]["dp"]
    assert actor["optimizer"] == pytest.approx(12 * actor["params"] / dp, rel=1e-6)  # distributed optimizer
    assert actor["activations"]["full"] < actor["activations"]["none"]
    assert doc["rollout"]["kv_tokens"] > doc["rollout"]["layout"]["max_model_len"]
    configured = doc["placements"][doc["configured_placement"]]
    assert (out.returncode == 0) == configured["fits"]
    assert configured["peak"] == max(p["total"] for p in configured["phases"])
    text = _rlfabric(repo_root, "plan", str(_upstream(name)))
    assert text.returncode == out.returncode and "integrated (configured)" in text.stdout


# ---- mixture of experts (Qwen3-MoE) ---------------------------------------------------------------------------

QWEN3_30B_A3B = "asked/dapo_qwen3_30b_a3b_A3.yaml"


def _qwen3_30b_a3b_shape() -> ModelShape:
    from services.common.config import load_config

    return model_shape(load_config(_upstream(QWEN3_30B_A3B)))


def test_qwen3_30b_a3b_parameters_by_hand() -> None:
    m = _qwen3_30b_a3b_shape()  # the model block of asked/model/qwen3_30b_a3b.yaml
    assert m.experts == Experts(num_experts=128, ffn=768, topk=8, layers=tuple(range(48)))
    attention = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048  # QKV (32 query + 2 x 4 KV heads of 128), output
    replicated = 2 * 2048 + 2 * 128 + 128 * 2048  # two RMSNorms, q/k norms, the router
    experts = 128 * 3 * 2048 * 768  # gate, up, down of every expert
    assert m.total_params() == 48 * (attention + replicated + experts) + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    active = 48 * (attention + replicated + 8 * 3 * 2048 * 768) + 2 * 151936 * 2048 + 2048
    assert m.total_params(active=True) == active == 3_353_032_704
    # The model card: 30.5B parameters in total, 3.3B activated.
    assert m.total_params() == pytest.approx(30.5e9, rel=2e-3)
    assert m.total_params(active=True) == pytest.approx(3.3e9, rel=2e-2)


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_dir: Path) -> Path:
    return tiny_moe_dir  # the session's tiny Qwen3-MoE (tests/conftest.py)


def test_tiny_moe_count_equals_the_model_transformers_loads(tiny_moe: Path, tmp_path: Path, repo_root: Path) -> None:
    import torch
    import transformers

    from services.common.model_spec import read_hf_config
    from tests.common.test_config_moe import TINY_MOE_BLOCK

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    real = sum(p.numel() for p in hf.parameters())  # the tied embedding once
    assert ModelShape.from_spec(read_hf_config(tiny_moe)[0]).total_params() == real
    # The same model through a config's model block (the tiny Qwen3-MoE block of tests/common/test_config_moe.py).
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_qwen3_moe.yaml").write_text(TINY_MOE_BLOCK)
    config = tmp_path / "grpo_tiny_moe.yaml"
    config.write_text((repo_root / "configs/grpo_tiny_cpu.yaml").read_text().replace("tiny_qwen2", "tiny_qwen3_moe"))
    plan, _ = plan_config(config, 64 * GIB, [f"megatron_training.tokenizer_name_or_path={tiny_moe}",
                                             f"actor_config.load={tiny_moe}"])
    assert plan.inputs.model.total_params() == real
    assert plan.actor.n_params == real and plan.actor.n_expert_params == 2 * 8 * 3 * 128 * 64  # TP 1, EP 1


def test_expert_parallel_2_halves_the_experts_a_rank_holds() -> None:
    m = _qwen3_30b_a3b_shape()
    ep1, ep2 = ExpertLayout(ep=1, etp=1), ExpertLayout(ep=2, etp=1)
    e1, e2 = (rank_expert_params(m, pp=1, stage=0, experts=x) for x in (ep1, ep2))
    assert e1 == 48 * 128 * 3 * 2048 * 768 and e2 * 2 == e1  # 64 of the 128 experts of every MoE layer
    n1, n2 = (rank_params(m, tp=1, pp=1, stage=0, experts=x) for x in (ep1, ep2))
    assert n1 - n2 == e1 - e2 and n1 == m.total_params()  # the rest (attention, router, embeddings) is whole
    # Without the distributed optimizer every expert byte halves; with it (DP 4: expert DP 4 at EP 1, 2 at EP 2)
    # weights and gradients halve, while each rank's share of the expert optimizer state stays: half the experts
    # over half the ranks. The dense parameters are sharded over DP either way.
    assert (ep1.expert_dp(tp=1, dp=4), ep2.expert_dp(tp=1, dp=4)) == (4, 2)
    for dist in (False, True):
        s1, s2 = (training_state(n, params_bytes=2, distributed_optimizer=dist, dp=4, expert_params=e,
                                 expert_dp=x.expert_dp(tp=1, dp=4)) for n, e, x in ((n1, e1, ep1), (n2, e2, ep2)))
        assert (s1.params - s2.params, s1.grads - s2.grads) == (2 * (e1 - e2), 4 * (e1 - e2))
        dense = n1 - e1
        if dist:
            assert s1.optimizer == 12 * dense // 4 + 12 * e1 // 4 and s2.optimizer == 12 * dense // 4 + 12 * e2 // 2
            assert s1.optimizer == s2.optimizer
        else:
            assert s1.optimizer - s2.optimizer == 12 * (e1 - e2)
    # Split over TP instead (Megatron's expert-TP = TP): the same bytes per rank as EP 2.
    assert rank_expert_params(m, pp=1, stage=0, experts=ExpertLayout(ep=1, etp=2)) == e2


def test_moe_layers_route_top_k_copies_through_the_experts() -> None:
    m = _qwen3_30b_a3b_shape()
    dense = dataclasses.replace(m, experts=None)
    flash = Kernels(flash_attention=True, fused_norm=True, fused_swiglu=True, fused_rope=True)
    mb = MicroBatch(rows=1, seq=4096, response=2048)
    tok, h, b = 4096, 2048, 2
    # TP 1: every token's 8 copies through the SwiGLU of width 768 instead of one through the dense ffn, plus
    # the permuted copies (the grouped FC1's input) and the router's logits and fp32 probabilities.
    ts = TrainShape(tp=1, act_bytes=b, kernels=flash)
    moe_layer = stage_activations(m, mb, ts).per_layer
    dense_layer = stage_activations(dense, mb, ts).per_layer
    assert moe_layer - dense_layer == tok * 8 * (3 * 768 * b + h * b) + tok * 128 * (b + 4) - tok * 3 * 8192 * b
    # The upstream layout: TP 4 with sequence parallelism, moe_tp_extend_ep (EP 8, expert-TP 1): a rank holds
    # tok / 4 tokens and its experts get their 8 copies each, whole.
    sp = TrainShape(tp=4, sequence_parallel=True, act_bytes=b, kernels=flash, experts=ExpertLayout(ep=8, etp=1))
    extend = stage_activations(m, mb, sp).per_layer - stage_activations(dense, mb, sp).per_layer
    assert extend == tok // 4 * 8 * (3 * 768 * b + h * b) + tok // 4 * 128 * (b + 4) - tok * 3 * 8192 * b // 4
    # Without it (EP 2 x expert-TP 4): the TP group gathers its tokens, each rank a quarter of each expert.
    split = dataclasses.replace(sp, experts=ExpertLayout(ep=2, etp=4))
    assert stage_activations(m, mb, split).per_layer - stage_activations(dense, mb, split).per_layer == \
        tok * 8 * (3 * 768 * b // 4 + h * b) + tok // 4 * 128 * (b + 4) - tok * 3 * 8192 * b // 4


def test_pipeline_stages_count_their_own_moe_layers() -> None:
    # moe_layer_freq 2: layers 0 and 2 are MoE, 1 and 3 dense; each of two stages holds one of each.
    m = ModelShape(num_layers=4, hidden=16, ffn=64, heads=2, kv_heads=2, head_dim=8, vocab=32, tied=False,
                   experts=Experts(num_experts=4, ffn=8, topk=2, layers=(0, 2)))
    stages = [rank_params(m, tp=1, pp=2, stage=s) for s in (0, 1)]
    assert sum(stages) == m.total_params()
    assert stages[1] - stages[0] == 16  # the final norm: the layers match
    assert rank_expert_params(m, pp=2, stage=0, experts=ExpertLayout(ep=2, etp=1)) == 2 * 3 * 16 * 8


def test_upstream_qwen3_30b_a3b_plan(repo_root: Path) -> None:
    out = _rlfabric(repo_root, "plan", str(_upstream(QWEN3_30B_A3B)), "--json")
    assert "Traceback" not in out.stderr
    doc = json.loads(out.stdout)
    assert doc["model"]["params"] == 30_532_122_624 and doc["model"]["active_params"] == 3_353_032_704
    a = doc["actor"]
    # TP 4 x DP 4 on 16 dies, moe_tp_extend_ep with EP 2: EP 8, expert-TP 1, expert DP 16 / 8 = 2.
    assert a["expert_layout"] == {"ep": 8, "etp": 1} and a["expert_dp"] == 2
    experts = 48 * 16 * 3 * 2048 * 768  # 128 / 8 experts per MoE layer, whole
    dense = 48 * (2048 * 40 * 128 + 32 * 128 * 2048) // 4 + 48 * (4352 + 128 * 2048) + 2 * 151936 * 2048 // 4 + 2048
    assert (a["params"], a["expert_params"]) == (dense + experts, experts)
    assert (a["weights"], a["grads"]) == (2 * a["params"], 4 * a["params"])
    assert a["optimizer"] == 12 * dense // 4 + 12 * experts // 2  # dense state over DP 4, expert state over 2
    # The table of docs/memory.md.
    state = a["weights"] + a["grads"] + a["optimizer"]
    figures = [state, a["activations"]["none"], a["activations"]["full"], a["update_peak"], doc["rollout"]["weights"]]
    assert [round(x / GIB, 1) for x in figures] == [43.8, 6.4, 1.4, 52.0, 56.9]
    # rlfabric's rollout engine holds every expert (infer_expert_parallel_size is inert): at
    # infer_tensor_parallel_size 1 the 30.5B parameters (56.9 GiB) leave no KV cache in 0.6 x 64 GiB.
    assert doc["rollout"]["weights"] == 2 * doc["model"]["params"] and doc["rollout"]["kv_tokens"] == 0
    assert out.returncode == 1 and not doc["placements"]["integrated"]["fits"]
    assert doc["placements"]["integrated"]["advice"]["settings"] == ["generate_config.infer_tensor_parallel_size: 2"]
    assert any("infer_expert_parallel_size (8) is inert" in n for n in doc["notes"])
    fixed = _rlfabric(repo_root, "plan", str(_upstream(QWEN3_30B_A3B)), "-o",
                      "generate_config.infer_tensor_parallel_size=2")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "30.53 B parameters" in fixed.stdout and "3.35 B active per token" in fixed.stdout
    assert "EP 8 x expert-TP 1 (moe_tp_extend_ep) x expert DP 2" in fixed.stdout
    assert "190,332 tokens" in fixed.stdout  # the KV cache at TP 2 (weights 28.4 GiB)


def test_moe_advice_can_double_expert_parallelism() -> None:
    plan, advice = plan_config(_upstream(QWEN3_30B_A3B), 64 * GIB, ["actor_config.expert_model_parallel_size=1",
                                                                    "generate_config.infer_tensor_parallel_size=2"])
    assert plan.inputs.actor.expert_layout == ExpertLayout(ep=4, etp=1) and plan.inputs.actor.expert_dp == 4
    assert round(plan.actor.update_peak / GIB, 1) == 72.2 and not plan.configured.fits
    assert "actor_config.expert_model_parallel_size: 2" in advice["integrated"].settings


def test_what_to_change_when_it_does_not_fit(repo_root: Path) -> None:
    path = str(_upstream("configs/dapo_qwen25_32b_A3.yaml"))
    out = _rlfabric(repo_root, "plan", path, "-o", "megatron_training.use_distributed_optimizer=false")
    assert out.returncode == 1
    assert "does NOT fit" in out.stdout
    assert "to fit integrated, set any one of: megatron_training.use_distributed_optimizer: true" in out.stdout
    # A device too small for anything the keys can do says so.
    small = _rlfabric(repo_root, "plan", path, "--device-memory", "8GiB")
    assert small.returncode == 1 and "does not fit even with" in small.stdout


def test_offload_keys_decide_what_the_actor_keeps_during_rollout() -> None:
    path = _upstream("configs/grpo_qwen25_7b_A3.yaml")
    plan, _ = plan_config(path, 64 * GIB)  # offload_train_param / grad / optimizer: all true upstream
    assert plan.placements["integrated"].phases[0].actor == 0
    kept, advice = plan_config(path, 64 * GIB, ["generate_config.offload_train_optimizer=false",
                                                 "generate_config.gpu_memory_utilization=0.95"])
    rollout = kept.placements["integrated"].phases[0]
    assert rollout.name == "rollout" and rollout.actor == kept.actor.state.optimizer
    assert rollout.rollout == int(0.95 * 64 * GIB) and not kept.placements["integrated"].fits
    assert "generate_config.offload_train_optimizer: true" in advice["integrated"].settings
    assert advice["disaggregated"] is None  # devices of its own: nothing to offload


def test_sizes_parse() -> None:
    assert parse_size("64GiB") == parse_size("64G") == 64 << 30
    assert parse_size("80GB") == 80 * 10 ** 9 and parse_size("1.5TiB") == int(1.5 * (1 << 40))
    for bad in ("", "GiB", "64 parsecs", "-3G"):
        with pytest.raises(ValueError, match="device memory"):
            parse_size(bad)

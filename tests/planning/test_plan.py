"""`rlfabric plan`: the memory arithmetic by hand, every upstream config planned, refusals and advice.

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

from services.planning.arithmetic import (
    GIB,
    Kernels,
    MicroBatch,
    ModelShape,
    Recompute,
    TrainShape,
    parse_size,
    rank_params,
    rollout_memory,
    stage_activations,
    training_state,
)
from services.planning.plan import plan_config

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


def test_moe_config_is_refused_cleanly(repo_root: Path) -> None:
    out = _rlfabric(repo_root, "plan", str(_upstream("asked/dapo_qwen3_30b_a3b_A3.yaml")))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "num_experts" in out.stderr and "MoE" in out.stderr and "rlfabric config check" in out.stderr
    doc = json.loads(_rlfabric(repo_root, "plan", str(_upstream("asked/dapo_qwen3_30b_a3b_A3.yaml")), "--json").stdout)
    assert doc["ok"] is False and "num_experts" in doc["errors"][0]["message"]


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

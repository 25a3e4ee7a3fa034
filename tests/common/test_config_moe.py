"""Mixture-of-experts configs (issue 24): MindSpeed-RL's Qwen3-MoE config loads unchanged and means what it means
upstream, its expert layout is checked as Megatron and MindSpeed check it, the model block is compared with a
Qwen3-MoE config.json (DeepSeek-V3's keys: test_config_deepseek.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, check_model_files, load_config
from services.common.config.catalog import key_report
from services.common.config.hf_check import megatron_moe_layers

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "reference" / "mindspeed_rl"
QWEN3_MOE = UPSTREAM / "asked" / "dapo_qwen3_30b_a3b_A3.yaml"
BLOCK = "model.qwen3_30b_a3b"

# The tiny MoE model block rlfabric ships (what `rlfabric tiny-model --family qwen3_moe` writes).
TINY_MOE_BLOCK = (REPO / "configs" / "model" / "tiny_qwen3_moe.yaml").read_text()


def _errors(path: Path, *overrides: str) -> dict[str, str]:
    """Key -> its messages (one per line) of the config's errors."""
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides=list(overrides))
    out: dict[str, str] = {}
    for issue in exc.value.issues:
        out[issue.key] = "\n".join(filter(None, (out.get(issue.key), issue.message)))
    return out


@pytest.fixture(scope="module")
def tiny_moe(tiny_moe_dir: Path) -> Path:
    return tiny_moe_dir  # the session's tiny Qwen3-MoE (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny_moe_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/grpo_tiny_cpu.yaml on the tiny Qwen3-MoE block (paths are overridden per test)."""
    root = tmp_path_factory.mktemp("moe_config")
    (root / "model").mkdir()
    (root / "model" / "tiny_qwen3_moe.yaml").write_text(TINY_MOE_BLOCK)
    text = (REPO / "configs" / "grpo_tiny_cpu.yaml").read_text().replace("tiny_qwen2", "tiny_qwen3_moe")
    path = root / "grpo_tiny_moe.yaml"
    path.write_text(text)
    return path


def _hf_copy(tmp_path: Path, model: Path, **changes) -> Path:
    """A folder holding the model's config.json with `changes` applied (None removes a key)."""
    raw = json.loads((model / "config.json").read_text())
    raw.update(changes)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return out


def _tiny(config: Path, model: Path, *overrides: str):
    return load_config(config, overrides=[f"megatron_training.tokenizer_name_or_path={model}",
                                          f"actor_config.load={model}", *overrides])


# --- the upstream Qwen3-30B-A3B config --------------------------------------------------------------------------


def test_upstream_qwen3_moe_config_loads_and_means_upstream():
    cfg = load_config(QWEN3_MOE)
    a, d, g = cfg.actor_config, cfg.derived, cfg.generate_config
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.norm_topk_prob) == (128, 8, 768, True)
    assert (a.moe_router_load_balancing_type, a.moe_aux_loss_coeff, a.moe_token_dispatcher_type) == (
        "aux_loss", 0.001, "alltoall_seq")
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size) == (4, 1, 2)
    assert a.moe_tp_extend_ep and a.moe_grouped_gemm and a.moe_permutation_async_comm and a.moe_alltoall_overlap_comm
    # Where each value came from: the model block, megatron_training, actor_config.
    assert cfg.where("num_experts") == f"{BLOCK}.num_experts"
    assert cfg.where("moe_alltoall_overlap_comm") == "megatron_training.moe_alltoall_overlap_comm"
    assert cfg.where("expert_model_parallel_size") == "actor_config.expert_model_parallel_size"
    # 16 devices / TP 4 = DP 4; moe_tp_extend_ep: EP 2 x TP 4 = 8 ranks share the experts whole, 16 each.
    assert (d.actor_world_size, d.actor_data_parallel_size) == (16, 4)
    assert (d.actor_expert_parallel_size, d.actor_expert_tensor_parallel_size, d.actor_experts_per_rank) == (8, 1, 16)
    assert (g.enable_expert_parallel, g.infer_expert_parallel_size, g.infer_tensor_parallel_size) == (True, 8, 1)
    assert d.algorithm == "dapo" and d.rollout_data_parallel_size == 16
    assert cfg.rlfabric.routing_replay == "none"


def test_without_moe_tp_extend_ep_experts_are_split_over_tp():
    d = load_config(QWEN3_MOE, overrides=["actor_config.moe_tp_extend_ep=false"]).derived
    assert (d.actor_expert_parallel_size, d.actor_expert_tensor_parallel_size, d.actor_experts_per_rank) == (2, 4, 64)


def test_config_check_of_the_upstream_moe_config_passes_and_states_the_expert_layout():
    out = subprocess.run([sys.executable, "-m", "services.cli", "config", "check", str(QWEN3_MOE)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("OK: actor DP = 4 (16 devices / TP 4 x PP 1 x CP 1), experts: EP 2 x TP 4 (moe_tp_extend_ep), "
            "16 of 128 per rank, top-8, rollout DP = 16") in out.stdout
    assert "Traceback" not in out.stderr


def test_moe_kernel_and_overlap_switches_are_reported_inert():
    report = key_report(load_config(QWEN3_MOE), platform="cpu/cuda")
    inert = {key for keys in report.inert.values() for key in keys}
    assert {f"{BLOCK}.moe_grouped_gemm", f"{BLOCK}.moe_permutation_async_comm",
            "megatron_training.moe_alltoall_overlap_comm", "generate_config.infer_expert_parallel_size"} <= inert
    # vLLM's expert-parallel switch acts on every platform: it is not listed as vllm-ascend's.
    assert "generate_config.enable_expert_parallel" not in report.inactive_here
    assert f"{BLOCK}.num_experts" not in inert and "actor_config.moe_tp_extend_ep" not in inert


# --- expert layout and MoE values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "needle"), [
    # DP 4 (16 devices / TP 4): EP 8 leaves half an expert copy.
    (["actor_config.expert_model_parallel_size=8"], "must divide the data-parallel x context-parallel size (4)"),
    # moe_tp_extend_ep: 128 experts over TP 4 x EP 3 = 12 ranks.
    (["actor_config.expert_model_parallel_size=3"], "must be divisible by tensor_model_parallel_size x "
                                                    "expert_model_parallel_size (4 x 3 = 12)"),
    # Megatron's layout: EP must divide the experts.
    (["actor_config.moe_tp_extend_ep=false", f"{BLOCK}.num_experts=126", "actor_config.expert_model_parallel_size=4"],
     "(4) must divide num_experts (126)"),
])
def test_an_expert_layout_that_does_not_divide_is_refused_naming_expert_model_parallel_size(overrides, needle):
    errors = _errors(QWEN3_MOE, *overrides)
    assert "actor_config.expert_model_parallel_size" in errors, errors
    assert needle in errors["actor_config.expert_model_parallel_size"]


def test_expert_parallelism_of_a_dense_model_is_refused():
    errors = _errors(UPSTREAM / "configs" / "grpo_qwen25_7b_A3.yaml", "actor_config.expert_model_parallel_size=2")
    assert list(errors) == ["actor_config.expert_model_parallel_size"]
    assert "the model has no experts" in errors["actor_config.expert_model_parallel_size"]


def test_moe_tp_extend_ep_needs_grouped_gemm_and_async_permutation_as_mindspeed_does():
    errors = _errors(QWEN3_MOE, f"{BLOCK}.moe_grouped_gemm=false")
    message = errors["actor_config.moe_tp_extend_ep"]
    assert "needs moe_grouped_gemm set to true" in message


@pytest.mark.parametrize(("override", "key", "needle"), [
    (f"{BLOCK}.moe_router_topk=0", f"{BLOCK}.moe_router_topk", "between 1 and num_experts (128)"),
    (f"{BLOCK}.moe_router_topk=129", f"{BLOCK}.moe_router_topk", "between 1 and num_experts (128)"),
    (f"{BLOCK}.moe_aux_loss_coeff=-0.1", f"{BLOCK}.moe_aux_loss_coeff", "must be >= 0"),
    (f"{BLOCK}.moe_router_load_balancing_type=sinkhorn", f"{BLOCK}.moe_router_load_balancing_type", "Sinkhorn"),
    (f"{BLOCK}.moe_token_dispatcher_type=flex", f"{BLOCK}.moe_token_dispatcher_type", "allgather, alltoall"),
])
def test_moe_values_are_checked(override: str, key: str, needle: str):
    errors = _errors(QWEN3_MOE, override)
    assert key in errors and needle in errors[key], errors


# --- routing replay ----------------------------------------------------------------------------------------------


def test_routing_replay_is_an_enumeration_and_rollout_fits_the_upstream_moe_config():
    # the other rules (dense model, prefix cache, recompute under PP): tests/trainer/test_routing_replay_inputs.py
    assert load_config(QWEN3_MOE, overrides=["rlfabric.routing_replay=rollout"]).rlfabric.routing_replay == "rollout"
    errors = _errors(QWEN3_MOE, "rlfabric.routing_replay=always")
    assert "must be one of 'none', 'rollout', got 'always'" in errors["rlfabric.routing_replay"]
    assert load_config(QWEN3_MOE, overrides=["rlfabric.routing_replay=none"]).rlfabric.routing_replay == "none"


# --- the model block against a Qwen3-MoE config.json -------------------------------------------------------------


def test_the_tiny_moe_block_matches_the_tiny_moe_model(tiny_moe_config: Path, tiny_moe: Path):
    cfg = _tiny(tiny_moe_config, tiny_moe)
    assert check_model_files(cfg) == [tiny_moe]
    # Every layer is a MoE layer: the dense ffn_hidden_size sizes nothing and is not compared.
    check_model_files(_tiny(tiny_moe_config, tiny_moe, "model.tiny_qwen3_moe.ffn_hidden_size=999"))


@pytest.mark.parametrize(("override", "key", "needle"), [
    ("model.tiny_qwen3_moe.num_experts=16", "num_experts", "num_experts: 8"),
    ("model.tiny_qwen3_moe.moe_router_topk=4", "moe_router_topk", "num_experts_per_tok: 2"),
    ("model.tiny_qwen3_moe.moe_ffn_hidden_size=128", "moe_ffn_hidden_size", "moe_intermediate_size: 64"),
    ("model.tiny_qwen3_moe.moe_ffn_hidden_size=null", "moe_ffn_hidden_size", "unset, so ffn_hidden_size 512"),
    ("model.tiny_qwen3_moe.norm_topk_prob=false", "norm_topk_prob", "norm_topk_prob: True"),
    ("model.tiny_qwen3_moe.moe_layer_freq=2", "moe_layer_freq", "MoE layers [0] of 2"),
    ("model.tiny_qwen3_moe.num_experts=null", "num_experts", "unset (a dense model)"),
])
def test_a_block_contradicting_the_moe_config_json_is_refused_naming_the_key(
        tiny_moe_config: Path, tiny_moe: Path, override: str, key: str, needle: str):
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_moe_config, tiny_moe, override))
    issues = {i.key: i.message for i in exc.value.issues}
    assert list(issues) == [f"model.tiny_qwen3_moe.{key}"], issues
    assert needle in issues[f"model.tiny_qwen3_moe.{key}"]
    assert str(tiny_moe / "config.json") in issues[f"model.tiny_qwen3_moe.{key}"]


def test_dense_layers_of_the_config_json_must_be_written_in_moe_layer_freq(
        tiny_moe_config: Path, tiny_moe: Path, tmp_path: Path):
    model = _hf_copy(tmp_path, tiny_moe, mlp_only_layers=[0])  # layer 0 dense, layer 1 MoE
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_moe_config, model))
    issues = {i.key: i.message for i in exc.value.issues}
    # The dense layer makes ffn_hidden_size count again; it matches (512). The block does not write
    # moe_layer_freq (Megatron's default: every layer), so the message points where to set it.
    assert list(issues) == ["megatron_training.moe_layer_freq"]
    assert "is every layer a MoE layer but" in issues["megatron_training.moe_layer_freq"]
    assert "MoE layers [1] of 2" in issues["megatron_training.moe_layer_freq"]
    for freq in ("[0,1]", "'[0]*1+[1]*1'"):
        check_model_files(_tiny(tiny_moe_config, model, f"model.tiny_qwen3_moe.moe_layer_freq={freq}"))


def test_a_moe_block_against_a_dense_config_json_is_refused(tiny_moe_config: Path, tiny_moe: Path, tmp_path: Path):
    model = _hf_copy(tmp_path, tiny_moe, model_type="qwen3", num_local_experts=None, num_experts_per_tok=None)
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_moe_config, model))
    issues = {i.key: i.message for i in exc.value.issues}
    assert list(issues) == ["model.tiny_qwen3_moe.num_experts"]
    assert "has model_type: qwen3 (a dense model, no experts)" in issues["model.tiny_qwen3_moe.num_experts"]


def test_megatron_moe_layer_frequency():
    assert megatron_moe_layers(None, 4) == [1, 1, 1, 1]
    assert megatron_moe_layers(2, 4) == [1, 0, 1, 0]  # Megatron: layers 0, N, 2N, ...
    assert megatron_moe_layers("[0]*1+[1]*3", 4) == [0, 1, 1, 1]
    assert megatron_moe_layers([0, 1], 2) == [0, 1]
    assert megatron_moe_layers("__import__('os')", 2) is None  # never evaluated

"""DeepSeek-V3 configs (issue 24): MindSpeed-RL's DeepSeek-V3 model keys load and mean what they mean upstream; the
tiny DeepSeek-V3 block (configs/model/tiny_deepseek_v3.yaml) matches the model `rlfabric tiny-model --family
deepseek_v3` writes; a block contradicting the config.json is refused naming the key; what is not implemented
(MindSpeed-LLM's `seq_aux`, a config.json with multi-token prediction layers) stays refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.common.config import ConfigError, check_model_files, load_config
from services.common.config.moe import moe_layer_pattern

REPO = Path(__file__).resolve().parents[2]
QWEN3_MOE = REPO.parent / "shared" / "reference" / "mindspeed_rl" / "asked" / "dapo_qwen3_30b_a3b_A3.yaml"
BLOCK = "model.qwen3_30b_a3b"
TINY = "model.tiny_deepseek_v3"

# MindSpeed-RL's configs/model/deepseekv3_671b.yaml: its DeepSeek-V3 keys and values (the sizes other than the
# experts', which the Qwen3-30B-A3B block keeps: 128 experts, TP 4, divide as upstream's 256 experts, TP 4 do).
UPSTREAM_DEEPSEEK = dict(
    multi_latent_attention="true", qk_pos_emb_head_dim="64", qk_head_dim="128", q_lora_rank="1536",
    kv_lora_rank="512", v_head_dim="128", qk_layernorm="true", first_k_dense_replace="3", moe_layer_freq="1",
    n_shared_experts="1", moe_router_load_balancing_type="seq_aux_loss", moe_router_num_groups="8",
    moe_router_group_topk="4", moe_router_topk_scaling_factor="2.5", seq_aux="false", norm_topk_prob="true",
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias="true", rope_scaling_type="yarn",
    beta_fast="32", beta_slow="1", rope_scaling_factor="40", rope_scaling_mscale="1.0",
    rope_scaling_mscale_all_dim="1.0", rope_scaling_original_max_position_embeddings="4096")


def _errors(path: Path, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides=list(overrides))
    out: dict[str, str] = {}
    for issue in exc.value.issues:
        out[issue.key] = "\n".join(filter(None, (out.get(issue.key), issue.message)))
    return out


def test_upstream_deepseek_v3_keys_load_and_mean_upstream():
    cfg = load_config(QWEN3_MOE, overrides=[f"{BLOCK}.{k}={v}" for k, v in UPSTREAM_DEEPSEEK.items()])
    a = cfg.actor_config
    assert a.multi_latent_attention and (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim,
                                         a.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (a.moe_router_score_function, a.moe_router_enable_expert_bias, a.n_shared_experts) == ("sigmoid", True, 1)
    assert (a.moe_router_num_groups, a.moe_router_group_topk, a.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert moe_layer_pattern(a, 6) == [0, 0, 0, 1, 1, 1]  # first_k_dense_replace before moe_layer_freq


def test_seq_aux_stays_refused_by_name():
    errors = _errors(QWEN3_MOE, f"{BLOCK}.seq_aux=true")
    assert list(errors) == [f"{BLOCK}.seq_aux"]
    assert "seq_aux_loss" in errors[f"{BLOCK}.seq_aux"]


@pytest.mark.parametrize(("overrides", "key", "needle"), [
    ((f"{BLOCK}.moe_router_group_topk=4",), "moe_router_group_topk", "needs moe_router_num_groups"),
    ((f"{BLOCK}.moe_router_group_topk=4", f"{BLOCK}.moe_router_num_groups=3"), "moe_router_num_groups",
     "must divide num_experts (128)"),
    ((f"{BLOCK}.moe_router_enable_expert_bias=true",), "moe_router_enable_expert_bias", "needs "
     "moe_router_score_function: sigmoid"),
    ((f"{BLOCK}.moe_router_score_function=tanh",), "moe_router_score_function", "supported: softmax, sigmoid"),
    ((f"{BLOCK}.multi_latent_attention=true", f"{BLOCK}.q_lora_rank=1534"), "q_lora_rank", "must divide q_lora_rank"),
])
def test_deepseek_values_are_checked_as_megatron_does(overrides: tuple[str, ...], key: str, needle: str):
    errors = _errors(QWEN3_MOE, *overrides)
    assert f"{BLOCK}.{key}" in errors and needle in errors[f"{BLOCK}.{key}"], errors


# --- the tiny DeepSeek-V3 block against the tiny DeepSeek-V3 config.json -----------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/grpo_tiny_cpu.yaml on the tiny DeepSeek-V3 block (model paths given per test)."""
    root = tmp_path_factory.mktemp("deepseek_config")
    (root / "model").mkdir()
    shutil.copy(REPO / "configs" / "model" / "tiny_deepseek_v3.yaml", root / "model")
    path = root / "grpo_tiny_deepseek.yaml"
    path.write_text((REPO / "configs" / "grpo_tiny_cpu.yaml").read_text().replace("tiny_qwen2", "tiny_deepseek_v3"))
    return path


def _tiny(config: Path, model: Path, *overrides: str):
    return load_config(config, overrides=[f"megatron_training.tokenizer_name_or_path={model}",
                                          f"actor_config.load={model}", *overrides])


def _hf_copy(tmp_path: Path, model: Path, **changes) -> Path:
    raw = json.loads((model / "config.json").read_text())
    raw.update(changes)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return out


def test_the_tiny_block_matches_the_tiny_model(tiny_config: Path, tiny_deepseek_dir: Path):
    assert check_model_files(_tiny(tiny_config, tiny_deepseek_dir)) == [tiny_deepseek_dir]


@pytest.mark.parametrize(("override", "key", "needle"), [
    ("multi_latent_attention=false", "multi_latent_attention", "deepseek_v3 (multi-latent attention)"),
    ("q_lora_rank=null", "q_lora_rank", "q_lora_rank: 64"),
    ("kv_lora_rank=16", "kv_lora_rank", "kv_lora_rank: 512"),
    ("qk_head_dim=32", "qk_head_dim", "qk_nope_head_dim: 16"),
    ("qk_pos_emb_head_dim=8", "qk_pos_emb_head_dim", "qk_rope_head_dim: 64"),
    ("v_head_dim=16", "v_head_dim", "v_head_dim: 32"),
    ("n_shared_experts=null", "n_shared_experts", "n_shared_experts: 1"),
    ("moe_router_score_function=softmax&moe_router_enable_expert_bias=false", "moe_router_score_function",
     "router score: sigmoid"),
    ("moe_router_enable_expert_bias=false", "moe_router_enable_expert_bias", "e_score_correction_bias"),
    ("moe_router_topk_scaling_factor=null", "moe_router_topk_scaling_factor", "routed_scaling_factor: 2.5"),
    ("moe_router_group_topk=null", "moe_router_group_topk", "unset (no group-limited routing)"),
    ("moe_router_num_groups=4", "moe_router_num_groups", "n_group: 2"),
    ("first_k_dense_replace=0", "moe_layer_freq", "MoE layers [1] of 2"),
])
def test_a_block_contradicting_the_config_json_is_refused_naming_the_key(
        tiny_config: Path, tiny_deepseek_dir: Path, override: str, key: str, needle: str):
    with pytest.raises(ConfigError) as exc:  # `&` joins overrides (a softmax router has no expert bias)
        check_model_files(_tiny(tiny_config, tiny_deepseek_dir, *(f"{TINY}.{o}" for o in override.split("&"))))
    issues = {i.key: i.message for i in exc.value.issues}
    assert list(issues)[0] == f"{TINY}.{key}" and len(issues) == override.count("&") + 1, issues
    assert needle in issues[f"{TINY}.{key}"]


def test_yarn_keys_are_compared_with_the_rope_scaling(tiny_config: Path, tiny_deepseek_dir: Path):
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_config, tiny_deepseek_dir, f"{TINY}.rope_scaling_mscale_all_dim=0.0",
                                f"{TINY}.rope_scaling_factor=40", f"{TINY}.beta_fast=16"))
    issues = {i.key: i.message for i in exc.value.issues}
    assert set(issues) == {f"{TINY}.{k}" for k in ("rope_scaling_mscale_all_dim", "rope_scaling_factor", "beta_fast")}
    assert "rope_scaling.factor: 4.0" in issues[f"{TINY}.rope_scaling_factor"]
    with pytest.raises(ConfigError) as exc:  # another rope scaling written: rope_scaling_type names the difference
        check_model_files(_tiny(tiny_config, tiny_deepseek_dir, f"{TINY}.rope_scaling_type=llama3"))
    assert "rope_scaling.rope_type: yarn" in str(exc.value)


def test_a_config_json_with_multi_token_prediction_is_refused_naming_it(
        tiny_config: Path, tiny_deepseek_dir: Path, tmp_path: Path):
    model = _hf_copy(tmp_path, tiny_deepseek_dir, num_nextn_predict_layers=1)
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_config, model))
    assert "num_nextn_predict_layers=1 is not supported for model_type deepseek_v3" in str(exc.value)


def test_another_deepseek_generation_is_named(tiny_config: Path, tiny_deepseek_dir: Path, tmp_path: Path):
    model = _hf_copy(tmp_path, tiny_deepseek_dir, model_type="deepseek_v2")
    with pytest.raises(ConfigError) as exc:
        check_model_files(_tiny(tiny_config, model))
    assert "model_type deepseek_v2 is a DeepSeek model of another generation" in str(exc.value)

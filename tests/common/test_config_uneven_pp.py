"""Uneven pipeline stages in configs (issue 24): MindSpeed-RL's DeepSeek-V3 671B configs (`num_layer_list`) and its
Qwen3-235B config (`noop_layers`) load unchanged and place their layers as upstream does
(services/common/pipeline_layout.py); a layout that cannot be built is refused naming the key; recompute bounds
count the no-op layers, as upstream; the memory plan takes each stage's own layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common import pipeline_layout
from services.common.config import ConfigError, load_config

UPSTREAM = Path(__file__).resolve().parent / "upstream_configs"  # byte copies (README.md there)
DEEPSEEK = ("grpo_deepseek_r1_671b_A3.yaml", "grpo_deepseek_r1_671b_A3_eplb.yaml", "grpo_deepseek_r1_671b_A2.yaml")
QWEN3_235B = "grpo_qwen3_235b_a22b_A2.yaml"
DEEPSEEK_STAGES = (7, 7, 8, 8, 8, 8, 8, 7)
QWEN3_235B_STAGES = (5, *[6] * 14, 5)  # 96 slots over 16 stages, the no-ops 5 and 95 on the first and last


def _stages(mt) -> tuple[int, ...]:
    return pipeline_layout.stage_layers(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list,
                                        mt.noop_layers)


def _errors(name: str, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        load_config(UPSTREAM / name, overrides=list(overrides))
    return {issue.key: issue.message for issue in exc.value.issues}


@pytest.mark.parametrize("name", [*DEEPSEEK, QWEN3_235B])
def test_upstream_moe_configs_load_unchanged_with_upstream_stages(name: str):
    cfg = load_config(UPSTREAM / name)
    a = cfg.actor_config
    assert _stages(a) == (DEEPSEEK_STAGES if name in DEEPSEEK else QWEN3_235B_STAGES)
    assert cfg.ref_config.pipeline_model_parallel_size == a.pipeline_model_parallel_size


def test_noop_layers_leave_the_model_its_own_layers():
    cfg = load_config(UPSTREAM / QWEN3_235B)
    a = cfg.actor_config
    assert a.num_layers == 96  # actor_config counts the two no-ops (the model block says 94)
    slots = pipeline_layout.model_layer_slots(a.num_layers, a.noop_layers)
    assert len(slots) == sum(_stages(a)) == 94
    assert slots[:6] == (0, 1, 2, 3, 4, 6) and slots[-1] == 94  # HF layer 5 sits in slot 6, HF layer 93 in 94
    assert pipeline_layout.stage_slots(a.num_layers, 16) == (6,) * 16
    # upstream's recompute_num_layers 6 (block) fills a stage's 6 slots, no-ops counted
    assert (a.recompute_method, a.recompute_num_layers) == ("block", 6)


def test_config_check_accepts_them(repo_root: Path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "config", "check", str(UPSTREAM / QWEN3_235B)],
                         cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert "noop_layers" not in out.stderr and "pipeline_model_parallel_size" not in out.stderr, out.stderr
    assert "OK: actor DP = 4 (128 devices / TP 2 x PP 16 x CP 1)" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(("name", "override", "key", "needle"), [
    (DEEPSEEK[0], "actor_config.num_layer_list=7,7,8,8,8,8,8,8", "actor_config.num_layer_list", "sums to 62 layers"),
    (DEEPSEEK[0], "actor_config.num_layer_list=8,8,9,9,9,9,9", "actor_config.num_layer_list", "has 7 entries"),
    (DEEPSEEK[0], "actor_config.num_layer_list=0,8,8,8,8,8,8,13", "actor_config.num_layer_list", "at least one layer"),
    (DEEPSEEK[0], "actor_config.num_layer_list=7,7,x,8,8,8,8,7", "actor_config.num_layer_list", "list integers"),
    (DEEPSEEK[0], "actor_config.num_layer_list=null", "actor_config.pipeline_model_parallel_size",
     "num_layers (61) must be divisible by pipeline_model_parallel_size (8)"),
    (QWEN3_235B, "actor_config.noop_layers=5,96", "actor_config.noop_layers", "index 96 is not a layer"),
    (QWEN3_235B, "actor_config.noop_layers=0,1,2,3,4,5", "actor_config.noop_layers", "fill pipeline stage 0"),
    (QWEN3_235B, "actor_config.noop_layers=-1,95", "actor_config.noop_layers", "index -1 is not a layer"),
])
def test_layouts_that_cannot_be_built_are_refused_naming_the_key(name, override, key, needle):
    errors = _errors(name, override)
    assert key in errors, errors
    assert needle in errors[key]


@pytest.mark.parametrize(("name", "overrides", "needle"), [
    (QWEN3_235B, ("actor_config.recompute_num_layers=7",), "between 1 and the layers of one pipeline stage (6)"),
    (DEEPSEEK[0], ("actor_config.recompute_num_layers=9",), "between 1 and the layers of the largest pipeline stage (8)"),
    (QWEN3_235B, ("actor_config.recompute_method=uniform", "actor_config.recompute_num_layers=4"),
     "must divide the layers of every pipeline stage (6)"),
    (DEEPSEEK[0], ("actor_config.recompute_method=uniform", "actor_config.recompute_num_layers=4"),
     "must divide the layers of every pipeline stage (7, 7, 8, 8, 8, 8, 8, 7)"),
])
def test_recompute_bounds_count_each_stage_as_upstream(name, overrides, needle):
    errors = _errors(name, *overrides)
    assert needle in errors["actor_config.recompute_num_layers"]


def test_uniform_units_of_slots_pass_though_a_stage_has_fewer_layers():
    # 6 slots a stage: units of 3 divide them upstream, whatever the 5 real layers of stages 0 and 15.
    cfg = load_config(UPSTREAM / QWEN3_235B, overrides=["actor_config.recompute_method=uniform",
                                                        "actor_config.recompute_num_layers=3"])
    assert cfg.actor_config.recompute_num_layers == 3


def test_the_memory_plan_takes_each_stage_its_own_layers():
    from services.planning.arithmetic import GIB
    from services.planning.plan import inputs_from_config, model_shape

    cfg = load_config(UPSTREAM / QWEN3_235B)
    shape = model_shape(cfg)
    assert shape.num_layers == 94 and shape.experts is not None and len(shape.experts.layers) == 94
    inputs = inputs_from_config(cfg, 64 * GIB)
    assert inputs.actor.stages == QWEN3_235B_STAGES and "num_layer_list" not in " ".join(inputs.notes)
    from services.planning.plan import evaluate

    plan = evaluate(inputs)
    params = [s.n_params for s in plan.actor_stages]
    # The middle stages hold 6 layers; the first 5 and the embedding, the last 5, the final norm and the output layer.
    layer, vocab_shard = params[1] // 6, -(-shape.vocab // 2) * shape.hidden  # TP 2
    assert params[1:15] == [6 * layer] * 14
    assert (params[0], params[15]) == (5 * layer + vocab_shard, 5 * layer + shape.hidden + vocab_shard)


def test_layer_lists_are_read_as_megatron_spells_them():
    assert pipeline_layout.layer_numbers("7, 7,8", "num_layer_list") == (7, 7, 8)
    assert pipeline_layout.layer_numbers([1, 3], "num_layer_list") == (1, 3)
    assert pipeline_layout.layer_numbers(5, "noop_layers") == (5,)
    assert pipeline_layout.stage_layers(6, 2, noop_layers="4,5,5") == (3, 1)  # a set, as MindSpeed makes it
    assert pipeline_layout.stage_layers(8, 2, num_layer_list="3,5", noop_layers="0,7") == (2, 4)
    assert pipeline_layout.stage_layers_of_model(94, 16, noop_layers="5,95") == QWEN3_235B_STAGES
    assert pipeline_layout.stage_of_layer((1, 3), 3) == (1, 2)
    with pytest.raises(pipeline_layout.StageLayoutError) as exc:
        pipeline_layout.stage_layers(61, 8)
    assert exc.value.key == "pipeline_model_parallel_size" and "e.g. \"7,7,7,8,8,8,8,8\"" in str(exc.value)


# Qwen3-235B-A22B's config.json as published (the values the check reads): 94 layers, every one a MoE layer.
QWEN3_235B_HF = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False,
                     decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=4096, intermediate_size=12288,
                     max_position_embeddings=40960, mlp_only_layers=[], moe_intermediate_size=1536,
                     norm_topk_prob=True, num_attention_heads=64, num_experts=128, num_experts_per_tok=8,
                     num_hidden_layers=94, num_key_value_heads=4, rms_norm_eps=1e-06, rope_scaling=None,
                     rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=151936)


def _check_235b(tmp_path: Path, *overrides: str, **hf_changes) -> dict[str, str]:
    """The hf_check issues of the upstream 235B config against a folder holding its config.json (with changes)."""
    import json

    from services.common.config import check_model_files

    model = tmp_path / "Qwen3-235B-A22B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({**QWEN3_235B_HF, **hf_changes}))
    cfg = load_config(UPSTREAM / QWEN3_235B, overrides=[f"megatron_training.tokenizer_name_or_path={model}",
                                                        *overrides])
    try:
        assert check_model_files(cfg) == [model]
    except ConfigError as exc:
        return {issue.key: issue.message for issue in exc.issues}
    return {}


def test_the_235b_block_matches_its_94_layer_config_json(tmp_path: Path):
    # num_layers 96 counts the no-ops 5 and 95; config.json's 94 does not.
    assert _check_235b(tmp_path) == {}


def test_a_config_json_of_other_layers_is_named_with_the_noops(tmp_path: Path):
    issues = _check_235b(tmp_path, num_hidden_layers=96)
    assert list(issues) == ["actor_config.num_layers"]
    assert "is 96 with noop_layers '5,95', so 94 layers but" in issues["actor_config.num_layers"]
    assert "num_hidden_layers: 96" in issues["actor_config.num_layers"]


def test_moe_layers_are_compared_at_the_real_layers(tmp_path: Path):
    # moe_layer_freq lists num_layers' 96 slots; the no-op slots 5 and 95 drop out, the 94 MoE layers remain.
    slots = "'[1]*5+[0]+[1]*89+[0]'"  # quoted: a string Megatron evaluates
    assert _check_235b(tmp_path / "a", f"actor_config.moe_layer_freq={slots}") == {}
    issues = _check_235b(tmp_path / "b", mlp_only_layers=[5])  # HF layer 5 (slot 6) dense: the YAML says MoE
    assert list(issues) == ["megatron_training.moe_layer_freq"], issues  # unset: every layer MoE
    assert "MoE layers [0, 1, 2, 3, 4, 6," in issues["megatron_training.moe_layer_freq"]


def test_the_conversion_hint_carries_the_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from services.common.config.input_paths import missing_input_paths

    monkeypatch.chdir(tmp_path)  # ./ckpt and the model folders are not here
    hints = {name: {i.key: i.message for i in missing_input_paths(load_config(UPSTREAM / name))}["actor_config.load"]
             for name in (QWEN3_235B, DEEPSEEK[0])}
    assert "`rlfabric convert hf2mcore --tp 2 --pp 16 --ep 4 --noop-layers 5,95 ./Qwen3-235B-A22B ./ckpt`" \
        in hints[QWEN3_235B], hints
    assert "--num-layer-list 7,7,8,8,8,8,8,7 " in hints[DEEPSEEK[0]] and "--noop-layers" not in hints[DEEPSEEK[0]]


def test_the_plan_counts_deepseeks_dense_first_layers():
    from services.planning.plan import model_shape

    shape = model_shape(load_config(UPSTREAM / DEEPSEEK[0]))
    assert shape.num_layers == 61 and shape.experts is not None
    assert shape.experts.layers == tuple(range(3, 61))  # first_k_dense_replace 3: layers 0-2 are dense

"""DeepSeek-V3 checkpoint conversion (issue 24): HF -> mcore -> HF is bitwise exact at TP x PP x EP layouts of the
tiny DeepSeek-V3 (multi-latent attention, first layer dense, 8 routed + 1 shared experts, expert bias); the MLA
projections, shared experts and expert bias sit where Megatron's local spec keeps them; the CLI writes Megatron's
EP rank folders; the weight-sync plan rebuilds every HF tensor from EP-sharded trainer shards; and the config.json
values rlfabric would compute differently from transformers are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common import tensor_recipes, weight_layout
from services.common.model_spec import read_hf_config, spec_from_hf_config
from services.coordinator.resharding import TrainerShard, plan_resharding
from services.trainer import ckpt_layout
from services.trainer.convert import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    hf_to_mcore,
    load_hf_state,
    mcore_to_hf,
)

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2), (1, 1, 8)]  # (tp, pp, ep)
ATTN = "decoder.layers.{}.self_attention."


@pytest.fixture(scope="module")
def ds(tiny_deepseek_dir: Path):
    spec, raw = read_hf_config(tiny_deepseek_dir)
    assert spec.mla is not None and spec.moe is not None and spec.moe.moe_layers == (1,)
    return spec, raw, load_hf_state(tiny_deepseek_dir)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    different = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not different, different[:5]


@pytest.mark.parametrize(("tp", "pp", "ep"), LAYOUTS, ids=[f"tp{t}pp{p}ep{e}" for t, p, e in LAYOUTS])
def test_in_memory_round_trip_is_bitwise(ds, tp: int, pp: int, ep: int) -> None:
    spec, _, hf = ds
    shards = hf_to_mcore(hf, spec, tp, pp, ep=ep)
    assert sorted(shards) == [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]
    assert_bitwise_equal(mcore_to_hf(shards, spec, tp, pp, ep=ep), hf)


def test_mla_shared_experts_and_bias_layout(ds) -> None:
    spec, _, hf = ds
    tp, ep = 2, 2
    shards = hf_to_mcore(hf, spec, tp, 1, ep=ep)
    m, heads = spec.mla, spec.num_attention_heads
    for t in range(tp):
        for e in range(ep):
            sd, a = shards[(t, 0, e)], ATTN.format(1)
            src = "model.layers.1.self_attn."
            rows = slice(t * m.q_lora_rank // tp, (t + 1) * m.q_lora_rank // tp)  # ColumnParallelLinear: by rows
            assert torch.equal(sd[a + "linear_q_down_proj.weight"], hf[src + "q_a_proj.weight"][rows])
            kv = (m.kv_lora_rank + m.qk_rope_head_dim) // tp
            assert torch.equal(sd[a + "linear_kv_down_proj.weight"], hf[src + "kv_a_proj_with_mqa.weight"][t * kv:(t + 1) * kv])
            per_head = m.qk_nope_head_dim + m.v_head_dim  # kv_b rows are per head: a TP rank holds whole heads
            span = slice(t * heads // tp * per_head, (t + 1) * heads // tp * per_head)
            assert torch.equal(sd[a + "linear_kv_up_proj.weight"], hf[src + "kv_b_proj.weight"][span])
            assert torch.equal(sd[a + "kv_layernorm.weight"], hf[src + "kv_a_layernorm.weight"])
            assert torch.equal(sd[a + "q_layernorm.weight"], hf[src + "q_a_layernorm.weight"])
            cols = slice(t * heads // tp * m.v_head_dim, (t + 1) * heads // tp * m.v_head_dim)
            assert torch.equal(sd[a + "linear_proj.weight"], hf[src + "o_proj.weight"][:, cols])
            # Shared experts: a dense MLP of their own size, [gate_t; up_t], the same on every EP rank.
            inner = spec.moe.shared_expert_intermediate_size // tp
            mlp, hmlp = "decoder.layers.1.mlp.", "model.layers.1.mlp."
            want = torch.cat([hf[hmlp + "shared_experts.gate_proj.weight"][t * inner:(t + 1) * inner],
                              hf[hmlp + "shared_experts.up_proj.weight"][t * inner:(t + 1) * inner]])
            assert torch.equal(sd[mlp + "shared_experts.linear_fc1.weight"], want)
            assert torch.equal(sd[mlp + "router.expert_bias"], hf[hmlp + "gate.e_score_correction_bias"])
            # Layer 0 is dense: its MLP is the dense one, no router.
            assert "decoder.layers.0.mlp.linear_fc1.weight" in sd and "decoder.layers.0.mlp.router.weight" not in sd
            local = sorted(n for n in sd if ".local_experts." in n and n.endswith("linear_fc2.weight"))
            assert len(local) == 8 // ep
            x = e * 8 // ep  # EP rank e's first global expert
            assert torch.equal(sd["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"],
                               hf[f"{hmlp}experts.{x}.down_proj.weight"][:, t * 32:(t + 1) * 32])
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def _config(**over) -> dict:
    base = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8, n_routed_experts=4,
                n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                norm_topk_prob=True, routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=6, qk_nope_head_dim=4,
                qk_rope_head_dim=2, v_head_dim=4, num_nextn_predict_layers=0)
    return {**base, **over}


def test_without_a_query_latent_the_query_projection_is_one_matrix() -> None:
    spec = spec_from_hf_config(_config())
    assert spec.mla.q_lora_rank is None and spec.moe.shared_expert_intermediate_size == 16
    g = torch.Generator().manual_seed(0)
    hf = {r.hf_name: torch.randn(r.hf_shape, generator=g) for r in weight_layout.recipes(spec, 1, 1)}
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "model.layers.0.self_attn.q_a_proj.weight" not in hf
    shards = hf_to_mcore(hf, spec, 2, 1, ep=2)
    assert shards[(1, 0, 1)][ATTN.format(0) + "linear_q_proj.weight"].shape == (6, 16)  # 1 head x (4 + 2) rows
    assert_bitwise_equal(mcore_to_hf(shards, spec, 2, 1, ep=2), hf)


@pytest.mark.parametrize(("over", "message"), [
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1 is not supported .*multi-token prediction"),
    (dict(rope_interleave=False), "rope_interleave=False .*interleaved pairs"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False .*renormalises"),
    (dict(n_group=2, topk_group=2), r"topk_group=2 .*must be 2 x topk_group"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (dict(n_shared_experts=0), "n_shared_experts=0"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type='linear'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale_all_dim": 1.0}),
     r"rope_scaling.mscale=None .*set both"),
], ids=lambda v: str(v)[:40])
def test_what_transformers_computes_otherwise_is_refused_by_name(over: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(_config(**over), source="config.json")


def test_yarn_is_read_with_transformers_defaults() -> None:
    spec = spec_from_hf_config(_config(rope_theta=10000, rope_scaling={
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}))
    y = spec.yarn
    assert (y.factor, y.original_max_position_embeddings, y.mscale, y.mscale_all_dim) == (40.0, 4096, 1.0, 1.0)
    # Without mscale_all_dim transformers ignores mscale (YaRN's default factor): Megatron's (1, 0) gives the same.
    y = spec_from_hf_config(_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                     "mscale": 0.7, "original_max_position_embeddings": 8})).yarn
    assert (y.mscale, y.mscale_all_dim) == (1.0, 0.0)


def test_tensor_parallel_sizes_that_do_not_split_the_latents_are_refused(ds) -> None:
    spec, _, hf = ds
    with pytest.raises(ValueError, match="tensor parallel size 2 must divide kv_lora_rank \\+ qk_rope_head_dim=7"):
        weight_layout.recipes(spec_from_hf_config(_config(kv_lora_rank=5)), 2, 1)
    with pytest.raises(ValueError, match="expert parallel size 3 must divide num_experts=8"):
        hf_to_mcore(hf, spec, 1, 1, ep=3)


def test_cli_round_trip_tp2_ep2_is_bitwise(ds, tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    from services.cli import main

    _, _, hf = ds
    ckpt = tmp_path / "DeepSeek-tiny-tp2-pp1-ep2"
    assert main(["convert", "hf2mcore", "--quiet", "--tp", "2", "--ep", "2", str(tiny_deepseek_dir), str(ckpt)]) == 0
    release = ckpt / "release"
    assert sorted(p.name for p in release.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                        "mp_rank_01_001"]
    assert main(["convert", "mcore2hf", "--quiet", str(ckpt), str(tmp_path / "hf")]) == 0
    assert_bitwise_equal(load_hf_state(tmp_path / "hf"), hf)


def test_folder_round_trip_pp2_ep2(ds, tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    _, _, hf = ds
    root = convert_hf_to_mcore(tiny_deepseek_dir, tmp_path / "m", tp=1, pp=2, ep=2)
    assert ckpt_layout.detect_tp_pp_ep(root / "release") == (1, 2, 2)
    assert_bitwise_equal(load_hf_state(convert_mcore_to_hf(root, tmp_path / "hf")), hf)


def test_plan_assembles_every_hf_tensor_from_ep_shards(ds) -> None:
    spec, raw, hf = ds
    tp, pp, ep = 2, 2, 2
    shards = hf_to_mcore(hf, spec, tp, pp, ep=ep)
    stages = weight_layout.stage_layer_counts(spec, pp)
    reported = [TrainerShard(weight_layout.global_layer_name(name, p, stages), tuple(x.shape), t, p, e)
                for (t, p, e), sd in shards.items() for name, x in sd.items()]
    plan = plan_resharding(reported, {k: tuple(v.shape) for k, v in hf.items()}, raw)
    got = {r.hf_name: t for r, t in tensor_recipes.to_hf(plan.tensors, lambda s: shards[s.key][s.name])}
    assert_bitwise_equal(got, hf)

"""Qwen3-MoE checkpoint conversion with expert parallelism (issue 24): HF -> mcore -> HF is bitwise exact at
every TP x PP x EP layout of the tiny MoE, experts land on the EP rank and local number Megatron gives them,
the rank folders carry Megatron's names (mp_rank_TT[_PPP]_EEE), and the weight-sync plan rebuilds every HF
tensor, experts included, from EP-sharded trainer shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfabric.v1 import trainer_pb2
from services.common import tensor_recipes, weight_layout
from services.common.model_spec import read_hf_config, spec_from_hf_config
from services.coordinator.resharding import ReshardError, ReshardPlan, TrainerShard, plan_resharding
from services.trainer import ckpt_layout
from services.trainer.convert import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    hf_to_mcore,
    load_hf_state,
    mcore_to_hf,
)

EXPERTS = 8  # the tiny MoE's routed experts (top-2), 2 layers, 4 heads / 2 KV heads, expert inner size 64
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 8)]  # (tp, pp, ep)


@pytest.fixture(scope="module")
def moe(tiny_moe_dir: Path):
    spec, raw = read_hf_config(tiny_moe_dir)
    assert spec.moe is not None and spec.moe.num_experts == EXPERTS
    return spec, raw, load_hf_state(tiny_moe_dir)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    different = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not different, different[:5]


@pytest.mark.parametrize(("tp", "pp", "ep"), LAYOUTS, ids=[f"tp{t}pp{p}ep{e}" for t, p, e in LAYOUTS])
def test_in_memory_round_trip_is_bitwise(moe, tp: int, pp: int, ep: int) -> None:
    spec, _, hf = moe
    shards = hf_to_mcore(hf, spec, tp, pp, ep=ep)
    assert sorted(shards) == [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]
    # Each rank holds its E/ep experts per layer of its stage, numbered from 0, and no one else's.
    fc1 = {k: sorted(n for n in sd if n.endswith("linear_fc1.weight") and ".experts." in n) for k, sd in shards.items()}
    per_stage = spec.num_hidden_layers // pp
    for names in fc1.values():
        assert names == sorted(f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.linear_fc1.weight"
                               for layer in range(per_stage) for i in range(EXPERTS // ep))
    assert_bitwise_equal(mcore_to_hf(shards, spec, tp, pp, ep=ep), hf)


def test_dense_layers_of_a_moe_model_keep_the_dense_mlp() -> None:
    # Qwen3-MoE's mlp_only_layers: layer 0 is a dense MLP (intermediate_size), layer 1 a MoE block.
    spec = spec_from_hf_config(dict(
        model_type="qwen3_moe", vocab_size=66, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, intermediate_size=24, moe_intermediate_size=8, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[0], tie_word_embeddings=False))
    g = torch.Generator().manual_seed(0)
    hf = {r.hf_name: torch.randn(r.hf_shape, generator=g) for r in weight_layout.recipes(spec, 1, 1)}
    assert "model.layers.0.mlp.gate_proj.weight" in hf and "model.layers.0.mlp.gate.weight" not in hf
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in hf and "model.layers.1.mlp.up_proj.weight" not in hf
    shards = hf_to_mcore(hf, spec, 2, 1, ep=2)
    assert shards[(1, 0, 1)]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (24, 16)  # [gate_1; up_1] of 24
    assert shards[(1, 0, 1)]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"].shape == (16, 4)
    assert_bitwise_equal(mcore_to_hf(shards, spec, 2, 1, ep=2), hf)


def test_experts_sit_on_megatrons_ep_rank_and_local_number(moe) -> None:
    spec, _, hf = moe
    tp, ep, inner = 2, 2, spec.moe.moe_intermediate_size
    shards = hf_to_mcore(hf, spec, tp, 1, ep=ep)
    half = inner // tp
    for e in range(ep):
        for t in range(tp):
            sd = shards[(t, 0, e)]
            for i in range(EXPERTS // ep):
                x = e * EXPERTS // ep + i  # EP rank e holds global experts [e * E/ep, (e + 1) * E/ep)
                hf_x = f"model.layers.1.mlp.experts.{x}."
                mc_i = f"decoder.layers.1.mlp.experts.local_experts.{i}."
                rows = slice(t * half, (t + 1) * half)
                want_fc1 = torch.cat([hf[hf_x + "gate_proj.weight"][rows], hf[hf_x + "up_proj.weight"][rows]])
                assert torch.equal(sd[mc_i + "linear_fc1.weight"], want_fc1)  # [gate_t; up_t], as dense fc1
                assert torch.equal(sd[mc_i + "linear_fc2.weight"], hf[hf_x + "down_proj.weight"][:, rows])
            # The router and every non-expert tensor are whole (router) or TP-sharded alike on every EP rank.
            assert torch.equal(sd["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
            assert sd.keys() - {n for n in sd if ".experts." in n} == (
                shards[(t, 0, 0)].keys() - {n for n in shards[(t, 0, 0)] if ".experts." in n})
            qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
            assert torch.equal(sd[qkv], shards[(t, 0, 0)][qkv])


def test_one_rank_shard_equals_the_full_split(moe) -> None:
    spec, _, hf = moe
    full = hf_to_mcore(hf, spec, 2, 2, ep=2)
    one = hf_to_mcore(hf, spec, 2, 2, only=(1, 1, 1), ep=2)
    assert list(one) == [(1, 1, 1)] and one[(1, 1, 1)].keys() == full[(1, 1, 1)].keys()
    assert all(torch.equal(one[(1, 1, 1)][k], full[(1, 1, 1)][k]) for k in one[(1, 1, 1)])


def test_expert_parallel_sizes_that_do_not_fit_are_refused(moe) -> None:
    spec, _, hf = moe
    with pytest.raises(ValueError, match="expert parallel size 3 must divide num_experts=8"):
        hf_to_mcore(hf, spec, 1, 1, ep=3)
    dense = spec_from_hf_config(dict(model_type="qwen2", vocab_size=64, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; model_type qwen2 has no experts"):
        weight_layout.recipes(dense, 1, 1, 2)


def test_megatron_folder_names() -> None:
    # megatron/training/checkpointing.py get_checkpoint_name: the expert rank is appended when EP > 1.
    assert ckpt_layout.rank_dirname(1, 0, pp=1) == "mp_rank_01"
    assert ckpt_layout.rank_dirname(1, 0, pp=1, ep_rank=1, ep=2) == "mp_rank_01_001"
    assert ckpt_layout.rank_dirname(1, 2, pp=4, ep_rank=3, ep=4) == "mp_rank_01_002_003"
    assert ckpt_layout.rank_dirname(0, 1, pp=2, ep_rank=0, ep=1) == "mp_rank_00_001"


def test_cli_round_trip_tp2_ep2_is_bitwise(moe, tiny_moe_dir: Path, tmp_path: Path) -> None:
    from services.cli import main

    _, _, hf = moe
    ckpt = tmp_path / "Qwen3-tiny-tp2-pp1-ep2"
    assert main(["convert", "hf2mcore", "--quiet", "--tp", "2", "--ep", "2", str(tiny_moe_dir), str(ckpt)]) == 0
    release = ckpt / "release"
    assert sorted(p.name for p in release.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                        "mp_rank_01_001"]
    assert ckpt_layout.detect_tp_pp_ep(release) == (2, 1, 2)
    payload = torch.load(release / "mp_rank_01_001" / ckpt_layout.FILENAME, weights_only=False)
    assert payload["rlfabric"]["expert_model_parallel_size"] == 2
    assert main(["convert", "mcore2hf", "--quiet", str(ckpt), str(tmp_path / "hf")]) == 0
    assert_bitwise_equal(load_hf_state(tmp_path / "hf"), hf)


@pytest.mark.parametrize(("pp", "ep", "names"), [
    (2, 2, ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]),
    (2, 1, ["mp_rank_00_000", "mp_rank_00_001"]),  # the same names as EP 2 at PP 1: the files tell them apart
], ids=["pp2ep2", "pp2ep1"])
def test_folder_round_trip_with_pipeline(moe, tiny_moe_dir: Path, tmp_path: Path, pp: int, ep: int,
                                         names: list[str]) -> None:
    _, _, hf = moe
    root = convert_hf_to_mcore(tiny_moe_dir, tmp_path / "m", tp=1, pp=pp, ep=ep)
    assert sorted(p.name for p in (root / "release").iterdir()) == names
    assert ckpt_layout.detect_tp_pp_ep(root / "release") == (1, pp, ep)
    assert_bitwise_equal(load_hf_state(convert_mcore_to_hf(root, tmp_path / "hf")), hf)


def test_cli_refuses_an_ep_that_does_not_divide_the_experts(tiny_moe_dir: Path, tmp_path: Path, capsys) -> None:
    from services.cli import main

    assert main(["convert", "hf2mcore", "--expert-model-parallel-size", "3", str(tiny_moe_dir),
                 str(tmp_path / "x")]) != 0
    assert "expert parallel size 3 must divide num_experts=8" in capsys.readouterr().err
    assert not (tmp_path / "x" / "release").exists()


# ---- the weight-sync plan over EP-sharded trainer shards -------------------------------------------------


def trainer_shards(shards: dict, spec, pp: int) -> list[TrainerShard]:
    """What Trainer.Info reports for these rank state dicts: model-wide layer numbers, experts numbered locally."""
    stages = weight_layout.stage_layer_counts(spec, pp)
    return [TrainerShard(weight_layout.global_layer_name(name, p, stages), tuple(x.shape), t, p, e)
            for (t, p, e), sd in shards.items() for name, x in sd.items()]


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 2), (2, 2, 2)], ids=["tp2ep2", "tp2pp2ep2"])
def test_plan_assembles_every_hf_tensor_from_ep_shards(moe, tp: int, pp: int, ep: int) -> None:
    spec, raw, hf = moe
    shards = hf_to_mcore(hf, spec, tp, pp, ep=ep)
    rollout = {k: tuple(v.shape) for k, v in hf.items()}  # what Rollout.Info lists: the HF checkpoint's tensors
    plan = plan_resharding(trainer_shards(shards, spec, pp), rollout, raw)
    assert (plan.trainer_tp, plan.trainer_pp, plan.trainer_ep) == (tp, pp, ep)
    decoded = ReshardPlan.from_proto(trainer_pb2.ReshardPlan.FromString(plan.to_proto().SerializeToString()))
    assert decoded == plan
    got = {r.hf_name: t for r, t in tensor_recipes.to_hf(decoded.tensors, lambda s: shards[s.key][s.name])}
    assert_bitwise_equal(got, hf)
    by_name = {r.hf_name: r for r in decoded.tensors}
    # Expert 5 lives on EP rank 1 as local expert 1; everything else is read from EP rank 0.
    gate5 = by_name["model.layers.0.mlp.experts.5.gate_proj.weight"]
    assert [(s.name, s.tp_rank, s.ep_rank) for s in gate5.sources] == [
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", t, 1) for t in range(tp)]
    assert {s.ep_rank for r in decoded.tensors if ".experts." not in r.hf_name for s in r.sources} == {0}
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in decoded.shards_of(0, 0, 1)


def test_plan_needs_every_ep_ranks_experts(moe) -> None:
    spec, raw, hf = moe
    reported = [s for s in trainer_shards(hf_to_mcore(hf, spec, 1, 1, ep=2), spec, 1)
                if not (s.ep_rank == 1 and s.name == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")]
    with pytest.raises(ReshardError, match=r"local_experts\.3\.linear_fc2\.weight' of tp_rank 0, pp_rank 0, "
                                           r"ep_rank 1 .* was not reported"):
        plan_resharding(reported, {k: tuple(v.shape) for k, v in hf.items()}, raw)


def test_plan_message_with_an_ep_rank_outside_the_layout_is_refused(moe) -> None:
    spec, raw, hf = moe
    shards = trainer_shards(hf_to_mcore(hf, spec, 1, 1, ep=2), spec, 1)
    msg = plan_resharding(shards, {k: tuple(v.shape) for k, v in hf.items()}, raw).to_proto()
    msg.tensors[0].sources[0].ep_rank = 2
    with pytest.raises(ReshardError, match="ep_rank 2 is outside TP=1 PP=1 EP=2"):
        ReshardPlan.from_proto(msg)

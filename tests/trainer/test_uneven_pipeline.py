"""Uneven pipeline stages in the trainer, conversion and weight sync (issue 24: MindSpeed's num_layer_list and
noop_layers, reduced to the model's layers per stage by services/common/pipeline_layout.py).

Two gloo ranks at PP 2 (tests/trainer/uneven_pipeline_checks.py) build a 4-layer dense model with 1 + 3 layers
(num_layer_list "1,3") and 3 + 1 (num_layers 6, noop_layers "4,5", with full uniform recompute in units of 3 slots),
and a 3-layer DeepSeek-V3 (dense first layer) with 1 + 2: log-probs equal transformers', one update equals a
plain-torch step, the checkpoint converts back to those weights, and the weight-sync names cover every layer once.
Conversion round trips are bitwise at uneven layouts, and a checkpoint of another layout is refused.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from hf_reference import hf_log_probs, plain_torch_update
from rank_checks import make_experience, make_rows
from trainer_helpers import run_ranks
from uneven_pipeline_checks import KL_COEF, LR, TEMPERATURE

from services.common import pipeline_layout, weight_layout
from services.common.model_spec import read_hf_config, spec_from_hf_config
from services.trainer.convert import hf_to_mcore, load_hf_state, mcore_to_hf

LIST_STAGES = pipeline_layout.stage_layers(4, 2, num_layer_list="1,3")
NOOP_STAGES = pipeline_layout.stage_layers(6, 2, noop_layers="4,5")  # 3 slots a stage, the last two no-ops
NOOP_UNIT = 3  # uniform recompute over the 3 slots of a stage: past the second stage's one layer
MOE_STAGES = (1, 2)


def _tag(stages) -> str:
    return "_".join(map(str, stages))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("uneven") / "dense", num_layers=4)


@pytest.fixture(scope="module")
def deepseek_three(tmp_path_factory) -> Path:
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("uneven") / "deepseek", family="deepseek_v3", num_layers=3)


@pytest.fixture(scope="module")
def uneven(four_layers: Path, deepseek_three: Path, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("uneven_work")
    run_ranks("uneven_pipeline_checks.py", 2, [
        "--hf", str(four_layers), "--work", str(work), "--stages", "1,3", "--uniform", "0", "--stages", "3,1",
        "--uniform", str(NOOP_UNIT), "--moe-hf", str(deepseek_three), "--moe-stages", ",".join(map(str, MOE_STAGES))])
    return work


@pytest.fixture(scope="module")
def hf_model(four_layers: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(four_layers, dtype=torch.float32).eval()


def test_the_keys_give_uneven_stages():
    assert (LIST_STAGES, NOOP_STAGES) == ((1, 3), (3, 1))


@pytest.mark.parametrize("stages", [LIST_STAGES, NOOP_STAGES], ids=_tag)
def test_log_probs_equal_transformers(uneven: Path, hf_model, stages) -> None:
    got = torch.load(uneven / f"results_{_tag(stages)}.pt", weights_only=False)["log_probs"]
    rows = make_rows(hf_model.config.vocab_size, 1)
    assert (got - hf_log_probs(hf_model, rows, TEMPERATURE)).abs().max().item() < 1e-5


def test_moe_log_probs_equal_transformers(uneven: Path, deepseek_three: Path) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(deepseek_three, dtype=torch.float32).eval()
    assert model.config.first_k_dense_replace == 1  # stage 0 holds the dense layer, stage 1 the two MoE layers
    got = torch.load(uneven / f"moe_{_tag(MOE_STAGES)}.pt", weights_only=False)
    assert (got - hf_log_probs(model, make_rows(model.config.vocab_size, 1), TEMPERATURE)).abs().max().item() < 1e-5


@pytest.mark.parametrize("stages", [LIST_STAGES, NOOP_STAGES], ids=_tag)
def test_one_update_equals_plain_torch_and_the_checkpoint_holds_it(uneven: Path, four_layers: Path, stages,
                                                                   tmp_path: Path) -> None:
    import transformers

    from services.trainer.convert import convert_mcore_to_hf

    got = torch.load(uneven / f"results_{_tag(stages)}.pt", weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(four_layers, dtype=torch.float32)
    rows = make_rows(model.config.vocab_size, 1)
    norm = plain_torch_update(model.train(), rows, make_experience(rows, got["log_probs"], seed=7),
                              temperature=TEMPERATURE, kl_coef=KL_COEF, lr=LR)
    assert got["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # mcore2hf reads the stages' layers from the checkpoint's own files.
    trained = load_hf_state(convert_mcore_to_hf(uneven / f"ckpt_{_tag(stages)}", tmp_path / "hf",
                                                hf_assets=four_layers))
    expected = model.state_dict()
    diffs = {name: (t - expected[name]).abs().max().item() for name, t in trained.items()}
    assert max(diffs.values()) < 2e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]  # as test_tp_pp_short
    initial = load_hf_state(four_layers)
    assert max((trained[n] - initial[n]).abs().max().item() for n in diffs) > 1e-4  # the step moved them


@pytest.mark.parametrize("stages", [LIST_STAGES, NOOP_STAGES], ids=_tag)
def test_weight_sync_names_cover_every_layer_once(uneven: Path, four_layers: Path, stages) -> None:
    from services.coordinator.resharding import TrainerShard, plan_resharding

    reported = torch.load(uneven / f"results_{_tag(stages)}.pt", weights_only=False)["shards"]
    spec, raw = read_hf_config(four_layers)
    layer_names = {p: [n for n, _ in shards if n.startswith("decoder.layers.")] for p, shards in reported.items()}
    everyone = [n for names in layer_names.values() for n in names]
    one_stage = weight_layout.shard_shapes(spec, 1, 1)[(0, 0, 0)]
    assert sorted(everyone) == sorted(n for n in one_stage if n.startswith("decoder.layers."))  # each exactly once
    assert {int(n.split(".")[2]) for n in layer_names[1]} == set(pipeline_layout.stage_range(stages, 1))
    # The coordinator's plan reads the layout from these names and rebuilds every HF tensor from them.
    shards = [TrainerShard(n, shape, 0, p) for p, names in reported.items() for n, shape in names]
    hf = load_hf_state(four_layers)
    plan = plan_resharding(shards, {k: tuple(v.shape) for k, v in hf.items()}, raw)
    last = f"model.layers.{spec.num_hidden_layers - 1}.mlp.down_proj.weight"
    source = next(t for t in plan.tensors if t.hf_name == last).sources[0]
    assert (source.pp_rank, source.name) == (1, f"decoder.layers.{stages[1] - 1}.mlp.linear_fc2.weight")


FAMILIES = {
    "qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, intermediate_size=96, tie_word_embeddings=True),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=64, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8,
                        n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
                        first_k_dense_replace=2, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=6,
                        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, num_nextn_predict_layers=0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_in_memory_round_trip_at_uneven_stages_is_bitwise(family: str) -> None:
    spec = spec_from_hf_config(FAMILIES[family])
    g = torch.Generator().manual_seed(0)
    hf = {r.hf_name: torch.randn(r.hf_shape, generator=g) for r in weight_layout.recipes(spec, 1, 1)}
    stages, ep = (1, 3, 1), 2 if spec.moe else 1
    shards = hf_to_mcore(hf, spec, 2, 3, ep=ep, stages=stages)
    # Stage 1 holds layers 1..3 as its 0..2; with experts, stage 0's one layer stays dense (first_k_dense_replace).
    assert weight_layout.stage_layers_of_names([shards[(0, p, 0)] for p in range(3)]) == stages
    assert torch.equal(shards[(1, 1, 0)]["decoder.layers.2.input_layernorm.weight"],
                       hf["model.layers.3.input_layernorm.weight"])
    if spec.moe:
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shards[(0, 0, 0)]
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shards[(0, 1, 0)]  # layer 1: dense too
        assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight" in shards[(0, 1, 1)]
    back = mcore_to_hf(shards, spec, 2, 3, ep=ep)  # the stages read from the state dicts
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(ValueError, match=r"pipeline stage layers \[2, 2, 2\] do not place 5 layers on 3 stages"):
        hf_to_mcore(hf, spec, 1, 3, stages=(2, 2, 2))


def test_cli_round_trip_with_noop_layers_is_bitwise(four_layers: Path, tmp_path: Path, capsys) -> None:
    from services.cli import main

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    # 4 model layers + 2 no-ops = num_layers 6, 3 slots a stage: 3 + 1 layers.
    assert main(["convert", "hf2mcore", "--pp", "2", "--noop-layers", "4,5", str(four_layers), str(mcore)]) == 0
    assert "[3, 1] per pipeline stage" in capsys.readouterr().err
    last = torch.load(mcore / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert last["rlfabric"]["stage_layers"] == [3, 1]
    assert {k.split(".")[2] for k in last["model"] if k.startswith("decoder.layers.")} == {"0"}
    assert main(["convert", "mcore2hf", "--num-layer-list", "2,2", str(mcore), str(back)]) == 2
    assert "holds [3, 1] layers per pipeline stage" in capsys.readouterr().err
    assert main(["convert", "mcore2hf", "--quiet", str(mcore), str(back)]) == 0
    original, restored = load_hf_state(four_layers), load_hf_state(back)
    assert original.keys() == restored.keys() and all(torch.equal(restored[k], original[k]) for k in original)
    assert main(["convert", "hf2mcore", "--pp", "2", "--noop-layers", "4,9", str(four_layers), str(tmp_path / "x")]) == 2
    assert "--noop-layers: noop_layers '4,9': index 9 is not a layer of num_layers 6" in capsys.readouterr().err
    assert main(["convert", "hf2mcore", "--pp", "3", str(four_layers), str(tmp_path / "x")]) == 2
    assert "--pp: num_layers (4) must be divisible by pipeline_model_parallel_size (3)" in capsys.readouterr().err


def test_a_checkpoint_of_other_stages_is_refused(four_layers: Path) -> None:
    from services.trainer.checkpoint import _check_stage_layers
    from services.trainer.model import transformer_config

    spec, _ = read_hf_config(four_layers)
    model = types.SimpleNamespace(config=transformer_config(spec, tp=1, pp=2, stages=(1, 3)))
    _check_stage_layers(model, {"rlfabric": {"stage_layers": [1, 3]}}, Path("ck"))
    with pytest.raises(ValueError, match=r"its pipeline stages hold \[3, 1\] layers, this trainer's \[1, 3\]"):
        _check_stage_layers(model, {"rlfabric": {"stage_layers": [3, 1]}}, Path("ck"))
    with pytest.raises(ValueError, match="an even split"):
        _check_stage_layers(model, {"rlfabric": {}}, Path("ck"))  # written before stages were recorded
    even = types.SimpleNamespace(config=transformer_config(spec, tp=1, pp=2))
    _check_stage_layers(even, {}, Path("ck"))


UPSTREAM = Path(__file__).resolve().parents[1] / "common" / "upstream_configs"


@pytest.mark.parametrize(("name", "stages"), [
    ("grpo_deepseek_r1_671b_A3.yaml", (7, 7, 8, 8, 8, 8, 8, 7)),  # num_layer_list
    ("grpo_qwen3_235b_a22b_A2.yaml", (5, *[6] * 14, 5)),  # noop_layers "5,95" of num_layers 96
])
def test_the_trainer_options_carry_the_configs_stages(name: str, stages) -> None:
    from services.common.config import load_config
    from services.trainer.options import worker_options_from_config

    cfg = load_config(UPSTREAM / name)
    assert [worker_options_from_config(cfg, role)[0].stage_layers for role in ("actor", "reference")] == [stages] * 2


def test_without_the_keys_the_trainer_splits_evenly_at_any_pp(repo_root: Path) -> None:
    from services.common.config import load_config
    from services.trainer.options import worker_options_from_config

    # None, not the config's (2,): `trainer serve --pp` may run another pipeline size.
    assert worker_options_from_config(load_config(repo_root / "configs/grpo_tiny_cpu.yaml"))[0].stage_layers is None


def test_a_trainer_started_from_a_yaml_config_builds_its_stages(start_trainer, repo_root: Path, four_layers: Path,
                                                                hf_model) -> None:
    """`trainer serve --config` with num_layer_list "1,3" at PP 2: stage 0 holds layer 0, stage 1 layers 1-3, and
    the HF weights loaded into them give transformers' log-probs."""
    import grpc
    import numpy as np

    from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
    from services.common.sequences import Sequences
    from services.common.tensors import to_numpy

    overrides = ["model.tiny_qwen2.num_layers=4", "actor_config.pipeline_model_parallel_size=2",
                 "actor_config.num_layer_list=1,3", "rl_config.actor_resource.num_npus=2",
                 f"megatron_training.tokenizer_name_or_path={four_layers}", f"actor_config.load={four_layers}"]
    group, address = start_trainer("--config", str(repo_root / "configs/grpo_tiny_cpu.yaml"),
                                   *[x for o in overrides for x in ("--override", o)])
    try:
        with grpc.insecure_channel(address) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            info = stub.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60)
            layers = {p: {int(s.name.split(".")[2]) for s in info.shards
                          if s.pp_rank == p and s.name.startswith("decoder.layers.")} for p in (0, 1)}
            assert (info.pipeline_parallel_size, layers) == (2, {0: {0}, 1: {1, 2, 3}})
            rows = make_rows(hf_model.config.vocab_size, 1)
            cuts = [(rows.token_ids[rows.seq_offsets[i]:rows.seq_offsets[i + 1]].numpy(), int(rows.prompt_lengths[i]))
                    for i in range(len(rows))]
            seqs = Sequences.from_lists([f"r{i}" for i in range(len(rows))], [seq[:p] for seq, p in cuts],
                                        [seq[p:] for seq, p in cuts], 0)
            reply = next(stub.ComputeLogProbs(iter([trainer_pb2.LogProbRequest(batch=seqs.to_proto(),
                                                                               temperature=TEMPERATURE)]), timeout=120))
        expected = hf_log_probs(hf_model, rows, TEMPERATURE).numpy()
        assert np.abs(to_numpy(reply.log_probs) - expected).max() < 1e-5
    finally:
        group.stop(grace_s=12)  # its two ranks' memory, before the next test

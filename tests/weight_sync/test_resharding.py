"""The resharding plan: plans for every TP x PP layout rebuild exactly what `mcore_to_hf` builds."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.v1 import common_pb2, trainer_pb2
from services.common import tensor_recipes, weight_layout
from services.common.model_spec import read_hf_config, spec_from_hf_config
from services.coordinator.resharding import ReshardError, ReshardPlan, TrainerShard, plan_resharding
from services.trainer.convert import hf_to_mcore, load_hf_state, mcore_to_hf

FAMILIES = {
    # Qwen2-like: QKV bias, tied embeddings, a vocabulary TP 4 must pad.
    "qwen2": dict(model_type="qwen2", vocab_size=1001, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=48, tie_word_embeddings=True),
    # Qwen3-like: q/k norms, head_dim != hidden / heads, no bias, untied, padded vocabulary.
    "qwen3": dict(model_type="qwen3", vocab_size=510, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=12, intermediate_size=40, tie_word_embeddings=False),
    # Llama-like: GQA without bias, untied.
    "llama": dict(model_type="llama", vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=64, tie_word_embeddings=False),
}
LAYOUTS = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


def random_hf_state(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values in the HF shapes of `spec` (taken from the shared layout)."""
    g = torch.Generator().manual_seed(seed)
    return {r.hf_name: torch.randn(r.hf_shape, generator=g) for r in weight_layout.recipes(spec, 1, 1)}


def trainer_shards(shards: dict, spec, pp: int) -> list[TrainerShard]:
    """What Trainer.Info reports for these rank state dicts (model-wide layer numbers)."""
    per = spec.num_hidden_layers // pp
    out = []
    for (t, p, e), sd in shards.items():
        for name, x in sd.items():
            parts = name.split(".")
            if name.startswith("decoder.layers."):
                parts[2] = str(int(parts[2]) + p * per)
            out.append(TrainerShard(".".join(parts), tuple(x.shape), t, p, e))
    return out


def check_plan_reproduces_mcore_to_hf(cfg: dict, tp: int, pp: int) -> ReshardPlan:
    spec = spec_from_hf_config(cfg)
    hf = random_hf_state(spec)
    shards = hf_to_mcore(hf, spec, tp, pp)
    rollout = {k: tuple(v.shape) for k, v in hf.items()}  # what Rollout.Info lists: the HF checkpoint's tensors
    plan = plan_resharding(trainer_shards(shards, spec, pp), rollout, cfg)
    decoded = ReshardPlan.from_proto(trainer_pb2.ReshardPlan.FromString(plan.to_proto().SerializeToString()))
    assert decoded == plan
    expected = mcore_to_hf(shards, spec, tp, pp)
    got = dict(tensor_recipes.to_hf(decoded.tensors, lambda s: shards[s.key][s.name]))
    assert [r.hf_name for r in got] == list(expected)
    for r, tensor in got.items():
        assert tensor.dtype == expected[r.hf_name].dtype and torch.equal(tensor, expected[r.hf_name]), r.hf_name
        assert torch.equal(tensor, hf[r.hf_name]), r.hf_name
    return plan


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_plan_reproduces_mcore_to_hf(family: str, tp: int, pp: int) -> None:
    cfg = FAMILIES[family]
    if cfg["num_key_value_heads"] % tp:
        pytest.skip("TP does not divide the kv heads")
    check_plan_reproduces_mcore_to_hf(cfg, tp, pp)


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_plan_on_the_tiny_qwen2_checkpoint(tiny_model_dir, tp: int, pp: int) -> None:
    spec, raw = read_hf_config(tiny_model_dir)
    if spec.num_key_value_heads % tp:
        pytest.skip("TP does not divide the kv heads")
    hf = load_hf_state(tiny_model_dir)
    shards = hf_to_mcore(hf, spec, tp, pp)
    plan = plan_resharding(trainer_shards(shards, spec, pp), {k: tuple(v.shape) for k, v in hf.items()}, raw)
    assert (plan.trainer_tp, plan.trainer_pp) == (tp, pp)
    got = dict(tensor_recipes.to_hf(ReshardPlan.from_proto(plan.to_proto()).tensors, lambda s: shards[s.key][s.name]))
    assert {r.hf_name for r in got} == set(hf)
    assert all(torch.equal(t, hf[r.hf_name]) for r, t in got.items())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_type=st.sampled_from(["qwen2", "qwen3", "llama"]),
    groups=st.sampled_from([1, 2, 4]),
    q_per_group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([2, 4, 6]),
    layers=st.sampled_from([2, 4]),
    vocab=st.integers(min_value=9, max_value=80),
    tie=st.booleans(),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
)
def test_any_layout_round_trips(model_type, groups, q_per_group, head_dim, layers, vocab, tie, tp, pp) -> None:
    if groups % tp:
        tp = 1
    heads = groups * q_per_group
    cfg = dict(model_type=model_type, vocab_size=vocab, hidden_size=8, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim, intermediate_size=4 * tp,
               tie_word_embeddings=tie)
    check_plan_reproduces_mcore_to_hf(cfg, tp, pp)


def test_plan_message_names_every_source_slice() -> None:
    plan = check_plan_reproduces_mcore_to_hf(FAMILIES["qwen2"], 2, 2)
    msg = plan.to_proto()
    assert (msg.trainer_tensor_parallel_size, msg.trainer_pipeline_parallel_size) == (2, 2)
    k = next(t for t in msg.tensors if t.name == "model.layers.1.self_attn.k_proj.weight")
    assert k.concat_dim == 0
    # Layer 1 is stage 1's local layer 0; TP rank r holds query groups 2r, 2r+1 (8 heads, 4 groups, d=4), each
    # block [q q; k; v] of 4 rows per head: k is rows [8, 12) of each of the rank's 2 blocks.
    assert [(s.name, s.tp_rank, s.pp_rank, s.groups, s.start, s.stop) for s in k.sources] == [
        ("decoder.layers.0.self_attention.linear_qkv.weight", t, 1, 2, 8, 12) for t in (0, 1)]
    o = next(t for t in msg.tensors if t.name == "model.layers.0.self_attn.o_proj.weight")
    assert o.concat_dim == 1 and not o.sources[0].HasField("stop")
    # Tied embeddings: the last stage's output_layer copy is never read, the embedding is sent once.
    assert "output_layer.weight" not in plan.shards_of(1, 1)
    assert [r.hf_name for r in plan.tensors].count("model.embed_tokens.weight") == 1


def _tiny_inputs():
    cfg = FAMILIES["qwen3"]
    spec = spec_from_hf_config(cfg)
    hf = random_hf_state(spec)
    return cfg, spec, hf, trainer_shards(hf_to_mcore(hf, spec, 2, 1), spec, 1)


def test_rollout_shape_mismatch_names_the_tensor() -> None:
    cfg, _, hf, shards = _tiny_inputs()
    rollout = {k: tuple(v.shape) for k, v in hf.items()}
    rollout["model.layers.1.mlp.up_proj.weight"] = (41, 32)
    with pytest.raises(ReshardError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(41, 32\)"):
        plan_resharding(shards, rollout, cfg)


def test_uncovered_and_unknown_rollout_parameters_are_named() -> None:
    cfg, _, hf, shards = _tiny_inputs()
    rollout = {k: tuple(v.shape) for k, v in hf.items() if k != "model.layers.0.self_attn.q_norm.weight"}
    with pytest.raises(ReshardError, match=r"does not load 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        plan_resharding(shards, rollout, cfg)
    rollout = {k: tuple(v.shape) for k, v in hf.items()} | {"model.layers.0.mlp.extra.weight": (2,)}
    with pytest.raises(ReshardError, match=r"'model\.layers\.0\.mlp\.extra\.weight' has no counterpart"):
        plan_resharding(shards, rollout, cfg)
    # vLLM's fused names are not what UpdateWeights takes, so Rollout.Info never lists them.
    fused = {k: tuple(v.shape) for k, v in hf.items()} | {"model.layers.0.mlp.gate_up_proj.weight": (80, 32)}
    with pytest.raises(ReshardError, match="'model.layers.0.mlp.gate_up_proj.weight' has no counterpart"):
        plan_resharding(shards, fused, cfg)


def test_trainer_shard_mismatch_names_the_shard() -> None:
    cfg, _, hf, shards = _tiny_inputs()
    rollout = {k: tuple(v.shape) for k, v in hf.items()}
    bad = [TrainerShard(s.name, (1, *s.shape[1:]), s.tp_rank, s.pp_rank)
           if s.name == "decoder.layers.1.self_attention.linear_proj.weight" and s.tp_rank == 1 else s for s in shards]
    with pytest.raises(ReshardError, match=r"'decoder\.layers\.1\.self_attention\.linear_proj\.weight' \(tp_rank 1"):
        plan_resharding(bad, rollout, cfg)
    missing = [s for s in shards if not (s.name == "decoder.final_layernorm.weight" and s.tp_rank == 1)]
    with pytest.raises(ReshardError, match=r"'decoder\.final_layernorm\.weight' of tp_rank 1"):
        plan_resharding(missing, rollout, cfg)


def _plan_message() -> trainer_pb2.ReshardPlan:
    cfg, spec, hf, shards = _tiny_inputs()
    return plan_resharding(shards, {k: tuple(v.shape) for k, v in hf.items()}, cfg).to_proto()


def _broken(edit) -> trainer_pb2.ReshardPlan:
    msg = _plan_message()
    edit(msg)
    return msg


@pytest.mark.parametrize(("edit", "words"), [
    (lambda m: m.ClearField("tensors"), "no tensors"),
    (lambda m: setattr(m, "trainer_tensor_parallel_size", 0), "trainer sizes must be >= 1"),
    (lambda m: setattr(m, "dtype", common_pb2.DTYPE_INT32), "not a float type"),
    (lambda m: m.tensors[0].ClearField("sources"), "no sources"),
    (lambda m: setattr(m.tensors[0], "concat_dim", 5), "concat_dim 5"),
    (lambda m: setattr(m.tensors[0].sources[0], "tp_rank", 2), "outside TP=2 PP=1"),
    (lambda m: setattr(m.tensors[0].sources[0], "groups", 7), "groups 7"),
    (lambda m: setattr(m.tensors[0].sources[0], "stop", 0), "inside a block"),
    (lambda m: m.tensors[0].sources.append(m.tensors[0].sources[0]), "add up to"),
    (lambda m: m.tensors[0].shape.append(3), "does not fit"),
])
def test_malformed_plans_are_refused_naming_the_problem(edit, words) -> None:
    with pytest.raises(ReshardError, match=words):
        ReshardPlan.from_proto(_broken(edit))


# A small DeepSeek-V3 (MLA, layer 0 dense, layers 1-2 MoE with the router's expert bias), as config.json gives it.
DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=8, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc")
BIASES = {f"model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in (1, 2)}


def _bf16_replica_parameters(spec) -> list:
    """Rollout.Info's parameter list of a bf16 vLLM replica: every tensor bf16 but the expert bias, which vLLM keeps
    in float32 whatever the model dtype."""
    from rlfabric.v1 import rollout_pb2

    return [rollout_pb2.ParameterInfo(name=r.hf_name, shape=r.hf_shape, dtype=common_pb2.DTYPE_FLOAT32
                                      if r.hf_name in BIASES else common_pb2.DTYPE_BFLOAT16)
            for r in weight_layout.recipes(spec, 1, 1)]


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 1, 2)])
def test_a_bf16_replica_gets_the_expert_bias_in_float32(tp: int, pp: int, ep: int) -> None:
    spec = spec_from_hf_config(DEEPSEEK)
    hf = {r.hf_name: torch.randn(r.hf_shape, generator=torch.Generator().manual_seed(i))
          for i, r in enumerate(weight_layout.recipes(spec, 1, 1))}
    shards = hf_to_mcore(hf, spec, tp, pp, ep=ep)
    plan = plan_resharding(trainer_shards(shards, spec, pp), _bf16_replica_parameters(spec), DEEPSEEK)
    assert plan.dtype == "bfloat16" and dict(plan.tensor_dtypes) == dict.fromkeys(BIASES, "float32")
    msg = plan.to_proto()
    assert msg.dtype == common_pb2.DTYPE_BFLOAT16
    assert {t.name: t.dtype for t in msg.tensors if t.dtype} == dict.fromkeys(BIASES, common_pb2.DTYPE_FLOAT32)
    decoded = ReshardPlan.from_proto(trainer_pb2.ReshardPlan.FromString(msg.SerializeToString()))
    assert decoded == plan

    # What the trainer sends for it (one rank holding every shard): the bias as it holds it, the rest cast to bf16.
    from services.trainer.weight_sync import hf_tensors, plan_dtypes

    held = {name: x for sd in shards.values() for name, x in sd.items()}
    assert all(x.dtype == torch.float32 for x in held.values())
    if (tp, pp, ep) != (1, 1, 1):
        return  # hf_tensors gathers from other ranks over torch.distributed
    owners = {(weight_layout.is_expert_shard(s.name), s.key): 0 for r in decoded.tensors for s in r.sources}
    sent = dict(hf_tensors(decoded, held, owners, plan_dtypes(decoded, held)))
    assert set(sent) == set(hf)
    for name, tensor in sent.items():
        want = hf[name] if name in BIASES else hf[name].to(torch.bfloat16)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


def test_one_dtype_replica_plans_no_tensor_dtypes() -> None:
    spec = spec_from_hf_config(DEEPSEEK)
    shards = hf_to_mcore(random_hf_state(spec), spec, 1, 1)
    params = _bf16_replica_parameters(spec)
    for p in params:
        p.dtype = common_pb2.DTYPE_FLOAT32
    plan = plan_resharding(trainer_shards(shards, spec, 1), params, DEEPSEEK)
    assert plan.dtype == "float32" and not plan.tensor_dtypes
    assert all(t.dtype == common_pb2.DTYPE_UNSPECIFIED for t in plan.to_proto().tensors)


def test_a_tensor_dtype_that_is_no_float_type_is_refused_naming_the_tensor() -> None:
    msg = _plan_message()
    msg.tensors[1].dtype = common_pb2.DTYPE_INT32
    with pytest.raises(ReshardError, match=f"plan tensor '{re.escape(msg.tensors[1].name)}': dtype 8 is not a float"):
        ReshardPlan.from_proto(msg)

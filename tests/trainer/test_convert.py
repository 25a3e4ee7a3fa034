"""HF <-> Megatron conversion: bitwise round trips through the CLI and for every supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_spec import spec_from_hf_config
from services.trainer import ckpt_layout
from services.trainer.convert import hf_to_mcore, load_hf_state, mcore_to_hf


def test_cli_round_trip_tp2_pp2_is_bitwise_identical(tiny_model_dir: Path, tmp_path: Path, capsys):
    from services.cli import main

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--tp", "2", "--pp", "2", str(tiny_model_dir), str(mcore)]) == 0
    assert "layer 2/2" in capsys.readouterr().err  # progress is reported
    assert (mcore / ckpt_layout.TRACKER).read_text() == "release"
    assert sorted(p.name for p in (mcore / "release").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert main(["convert", "mcore2hf", str(mcore), str(back)]) == 0

    original, restored = load_hf_state(tiny_model_dir), load_hf_state(back)
    assert original.keys() == restored.keys()
    for name, t in original.items():
        assert restored[name].dtype == t.dtype and torch.equal(restored[name], t), name
    # A complete HF folder: same config and tokenizer files, byte for byte.
    for f in tiny_model_dir.iterdir():
        assert (back / f.name).read_bytes() == f.read_bytes(), f.name


def test_converted_folder_loads_in_transformers(tiny_model_dir: Path, tmp_path: Path):
    import transformers

    from services.trainer.convert import convert_hf_to_mcore, convert_mcore_to_hf

    convert_hf_to_mcore(tiny_model_dir, tmp_path / "m", tp=2, pp=1)
    out = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([tok("hello world")["input_ids"]])
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def _random_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF state dict with random values in the shapes `cfg` implies."""
    g = torch.Generator().manual_seed(seed)
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    spec = spec_from_hf_config(cfg)
    s = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "model.norm.weight": torch.randn(h, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        if spec.attention_bias:
            shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
        if spec.qk_norm:
            shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        for k, shape in shapes.items():
            s[p + k] = torch.randn(*shape, generator=g)
    if not cfg.get("tie_word_embeddings"):
        s["lm_head.weight"] = torch.randn(v, h, generator=g)
    return s


FAMILIES = {
    # Qwen2: QKV bias, tied embeddings, a vocabulary that TP 4 must pad.
    "qwen2": dict(model_type="qwen2", vocab_size=1001, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=96, tie_word_embeddings=True),
    # Qwen3: q/k norm, head_dim not hidden/heads, no bias, untied.
    "qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, intermediate_size=96, tie_word_embeddings=False),
    # Llama: GQA without bias, untied.
    "llama": dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False, rope_theta=500000.0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2), (4, 1)])
def test_round_trip_every_family(family: str, tp: int, pp: int):
    cfg = FAMILIES[family]
    if cfg["num_key_value_heads"] % tp or cfg["num_hidden_layers"] % pp:
        pytest.skip("layout does not divide this model")
    spec = spec_from_hf_config(cfg)
    hf = _random_state(cfg)
    shards = hf_to_mcore(hf, spec, tp, pp)
    assert len(shards) == tp * pp
    back = mcore_to_hf(shards, spec, tp, pp)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_fused_qkv_groups_query_heads_with_their_kv_head():
    # 4 query heads, 2 kv heads, head_dim 1: group g holds q heads (2g, 2g+1), then k_g, then v_g.
    cfg = dict(model_type="llama", vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=4, head_dim=1)
    spec = spec_from_hf_config(cfg)
    hf = _random_state(cfg)
    hf["model.layers.0.self_attn.q_proj.weight"] = torch.arange(4.0).reshape(4, 1).expand(4, 4)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.tensor([[10.0], [11.0]]).expand(2, 4)
    hf["model.layers.0.self_attn.v_proj.weight"] = torch.tensor([[20.0], [21.0]]).expand(2, 4)
    shards = hf_to_mcore(hf, spec, tp=2, pp=1)
    assert shards[(0, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [0, 1, 10, 20]
    assert shards[(1, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [2, 3, 11, 21]


def test_unsupported_family_is_named():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        spec_from_hf_config({"model_type": "gpt2"})


def test_tp_that_does_not_divide_heads_is_refused(tiny_model_dir: Path, tmp_path: Path):
    from services.cli import main

    assert main(["convert", "hf2mcore", "--tp", "3", str(tiny_model_dir), str(tmp_path / "x")]) == 2  # a usage mistake


def test_one_rank_shard_equals_the_full_split():
    cfg = FAMILIES["qwen3"]
    spec = spec_from_hf_config(cfg)
    hf = _random_state(cfg)
    full = hf_to_mcore(hf, spec, 2, 2)
    one = hf_to_mcore(hf, spec, 2, 2, only=(1, 1))
    # A dense caller's (tp_rank, pp_rank) key is the rank without expert parallelism, (1, 1, 0).
    assert list(one) == [(1, 1)] and one[(1, 1)].keys() == full[(1, 1, 0)].keys()
    assert all(torch.equal(one[(1, 1)][k], full[(1, 1, 0)][k]) for k in one[(1, 1)])

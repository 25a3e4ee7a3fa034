"""Hugging Face <-> Megatron-core weight conversion for dense Qwen2 / Qwen2.5 / Qwen3 / Llama.

Owns the name and layout mapping between an HF state dict and Megatron's per-(TP, PP) rank state
dicts, and the two folder-level conversions behind `rlfabric convert`:

    HF name                                   Megatron name (per rank)                  TP split
    model.embed_tokens.weight                 embedding.word_embeddings.weight          dim 0 (vocab, padded)
    model.layers.L.input_layernorm.weight     decoder.layers.l.input_layernorm.weight   replicated
    self_attn.{q,k,v}_proj.{weight,bias}      ...self_attention.linear_qkv.{weight,bias} dim 0, per query group
    self_attn.{q,k}_norm.weight (Qwen3)       ...self_attention.{q,k}_layernorm.weight  replicated
    self_attn.o_proj.weight                   ...self_attention.linear_proj.weight      dim 1
    post_attention_layernorm.weight           ...pre_mlp_layernorm.weight               replicated
    mlp.{gate,up}_proj.weight                 ...mlp.linear_fc1.weight                  dim 0, [gate_r; up_r]
    mlp.down_proj.weight                      ...mlp.linear_fc2.weight                  dim 1
    model.norm.weight                         decoder.final_layernorm.weight            replicated
    lm_head.weight                            output_layer.weight                       dim 0 (vocab, padded)

Fused QKV: Megatron orders rows by query group g: [q heads of g (heads/groups * head_dim); k_g; v_g].
Pipeline stages hold consecutive layers renumbered from 0. With tied embeddings and PP > 1 the last
stage keeps its own copy of the embedding as output_layer.weight (Megatron keeps the two in sync).
The conversion is pure slicing and concatenation, so HF -> mcore -> HF is bitwise exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.trainer import ckpt_layout
from services.trainer.model import ModelSpec, read_hf_config

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
ShardKey = tuple[int, int]  # (tp_rank, pp_rank)


def _noop(_msg: str) -> None:
    pass


def layers_of_stage(spec: ModelSpec, pp: int, pp_rank: int) -> range:
    per = spec.num_hidden_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _pad_vocab(w: torch.Tensor, padded: int) -> torch.Tensor:
    if w.shape[0] == padded:
        return w
    pad = torch.zeros((padded - w.shape[0], *w.shape[1:]), dtype=w.dtype)
    return torch.cat([w, pad], dim=0)


def _fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Per TP rank fused QKV (weights [*, h] or biases [*])."""
    g, d = spec.num_query_groups, spec.head_dim
    qpg = spec.num_attention_heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, qpg * d, *tail)
    kg = k.reshape(g, d, *tail)
    vg = v.reshape(g, d, *tail)
    fused = torch.cat([qg, kg, vg], dim=1)  # [g, (qpg + 2) d, ...]
    return [c.reshape(-1, *tail).clone() for c in fused.chunk(tp, dim=0)]


def _split_qkv(spec: ModelSpec, shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_query_groups, spec.head_dim
    qpg = spec.num_attention_heads // g
    fused = torch.cat(shards, dim=0)
    tail = fused.shape[1:]
    fused = fused.reshape(g, (qpg + 2) * d, *tail)
    q, k, v = fused.split([qpg * d, d, d], dim=1)
    return q.reshape(-1, *tail).clone(), k.reshape(-1, *tail).clone(), v.reshape(-1, *tail).clone()


def hf_to_mcore(
    hf: dict[str, torch.Tensor], spec: ModelSpec, tp: int, pp: int, progress: Progress = _noop,
    only: ShardKey | None = None,
) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Split an HF state dict into Megatron state dicts keyed by (tp_rank, pp_rank).

    `only` = (tp_rank, pp_rank) builds just that rank's dict (what a trainer rank loads).
    """
    keys = [only] if only is not None else [(t, p) for t in range(tp) for p in range(pp)]
    out: dict[ShardKey, dict[str, torch.Tensor]] = {k: {} for k in keys}
    padded = spec.padded_vocab_size(tp)

    def put(key: ShardKey, name: str, w: torch.Tensor) -> None:
        if key in out:
            out[key][name] = w.clone()

    def put_split(pp_rank: int, name: str, w: torch.Tensor, dim: int) -> None:
        for t, c in enumerate(w.chunk(tp, dim=dim)):
            put((t, pp_rank), name, c)

    def put_repl(pp_rank: int, name: str, w: torch.Tensor) -> None:
        for t in range(tp):
            put((t, pp_rank), name, w)

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint lacks {name!r} (model_type={spec.model_type}); is the folder complete?")
        return hf[name]

    embed = _pad_vocab(take("model.embed_tokens.weight"), padded)
    put_split(0, "embedding.word_embeddings.weight", embed, 0)
    for p in range(pp):
        for local, layer in enumerate(layers_of_stage(spec, pp, p)):
            src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
            put_repl(p, dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            fused = _fuse_qkv(spec, take(src + "self_attn.q_proj.weight"), take(src + "self_attn.k_proj.weight"),
                              take(src + "self_attn.v_proj.weight"), tp)
            for t, c in enumerate(fused):
                put((t, p), dst + "self_attention.linear_qkv.weight", c)
            if spec.attention_bias:
                fused_b = _fuse_qkv(spec, take(src + "self_attn.q_proj.bias"), take(src + "self_attn.k_proj.bias"),
                                    take(src + "self_attn.v_proj.bias"), tp)
                for t, c in enumerate(fused_b):
                    put((t, p), dst + "self_attention.linear_qkv.bias", c)
            if spec.qk_norm:
                put_repl(p, dst + "self_attention.q_layernorm.weight", take(src + "self_attn.q_norm.weight"))
                put_repl(p, dst + "self_attention.k_layernorm.weight", take(src + "self_attn.k_norm.weight"))
            put_split(p, dst + "self_attention.linear_proj.weight", take(src + "self_attn.o_proj.weight"), 1)
            put_repl(p, dst + "pre_mlp_layernorm.weight", take(src + "post_attention_layernorm.weight"))
            gates = take(src + "mlp.gate_proj.weight").chunk(tp, dim=0)
            ups = take(src + "mlp.up_proj.weight").chunk(tp, dim=0)
            for t in range(tp):
                if (t, p) in out:
                    out[(t, p)][dst + "mlp.linear_fc1.weight"] = torch.cat([gates[t], ups[t]], dim=0)
            put_split(p, dst + "mlp.linear_fc2.weight", take(src + "mlp.down_proj.weight"), 1)
            progress(f"layer {layer + 1}/{spec.num_hidden_layers} -> pp_rank {p}")
    put_repl(pp - 1, "decoder.final_layernorm.weight", take("model.norm.weight"))
    if not spec.tie_word_embeddings:
        put_split(pp - 1, "output_layer.weight", _pad_vocab(take("lm_head.weight"), padded), 0)
    elif pp > 1:
        put_split(pp - 1, "output_layer.weight", embed, 0)
    return out


def mcore_to_hf(
    shards: dict[ShardKey, dict[str, torch.Tensor]], spec: ModelSpec, tp: int, pp: int, progress: Progress = _noop
) -> dict[str, torch.Tensor]:
    """Merge Megatron rank state dicts back into one HF state dict (names in HF's order)."""
    hf: dict[str, torch.Tensor] = {}
    v = spec.vocab_size

    def cat(p: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(t, p)][name] for t in range(tp)], dim=dim)

    hf["model.embed_tokens.weight"] = cat(0, "embedding.word_embeddings.weight", 0)[:v].clone()
    for p in range(pp):
        for local, layer in enumerate(layers_of_stage(spec, pp, p)):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
            s0 = shards[(0, p)]
            hf[dst + "input_layernorm.weight"] = s0[src + "input_layernorm.weight"].clone()
            q, k, vv = _split_qkv(spec, [shards[(t, p)][src + "self_attention.linear_qkv.weight"] for t in range(tp)])
            hf[dst + "self_attn.q_proj.weight"], hf[dst + "self_attn.k_proj.weight"] = q, k
            hf[dst + "self_attn.v_proj.weight"] = vv
            if spec.attention_bias:
                qb, kb, vb = _split_qkv(spec, [shards[(t, p)][src + "self_attention.linear_qkv.bias"] for t in range(tp)])
                hf[dst + "self_attn.q_proj.bias"], hf[dst + "self_attn.k_proj.bias"] = qb, kb
                hf[dst + "self_attn.v_proj.bias"] = vb
            if spec.qk_norm:
                hf[dst + "self_attn.q_norm.weight"] = s0[src + "self_attention.q_layernorm.weight"].clone()
                hf[dst + "self_attn.k_norm.weight"] = s0[src + "self_attention.k_layernorm.weight"].clone()
            hf[dst + "self_attn.o_proj.weight"] = cat(p, src + "self_attention.linear_proj.weight", 1)
            hf[dst + "post_attention_layernorm.weight"] = s0[src + "pre_mlp_layernorm.weight"].clone()
            halves = [shards[(t, p)][src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for t in range(tp)]
            hf[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
            hf[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
            hf[dst + "mlp.down_proj.weight"] = cat(p, src + "mlp.linear_fc2.weight", 1)
            progress(f"layer {layer + 1}/{spec.num_hidden_layers} <- pp_rank {p}")
    hf["model.norm.weight"] = shards[(0, pp - 1)]["decoder.final_layernorm.weight"].clone()
    if not spec.tie_word_embeddings:
        hf["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)[:v].clone()
    return hf


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder's safetensors files (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files (convert .bin checkpoints to safetensors first)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def save_hf_state(state: dict[str, torch.Tensor], out_dir: Path) -> Path:
    from safetensors.torch import save_file

    out = out_dir / "model.safetensors"
    save_file({k: t.contiguous() for k, t in state.items()}, str(out), metadata={"format": "pt"})
    return out


def convert_hf_to_mcore(
    hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, progress: Progress = _noop
) -> Path:
    """Write `{out_dir}/release/mp_rank_*/model_optim_rng.pt` (+ tracker, hf_assets); return the root."""
    from services.trainer.model import transformer_config  # validates tp/pp against the model

    t0 = time.monotonic()
    hf_dir, root = Path(hf_dir), Path(out_dir)
    spec, raw = read_hf_config(hf_dir)
    transformer_config(spec, tp=tp, pp=pp)
    progress(f"read {hf_dir} ({spec.model_type}, {spec.num_hidden_layers} layers)")
    shards = hf_to_mcore(load_hf_state(hf_dir), spec, tp, pp, progress)
    root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_layout.tmp_iter_dir(root, ckpt_layout.RELEASE)
    for (t, p), sd in sorted(shards.items()):
        path = ckpt_layout.shard_path(tmp, t, p, pp)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(release_payload(sd, raw, tp, pp), path)
        progress(f"wrote {ckpt_layout.rank_dirname(t, p, pp)}")
    ckpt_layout.copy_hf_assets(hf_dir, root / ckpt_layout.HF_ASSETS)
    ckpt_layout.commit_iter_dir(root, ckpt_layout.RELEASE)
    progress(f"done in {time.monotonic() - t0:.1f}s: {root}")
    return root


def release_payload(sd: dict[str, torch.Tensor], hf_config: dict, tp: int, pp: int) -> dict:
    return {
        "model": sd,
        "checkpoint_version": 3.0,
        "iteration": 0,
        "rlfabric": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "hf_config": hf_config},
    }


def read_shards(iter_dir: Path, progress: Progress = _noop) -> tuple[dict[ShardKey, dict[str, torch.Tensor]], dict, int, int]:
    """Model state dicts of every rank in a checkpoint iteration dir; also the stored HF config."""
    tp, pp = ckpt_layout.detect_tp_pp(iter_dir)
    shards, hf_config = {}, None
    for t in range(tp):
        for p in range(pp):
            path = ckpt_layout.shard_path(iter_dir, t, p, pp)
            payload = torch.load(path, map_location="cpu", weights_only=False)
            shards[(t, p)] = payload["model"]
            hf_config = hf_config or payload.get("rlfabric", {}).get("hf_config")
            progress(f"read {path.parent.name}")
    return shards, hf_config, tp, pp


def convert_mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    *,
    iteration: int | None = None,
    hf_assets: str | Path | None = None,
    progress: Progress = _noop,
) -> Path:
    """Write a complete HF folder (config, model.safetensors, tokenizer) from a Megatron checkpoint."""
    import json

    from services.trainer.model import spec_from_hf_config

    t0 = time.monotonic()
    root, out = Path(mcore_dir), Path(out_dir)
    iter_dir, _ = ckpt_layout.resolve_iter_dir(root, iteration)
    assets = Path(hf_assets) if hf_assets else root / ckpt_layout.HF_ASSETS
    shards, hf_config, tp, pp = read_shards(iter_dir, progress)
    if hf_config is None:
        cfg_path = assets / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{iter_dir}: no HF config stored and no {cfg_path}; pass --hf-assets HF_DIR")
        hf_config = json.loads(cfg_path.read_text())
    spec = spec_from_hf_config(hf_config, source=str(iter_dir))
    hf = mcore_to_hf(shards, spec, tp, pp, progress)
    out.mkdir(parents=True, exist_ok=True)
    if assets.is_dir():
        ckpt_layout.copy_hf_assets(assets, out)
    else:
        progress(f"warning: {assets} missing, writing config.json only (no tokenizer)")
    if not (out / "config.json").is_file():
        (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_hf_state(hf, out)
    progress(f"done in {time.monotonic() - t0:.1f}s: {out}")
    return out

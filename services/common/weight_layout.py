"""Megatron-core <-> Hugging Face weight names and layouts (Qwen2 / Qwen2.5 / Qwen3 / Llama, Qwen3-MoE, DeepSeek-V3).

The one place that knows how an HF tensor is laid out across Megatron's per-(TP, PP, EP) rank state dicts.
Checkpoint conversion (services/trainer/convert.py) and the weight-sync resharding plan
(services/coordinator/resharding.py) are both built from `recipes(spec, tp, pp, ep)`, applied by
services/common/tensor_recipes.py. No torch, no Megatron import, no I/O.

    HF name                                   Megatron name (per rank)                   TP split
    model.embed_tokens.weight                 embedding.word_embeddings.weight           dim 0 (vocab, padded)
    model.layers.L.input_layernorm.weight     decoder.layers.l.input_layernorm.weight    replicated
    self_attn.{q,k,v}_proj.{weight,bias}      ...self_attention.linear_qkv.{weight,bias} dim 0, per query group
    self_attn.{q,k}_norm.weight (Qwen3)       ...self_attention.{q,k}_layernorm.weight   replicated
    self_attn.o_proj.weight                   ...self_attention.linear_proj.weight       dim 1
    post_attention_layernorm.weight           ...pre_mlp_layernorm.weight                replicated
    mlp.{gate,up}_proj.weight                 ...mlp.linear_fc1.weight                   dim 0, [gate_r; up_r]
    mlp.down_proj.weight                      ...mlp.linear_fc2.weight                   dim 1
    model.norm.weight                         decoder.final_layernorm.weight             replicated
    lm_head.weight                            output_layer.weight                        dim 0 (vocab, padded)
  Qwen3-MoE layers (spec.moe.moe_layers; the other layers keep the dense mlp rows above):
    mlp.gate.weight [E, H] (the router)       ...mlp.router.weight                       replicated (TP and EP)
    mlp.experts.X.{gate,up}_proj.weight       ...mlp.experts.local_experts.i.linear_fc1.weight  dim 0, [gate_r; up_r]
    mlp.experts.X.down_proj.weight            ...mlp.experts.local_experts.i.linear_fc2.weight  dim 1
  DeepSeek-V3 (spec.mla: multi-latent attention instead of q/k/v/o above; MoE layers as Qwen3-MoE's plus):
    self_attn.q_a_proj.weight                 ...self_attention.linear_q_down_proj.weight  dim 0
    self_attn.q_a_layernorm.weight            ...self_attention.q_layernorm.weight         replicated
    self_attn.q_b_proj.weight (q_proj without q_lora_rank: linear_q_proj)  ...linear_q_up_proj.weight  dim 0
    self_attn.kv_a_proj_with_mqa.weight       ...self_attention.linear_kv_down_proj.weight dim 0
    self_attn.kv_a_layernorm.weight           ...self_attention.kv_layernorm.weight        replicated
    self_attn.kv_b_proj.weight                ...self_attention.linear_kv_up_proj.weight   dim 0 (by heads)
    self_attn.o_proj.weight                   ...self_attention.linear_proj.weight         dim 1
    mlp.gate.e_score_correction_bias          ...mlp.router.expert_bias                    replicated (TP and EP)
    mlp.shared_experts.{gate,up}_proj.weight  ...mlp.shared_experts.linear_fc1.weight      dim 0, [gate_r; up_r]
    mlp.shared_experts.down_proj.weight       ...mlp.shared_experts.linear_fc2.weight      dim 1

Facts encoded here:
- Fused QKV: Megatron orders the rows by query group g: [q heads of g (heads/groups * head_dim); k_g; v_g],
  and TP rank r holds groups [r * groups/tp, (r + 1) * groups/tp).
- Fused fc1: TP rank r holds [gate rows of r; up rows of r].
- Vocabulary: padded with zero rows to a multiple of TP (`padded_vocab_size`); the pad sits at the end of
  the last TP ranks' shards and never reaches HF.
- Pipeline: stage p holds its layers (`stage_layer_counts`: L/pp each, or the uneven layout of MindSpeed's
  num_layer_list / noop_layers, services/common/pipeline_layout.py) renumbered from 0 (`local_layer_name`,
  `global_layer_name`); no-op layers have no weights and no number, HF layer k is model layer k.
- Tied embeddings: no lm_head in HF; with PP > 1 the last stage keeps its own copy of the embedding as
  output_layer.weight (Megatron keeps the two in sync), a *mirror* of the embedding's shards.
- Multi-latent attention: Megatron's local spec builds the down projections as ColumnParallelLinear, so they
  are split by rows over TP like the up projections (services/trainer/mla.py keeps TransformerEngine's so); the
  rows of q_b_proj / kv_b_proj are per head, so a TP rank holds whole heads. Shared experts are a dense MLP of
  their own size on every EP rank.
- Experts (megatron-core's local spec, SequentialMLP, no grouped GEMM): EP rank e holds global experts
  X in [e * E/ep, (e + 1) * E/ep), numbered i = X - e * E/ep locally; each expert's fc1 / fc2 follow the dense
  fc1 / fc2 TP rules (the expert TP size is the TP size, Megatron's default). Every other tensor, the router
  included, is the same on every EP rank: the EP ranks other than 0 hold mirrors. A rank is keyed
  (tp_rank, pp_rank, ep_rank); ep_rank is 0 without expert parallelism.

`TensorRecipe` / `ShardSlice` (services/common/tensor_recipes.py) carry the result: which shard slices compose
each HF tensor. The mapping is pure slicing and concatenation, so HF -> mcore -> HF is bitwise exact.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence

from services.common import pipeline_layout
from services.common.model_spec import ModelSpec, check_expert_parallel, check_tensor_parallel
from services.common.tensor_recipes import ShardKey, ShardSlice, TensorRecipe

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = ".mlp.experts.local_experts."  # in the names of the tensors that EP shards (the others EP mirrors)


def is_expert_shard(name: str) -> bool:
    """Whether Megatron shard `name` is a local expert's weight (sharded over EP; every other tensor EP mirrors)."""
    return _EXPERT in name


def padded_vocab_size(spec: ModelSpec, tp: int) -> int:
    """Vocabulary rounded up to a multiple of the TP size (VocabParallelEmbedding needs it)."""
    return -(-spec.vocab_size // tp) * tp


StageLayers = Sequence[int]  # model layers on each pipeline stage


def stage_layer_counts(spec: ModelSpec, pp: int, stages: StageLayers | None = None) -> tuple[int, ...]:
    """The model layers on each of `pp` pipeline stages: `stages` when given (checked against the model), else
    Megatron's even split. The one statement of the layout for the trainer, conversion and weight sync; a config's
    num_layer_list / noop_layers become `stages` through pipeline_layout.stage_layers."""
    try:
        if stages is None:
            return pipeline_layout.stage_slots(spec.num_hidden_layers, pp)
        return pipeline_layout.check_stage_layers(stages, spec.num_hidden_layers, pp)
    except pipeline_layout.StageLayoutError as e:
        raise ValueError(f"num_hidden_layers={spec.num_hidden_layers} at pipeline size {pp}: {e}") from None


def layers_of_stage(spec: ModelSpec, pp: int, pp_rank: int, stages: StageLayers | None = None) -> range:
    return pipeline_layout.stage_range(stage_layer_counts(spec, pp, stages), pp_rank)


def local_layer_name(global_name: str, stages: StageLayers) -> tuple[str, int | None]:
    """Model-wide `decoder.layers.L.X` -> (stage-local name, stage); (name, None) for non-layer names.
    `stages`: the layers of each stage (`stage_layer_counts`)."""
    m = _LAYER.match(global_name)
    if not m:
        return global_name, None
    stage, local = pipeline_layout.stage_of_layer(stages, int(m.group(1)))
    return f"decoder.layers.{local}.{global_name[m.end():]}", stage


def global_layer_name(local_name: str, pp_rank: int, stages: StageLayers) -> str:
    """Stage-local `decoder.layers.l.X` of stage `pp_rank` -> model-wide name (the inverse of local_layer_name)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    first = pipeline_layout.stage_range(stages, pp_rank).start
    return f"decoder.layers.{int(m.group(1)) + first}.{local_name[m.end():]}"


def stage_layers_of_names(names_by_stage: Sequence[Iterable[str]]) -> tuple[int, ...]:
    """The layers each stage holds, counted from its parameter names (stage-local or model-wide numbers): how a
    checkpoint or a trainer's report says its layout."""
    return tuple(len({int(m.group(1)) for m in map(_LAYER.match, names) if m}) for names in names_by_stage)


class _Recipes:
    """The recipes of one model's tensors at a TP x EP layout, one builder per kind of tensor (`recipes` walks the
    model's layers with them)."""

    def __init__(self, spec: ModelSpec, tp: int, ep: int) -> None:
        self.spec, self.tp, self.ep = spec, tp, ep
        self.h, self.d, self.f = spec.hidden_size, spec.head_dim, spec.intermediate_size
        self.g = spec.num_key_value_heads  # query groups
        self.qpg = spec.num_attention_heads // self.g
        self.q_rows, self.kv_rows = spec.num_attention_heads * self.d, self.g * self.d
        self.moe_layers = set(spec.moe.moe_layers) if spec.moe else set()

    def split_dim(self, hf_name, hf_shape, name, p, dim, layer=None, e=0) -> TensorRecipe:
        tp = self.tp
        shard = tuple(n // tp if i == dim else n for i, n in enumerate(hf_shape))
        return TensorRecipe(hf_name, hf_shape, tuple(ShardSlice(name, t, p, shard, ep_rank=e) for t in range(tp)),
                            dim, layer=layer)

    def replicated(self, hf_name, hf_shape, name, p, layer=None) -> TensorRecipe:
        copies = [(ShardSlice(name, t, p, hf_shape),) for t in range(self.tp)]
        return TensorRecipe(hf_name, hf_shape, copies[0], 0, mirrors=tuple(copies[1:]), layer=layer)

    def qkv(self, hf_prefix, suffix, name, p, layer) -> list[TensorRecipe]:
        tp, h, d, g, qpg, q_rows, kv_rows = self.tp, self.h, self.d, self.g, self.qpg, self.q_rows, self.kv_rows
        tail = (h,) if suffix == "weight" else ()
        shard = ((qpg + 2) * d * (g // tp), *tail)
        parts = {"q": (0, qpg * d, q_rows), "k": (qpg * d, (qpg + 1) * d, kv_rows),
                 "v": ((qpg + 1) * d, (qpg + 2) * d, kv_rows)}
        return [
            TensorRecipe(f"{hf_prefix}{part}_proj.{suffix}", (rows, *tail),
                         tuple(ShardSlice(name, t, p, shard, g // tp, a, b) for t in range(tp)), 0,
                         relay=f"qkv:{part}", layer=layer)
            for part, (a, b, rows) in parts.items()
        ]

    def gate_up(self, hf_prefix, name, inner, p, layer, e=0) -> list[TensorRecipe]:
        tp, h = self.tp, self.h
        fc1, per = (2 * inner // tp, h), inner // tp
        return [TensorRecipe(f"{hf_prefix}{half}_proj.weight", (inner, h),
                             tuple(ShardSlice(name, t, p, fc1, 1, a, a + per, e) for t in range(tp)), 0,
                             relay=f"gate_up:{half}", layer=layer)
                for half, a in (("gate", 0), ("up", per))]

    def mlp(self, src, dst, p, layer) -> list[TensorRecipe]:
        h, f = self.h, self.f
        if layer not in self.moe_layers:
            return [*self.gate_up(src + "mlp.", dst + "mlp.linear_fc1.weight", f, p, layer),
                    self.split_dim(src + "mlp.down_proj.weight", (h, f), dst + "mlp.linear_fc2.weight", p, 1, layer)]
        moe = self.spec.moe
        assert moe is not None  # moe_layers is empty without it
        inner, per_rank = moe.moe_intermediate_size, moe.num_experts // self.ep
        res = [self.replicated(src + "mlp.gate.weight", (moe.num_experts, h), dst + "mlp.router.weight", p, layer)]
        if moe.expert_bias:
            res.append(self.replicated(src + "mlp.gate.e_score_correction_bias", (moe.num_experts,),
                                       dst + "mlp.router.expert_bias", p, layer))
        for x in range(moe.num_experts):
            e, i = divmod(x, per_rank)
            hf_prefix, name = f"{src}mlp.experts.{x}.", f"{dst}mlp.experts.local_experts.{i}."
            res += self.gate_up(hf_prefix, name + "linear_fc1.weight", inner, p, layer, e)
            res.append(self.split_dim(hf_prefix + "down_proj.weight", (h, inner), name + "linear_fc2.weight", p, 1,
                                      layer, e))
        shared = moe.shared_expert_intermediate_size
        if shared:
            res += [*self.gate_up(src + "mlp.shared_experts.", dst + "mlp.shared_experts.linear_fc1.weight", shared,
                                  p, layer),
                    self.split_dim(src + "mlp.shared_experts.down_proj.weight", (h, shared),
                                   dst + "mlp.shared_experts.linear_fc2.weight", p, 1, layer)]
        return res

    def mla(self, src, dst, p, layer) -> list[TensorRecipe]:
        h, split_dim, replicated = self.h, self.split_dim, self.replicated
        m, heads = self.spec.mla, self.spec.num_attention_heads
        assert m is not None
        a, b = src + "self_attn.", dst + "self_attention."
        res = []
        if m.q_lora_rank is None:
            res.append(split_dim(a + "q_proj.weight", (heads * m.q_head_dim, h), b + "linear_q_proj.weight", p, 0,
                                 layer))
        else:
            res += [split_dim(a + "q_a_proj.weight", (m.q_lora_rank, h), b + "linear_q_down_proj.weight", p, 0, layer),
                    replicated(a + "q_a_layernorm.weight", (m.q_lora_rank,), b + "q_layernorm.weight", p, layer),
                    split_dim(a + "q_b_proj.weight", (heads * m.q_head_dim, m.q_lora_rank),
                              b + "linear_q_up_proj.weight", p, 0, layer)]
        return [*res,
                split_dim(a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h),
                          b + "linear_kv_down_proj.weight", p, 0, layer),
                replicated(a + "kv_a_layernorm.weight", (m.kv_lora_rank,), b + "kv_layernorm.weight", p, layer),
                split_dim(a + "kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                          b + "linear_kv_up_proj.weight", p, 0, layer),
                split_dim(a + "o_proj.weight", (h, heads * m.v_head_dim), b + "linear_proj.weight", p, 1, layer)]

    def vocab(self, hf_name, name, p) -> TensorRecipe:
        spec, tp, h = self.spec, self.tp, self.h
        padded = padded_vocab_size(spec, tp)
        per = padded // tp
        srcs = []
        for t in range(tp):
            keep = min(per, max(0, spec.vocab_size - t * per))
            if keep:
                srcs.append(ShardSlice(name, t, p, (per, h), 1, 0, keep))
        return TensorRecipe(hf_name, (spec.vocab_size, h), tuple(srcs), 0,
                            relay="vocab" if padded != spec.vocab_size else "")

    def layer(self, p: int, local: int, layer: int) -> list[TensorRecipe]:
        """The tensors of model layer `layer`, the `local`-th layer of pipeline stage `p`."""
        spec, h, d, q_rows = self.spec, self.h, self.d, self.q_rows
        replicated, split_dim, qkv, mlp = self.replicated, self.split_dim, self.qkv, self.mlp
        out: list[TensorRecipe] = []
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        out.append(replicated(src + "input_layernorm.weight", (h,), dst + "input_layernorm.weight", p, layer))
        if spec.mla is not None:
            out += self.mla(src, dst, p, layer)
            out.append(replicated(src + "post_attention_layernorm.weight", (h,), dst + "pre_mlp_layernorm.weight",
                                  p, layer))
            out += mlp(src, dst, p, layer)
            return out
        out += qkv(src + "self_attn.", "weight", dst + "self_attention.linear_qkv.weight", p, layer)
        if spec.attention_bias:
            out += qkv(src + "self_attn.", "bias", dst + "self_attention.linear_qkv.bias", p, layer)
        if spec.qk_norm:
            out.append(replicated(src + "self_attn.q_norm.weight", (d,), dst + "self_attention.q_layernorm.weight",
                                  p, layer))
            out.append(replicated(src + "self_attn.k_norm.weight", (d,), dst + "self_attention.k_layernorm.weight",
                                  p, layer))
        out.append(split_dim(src + "self_attn.o_proj.weight", (h, q_rows), dst + "self_attention.linear_proj.weight",
                             p, 1, layer))
        out.append(replicated(src + "post_attention_layernorm.weight", (h,), dst + "pre_mlp_layernorm.weight", p,
                              layer))
        out += mlp(src, dst, p, layer)
        return out


def recipes(spec: ModelSpec, tp: int, pp: int, ep: int = 1, stages: StageLayers | None = None) -> list[TensorRecipe]:
    """Every HF tensor of the model in HF order, with the shard slices of a TP x PP x EP Megatron layout (`stages`:
    the layers of each pipeline stage, `stage_layer_counts`; None: an even split)."""
    stages = stage_layer_counts(spec, pp, stages)
    check_tensor_parallel(spec, tp)
    check_expert_parallel(spec, ep=ep, etp=tp)  # the layout splits each expert over TP
    build = _Recipes(spec, tp, ep)
    out: list[TensorRecipe] = []
    embed = build.vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight", 0)
    if spec.tie_word_embeddings and pp > 1:
        tied = tuple(dataclasses.replace(s, name="output_layer.weight", pp_rank=pp - 1) for s in embed.sources)
        embed = dataclasses.replace(embed, mirrors=(tied,))
    out.append(embed)
    for p in range(pp):
        for local, layer in enumerate(pipeline_layout.stage_range(stages, p)):
            out += build.layer(p, local, layer)
    out.append(build.replicated("model.norm.weight", (build.h,), "decoder.final_layernorm.weight", pp - 1))
    if not spec.tie_word_embeddings:
        out.append(build.vocab("lm_head.weight", "output_layer.weight", pp - 1))
    return out if ep == 1 else [r if _EXPERT in r.sources[0].name else _mirror_over_ep(r, ep) for r in out]


def _mirror_over_ep(r: TensorRecipe, ep: int) -> TensorRecipe:
    """`r` (held on EP rank 0) with the copies on EP ranks 1..ep-1 added as mirrors."""
    copies = tuple(tuple(dataclasses.replace(s, ep_rank=e) for s in group)
                   for e in range(1, ep) for group in (r.sources, *r.mirrors))
    return dataclasses.replace(r, mirrors=(*r.mirrors, *copies))


def shard_shapes(spec: ModelSpec, tp: int, pp: int, ep: int = 1, stages: StageLayers | None = None
                 ) -> dict[ShardKey, dict[str, tuple[int, ...]]]:
    """Every rank's Megatron parameter names (stage-local) and shapes, as the layout implies them."""
    out: dict[ShardKey, dict[str, tuple[int, ...]]] = {
        (t, p, e): {} for t in range(tp) for p in range(pp) for e in range(ep)}
    for r in recipes(spec, tp, pp, ep, stages):
        for s in _all_slices(r):
            out[s.key][s.name] = s.shard_shape
    return out


def _all_slices(recipe: TensorRecipe) -> Iterator[ShardSlice]:
    yield from recipe.sources
    for mirror in recipe.mirrors:
        yield from mirror

"""The model block checked against the Hugging Face `config.json` the services will load.

rlfabric builds its models from `config.json` (services/common/model_spec.py), never from the YAML's model
block; MindSpeed-RL builds Megatron's model from the block. A block that disagrees with the weights would
train another model upstream, so `rlfabric config check` and `rlfabric up` compare them and refuse every
mismatch, naming the key and both values.

Vocabulary: Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by` x TP unless
`padded_vocab_size` is given; the result must equal the rows the weights have (`vocab_size` of config.json,
rounded up to a multiple of TP as rlfabric's trainer does). Keys that default rather than being written
(rotary_base, norm_epsilon, ...) are compared only when the YAML writes them; the tie of the embeddings is
always compared (its default, tied, is a statement about the model). `num_layers` counts MindSpeed's
`noop_layers` (identity layers without weights) and config.json's num_hidden_layers does not: the block's layers
less its no-ops are compared, and its MoE pattern (which counts the no-ops' slots) is compared at the real layers.

Mixture of experts (Qwen3-MoE): a block with `num_experts` must meet a config.json with experts and the
other way round; the experts, the router's top-k (`moe_router_topk`, default 2 as upstream), their MLP size
(`moe_ffn_hidden_size`, Megatron's default ffn_hidden_size), `norm_topk_prob` (default false) and which
layers are MoE layers (`moe_layer_freq`, Megatron's meaning: N is every N-th layer from layer 0, unset is
every layer) are always compared, since upstream trains what their defaults say. `ffn_hidden_size` is
compared only when the model has a dense MLP layer (in an all-MoE model it sizes nothing). DeepSeek-V3's keys
(multi-latent attention, shared experts, its router, dense first layers, YaRN) are compared by moe.py's
`architecture_mismatches`; a DeepSeek config.json of another generation is named as such.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import pipeline_layout
from services.common.config import moe as moe_rules
from services.common.config.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from services.common.config.architecture import ModelConfig
    from services.common.config.resolved import RLFabricConfig
    from services.common.model_spec import ModelSpec


def megatron_padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: up to a multiple of `divisible_by` x `tp`."""
    multiple = max(divisible_by, 1) * max(tp, 1)
    return -(-vocab_size // multiple) * multiple


def model_dirs(cfg: RLFabricConfig) -> list[Path]:
    """The folders the services load a model from that hold a config.json (tokenizer, rollout model, load)."""
    candidates = (cfg.actor_config.tokenizer_name_or_path, cfg.derived.rollout_tokenizer_name_or_path,
                  cfg.actor_config.load)
    out: list[Path] = []
    for path in candidates:
        if path and (Path(path) / "config.json").is_file() and Path(path) not in out:
            out.append(Path(path))
    return out


def check_model_files(cfg: RLFabricConfig) -> list[Path]:
    """Compare the model block with every config.json of `model_dirs`; return the folders checked.

    Raises:
        ConfigError: naming each mismatching key with both values.
    """
    dirs = model_dirs(cfg)
    issues = [issue for d in dirs for issue in compare_with_hf(cfg, d)]
    if issues:
        raise ConfigError(issues, str(cfg.path) if cfg.path else None)
    return dirs


def compare_with_hf(cfg: RLFabricConfig, hf_dir: Path) -> list[ConfigIssue]:
    """The mismatches between the actor's model block and `hf_dir/config.json`."""
    from services.common.model_spec import read_hf_config

    source = str(hf_dir / "config.json")
    try:
        spec, _raw = read_hf_config(hf_dir)
    except (ValueError, KeyError, OSError) as exc:
        return [ConfigIssue(source, _deepseek_message(hf_dir) or f"cannot use this model: {exc}")]
    return [ConfigIssue(cfg.where(key), f"`{cfg.where(key)}` is {ours} but {source} has {hf_key}: {theirs}; "
                                        f"make the model block match the weights", cfg.source(key))
            for key, ours, hf_key, theirs in _mismatches(cfg, spec)]


def _mismatches(cfg: RLFabricConfig, spec: ModelSpec) -> Iterable[tuple[str, Any, str, Any]]:
    a = cfg.actor_config
    written = cfg.provenance.megatron_origin
    kv_heads = a.num_query_groups if a.group_query_attention else a.num_attention_heads
    yield from _layer_count_mismatch(a, spec.num_hidden_layers)
    always = [
        ("hidden_size", a.hidden_size, "hidden_size", spec.hidden_size),
        ("num_attention_heads", a.num_attention_heads, "num_attention_heads", spec.num_attention_heads),
        ("num_query_groups" if a.group_query_attention else "group_query_attention", kv_heads,
         "num_key_value_heads", spec.num_key_value_heads),
        ("untie_embeddings_and_output_weights", a.untie_embeddings_and_output_weights,
         "tie_word_embeddings (negated)", not spec.tie_word_embeddings),
    ]
    all_moe = spec.moe is not None and len(spec.moe.moe_layers) == spec.num_hidden_layers
    when_set = [
        ("ffn_hidden_size", None if all_moe else a.ffn_hidden_size, "intermediate_size", spec.intermediate_size),
        ("kv_channels", a.kv_channels, "head_dim", spec.head_dim),
        ("max_position_embeddings", a.max_position_embeddings, "max_position_embeddings",
         spec.max_position_embeddings),
    ]
    when_written = [
        ("rotary_base", float(a.rotary_base), "rope_theta", spec.rope_theta),
        ("norm_epsilon", a.norm_epsilon, "rms_norm_eps", spec.rms_norm_eps),
        ("qk_layernorm", a.qk_layernorm, "model_type qwen3 (q/k norm)", spec.qk_norm),
        ("add_qkv_bias", a.add_qkv_bias, "attention_bias", spec.attention_bias),
        ("rope_scaling_type", a.rope_scaling_type, "rope_scaling.rope_type",
         "yarn" if spec.yarn is not None else "llama3" if spec.rope_scaling_factor is not None else None),
        ("position_embedding_type", a.position_embedding_type, "position embedding", "rope"),
        ("normalization", a.normalization, "normalization", "RMSNorm"),
        ("swiglu", a.swiglu, "MLP", True),
        ("disable_bias_linear", a.disable_bias_linear, "bias on linear layers (none)", True),
    ]
    if a.rope_scaling_type is not None:
        when_written.append(("rope_scaling_factor", a.rope_scaling_factor, "rope_scaling.factor",
                             spec.yarn.factor if spec.yarn is not None else spec.rope_scaling_factor))
    for key, ours, hf_key, theirs in always:
        if ours is not None and ours != theirs:
            yield key, ours, hf_key, theirs
    for key, ours, hf_key, theirs in when_set:
        if ours is not None and ours != theirs:
            yield key, ours, hf_key, theirs
    for key, ours, hf_key, theirs in when_written:
        if key in written and ours != theirs:
            yield key, ours, hf_key, theirs
    yield from _moe_mismatches(cfg, spec)
    yield from moe_rules.architecture_mismatches(a, spec)
    tp = a.tensor_model_parallel_size
    padded = a.padded_vocab_size or megatron_padded_vocab_size(spec.vocab_size, a.make_vocab_size_divisible_by, tp)
    if padded != spec.padded_vocab_size(tp):
        key = "padded_vocab_size" if a.padded_vocab_size else "make_vocab_size_divisible_by"
        how = "" if a.padded_vocab_size else f"{a.make_vocab_size_divisible_by}, which pads the vocabulary to "
        hf_vocab = "vocab_size" + (f" (padded to a multiple of TP {tp})" if tp > 1 else "")
        yield key, f"{how}{padded}", hf_vocab, spec.padded_vocab_size(tp)


def _moe_mismatches(cfg: RLFabricConfig, spec: ModelSpec) -> Iterable[tuple[str, Any, str, Any]]:
    """The model block's experts against the config.json's (see module docstring)."""
    a, moe = cfg.actor_config, spec.moe
    if moe is None:
        if a.num_experts is not None:
            yield "num_experts", a.num_experts, "model_type", f"{spec.model_type} (a dense model, no experts)"
        return
    if a.num_experts is None:
        yield "num_experts", "unset (a dense model)", "num_experts", moe.num_experts
        return
    expert_ffn = a.moe_ffn_hidden_size if a.moe_ffn_hidden_size is not None else a.ffn_hidden_size
    ours_ffn = expert_ffn if a.moe_ffn_hidden_size is not None else f"unset, so ffn_hidden_size {expert_ffn}"
    pattern = _model_moe_pattern(a, spec.num_hidden_layers)
    hf_pattern = [int(layer in moe.moe_layers) for layer in range(spec.num_hidden_layers)]
    pairs = [
        ("num_experts", a.num_experts, a.num_experts, "num_experts", moe.num_experts),
        ("moe_router_topk", a.moe_router_topk, a.moe_router_topk, "num_experts_per_tok", moe.num_experts_per_tok),
        ("moe_ffn_hidden_size", expert_ffn, ours_ffn, "moe_intermediate_size", moe.moe_intermediate_size),
        ("norm_topk_prob", a.norm_topk_prob, a.norm_topk_prob, "norm_topk_prob", moe.norm_topk_prob),
    ]
    for key, value, ours, hf_key, theirs in pairs:
        if value is not None and value != theirs:
            yield key, ours, hf_key, theirs
    if pattern != hf_pattern:
        yield ("moe_layer_freq", _describe_layers(a.moe_layer_freq, pattern),
               "MoE layers (decoder_sparse_step, mlp_only_layers, first_k_dense_replace)",
               _describe_layers(None, hf_pattern))


def _model_slots(a: ModelConfig) -> tuple[int, ...] | None:
    """Where each model layer sits among num_layers when the block has no-op layers (MindSpeed counts them in
    num_layers, config.json does not: Qwen3-235B's num_layers 96 with noop_layers "5,95" is its 94 layers); None
    without no-op layers, or with ones validation refuses."""
    if a.num_layers is None or a.noop_layers is None:
        return None
    try:
        return pipeline_layout.model_layer_slots(a.num_layers, a.noop_layers)
    except pipeline_layout.StageLayoutError:
        return None


def _layer_count_mismatch(a: ModelConfig, hf_layers: int) -> Iterable[tuple[str, Any, str, Any]]:
    """num_layers (less its no-op layers) against config.json's num_hidden_layers."""
    slots = _model_slots(a)
    ours = a.num_layers if slots is None else len(slots)
    if ours is not None and ours != hf_layers:
        yield "num_layers", (ours if slots is None else
                             f"{a.num_layers} with noop_layers {a.noop_layers!r}, so {ours} layers"), \
            "num_hidden_layers", hf_layers


def _model_moe_pattern(a: ModelConfig, hf_layers: int) -> list[int] | None:
    """One 0/1 entry per model layer (1: MoE; first_k_dense_replace included). moe_layer_freq and
    first_k_dense_replace count num_layers' slots, no-op layers among them: the pattern is built over the slots
    and the no-ops dropped."""
    slots = _model_slots(a)
    if slots is None or len(slots) != hf_layers:  # a layer count that differs is reported as num_layers
        return moe_rules.moe_layer_pattern(a, hf_layers)
    pattern = moe_rules.moe_layer_pattern(a, a.num_layers)
    return None if pattern is None else [pattern[slot] for slot in slots]


def megatron_moe_layers(freq: int | str | list[int] | None, num_layers: int) -> list[int] | None:
    """Megatron's `moe_layer_freq` as one 0/1 entry per layer (1: MoE); None when it cannot be read.

    Unset is Megatron's default 1; N marks layers 0, N, 2N, ...; a list (or its Python spelling, e.g.
    "[0]*3+[1]*58", which Megatron evaluates) gives every layer.
    """
    if freq is None:
        freq = 1
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)] if freq >= 1 else None
    if isinstance(freq, str):
        try:
            freq = _list_expression(ast.parse(freq.strip(), mode="eval").body)
        except (SyntaxError, ValueError):
            return None
    return [int(v) for v in freq] if all(v in (0, 1) for v in freq) else None


def _list_expression(node: ast.AST) -> list[int]:
    """A list of ints built from literals with `+` and `* n` only (never evaluated as code)."""
    if isinstance(node, ast.List | ast.Tuple) and all(isinstance(e, ast.Constant) and type(e.value) is int
                                                      for e in node.elts):
        return [e.value for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant) and type(node.right.value) is int:
            return _list_expression(node.left) * node.right.value
        if isinstance(node.left, ast.Constant) and type(node.left.value) is int:
            return _list_expression(node.right) * node.left.value
    raise ValueError("not a list expression")


def _describe_layers(freq: Any, pattern: list[int] | None) -> str:
    if pattern is None:
        return f"{freq!r}, which is not a layer frequency or a 0/1 list"
    moe = [i for i, v in enumerate(pattern) if v]
    what = "every layer a MoE layer" if len(moe) == len(pattern) else f"MoE layers {moe} of {len(pattern)}"
    return what if freq is None else f"{freq!r} ({what})"


def _deepseek_message(hf_dir: Path) -> str | None:
    """The message for a DeepSeek config.json, whose model_type the model spec refuses generically."""
    from services.common.errors import DataError
    from services.common.model_spec import read_config_json

    try:
        model_type = str(read_config_json(hf_dir).get("model_type", ""))
    except DataError:
        return None
    if not model_type.startswith("deepseek") or model_type == "deepseek_v3":
        return None  # a DeepSeek-V3 config.json's refusal names its key (model_spec)
    return (f"cannot use this model: model_type {model_type} is a DeepSeek model of another generation than "
            f"DeepSeek-V3; rlfabric trains Qwen3-MoE and DeepSeek-V3 (model_type deepseek_v3) mixture-of-experts "
            f"models")

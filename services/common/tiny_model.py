"""A tiny, seeded, randomly initialised Qwen2 (dense) or Qwen3-MoE model with a real byte-level BPE tokenizer.

Tests, the demo and the CPU benchmarks need a model that transformers, vLLM and Megatron all load, with no
hub access. The tokenizer is trained here, deterministically, on arithmetic and math text (the W1
workload of the benchmarks), and carries the ChatML special tokens of the Qwen family. How numbers become
tokens is `digits` (DIGIT_SPLITS): "bpe" merges digits like any other text; "single" makes every digit its own
token (the W2 learning race: "A+B=" with a 512-entry vocabulary), so that a number's tokens are its digits and a
small model can learn column addition.

`family="qwen3_moe"` writes a Qwen3-MoE model instead (routed experts, softmax top-k router): the tiny
mixture-of-experts model of the MoE tests, saved with the per-expert checkpoint names of the Qwen3-MoE
releases (`mlp.experts.{e}.gate_proj.weight`, ...).

`family="deepseek_v3"` writes a DeepSeek-V3 model: multi-latent attention (query and key/value latents,
split rotary/non-rotary head dimensions; the key/value latent and rotary sizes are DeepSeek's own, 512 and 64,
the only ones vLLM-CPU's MLA decode kernel takes), the first layer dense, the others 8 routed experts plus one shared
expert behind a sigmoid router with group-limited top-2 (2 groups, 1 chosen) and a routed scaling factor of
2.5, YaRN rope, no multi-token prediction layers, untied embeddings (as the releases). Its expert bias
(`e_score_correction_bias`, zeros after transformers' init) is drawn at random, so that routing depends on it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, BOS_LIKE, EOS_TOKEN = SPECIAL_TOKENS
FAMILIES = ("qwen2", "qwen3_moe", "deepseek_v3")
DIGIT_SPLITS = ("bpe", "single")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    words = ("What is the answer sum of and Let Find compute Solve value number problem step think "
             "therefore final boxed integer real equation triangle circle area probability").split()
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "ing", "er", "ion", "al"]
    out = []
    for i in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        if i % 3 == 0:
            out.append(f"What is {a} + {b}? The answer is {a + b}.")
        elif i % 3 == 1:
            out.append(f"<think> {a} + {b} = {a + b} </think> <answer> \\boxed{{{a + b}}} </answer>")
        else:
            out.append(" ".join(rng.choice(words) for _ in range(12)) + f" $x^{a % 9} + \\frac{{{a}}}{{{b + 1}}}$")
        # Pseudo-words give the BPE trainer enough distinct merges to fill a 4096-entry vocabulary.
        out.append(" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(10)))
    return out


def train_tokenizer(vocab_size: int = 4096, seed: int = 0, *, digits: str = "bpe"):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` entries (special tokens first).

    Args:
        digits: one of DIGIT_SPLITS (module doc). "single" pre-splits every digit into its own piece, so no merge
            ever joins digits.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check_vocabulary(vocab_size, digits)
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if digits == "single" else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def _check_vocabulary(vocab_size: int, digits: str) -> None:
    if digits not in DIGIT_SPLITS:
        raise ValueError(f"digits {digits!r}: expected one of {', '.join(DIGIT_SPLITS)}")
    if vocab_size < 300:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least 300 entries")


def write_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 4096,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    digits: str = "bpe",
    family: str = "qwen2",
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    norm_topk_prob: bool = True,
    q_lora_rank: int | None = 64,
    kv_lora_rank: int = 512,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 32,
) -> Path:
    """Writes an HF folder (config, fp32 safetensors, tokenizer) to `out_dir` and returns it.

    `digits` is how the tokenizer splits numbers (DIGIT_SPLITS, see the module doc). `family` is one of
    `FAMILIES`; the `num_experts*`, `moe_intermediate_size` and `norm_topk_prob` arguments apply to the MoE
    families, the MLA sizes (`q_lora_rank` ... `v_head_dim`) to "deepseek_v3" only. `tie_word_embeddings` unset:
    tied, except for "deepseek_v3". `out_dir` must be empty or absent (a model is never written over other files).
    """
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r}: expected one of {', '.join(FAMILIES)}")
    if tie_word_embeddings is None:
        tie_word_embeddings = family != "deepseek_v3"
    _check_vocabulary(vocab_size, digits)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; give a new or empty one")
    import torch  # after the checks: a refused folder is said at once, not after torch's import

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_tokenizer(out, vocab_size, seed, digits)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )
    config_class, model_class = _classes(family)
    if family == "qwen3_moe":
        common.update(head_dim=hidden_size // num_attention_heads, num_experts=num_experts,
                      num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
                      norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    elif family == "deepseek_v3":
        rope_theta = common.pop("rope_theta")
        common.update(num_key_value_heads=num_attention_heads, n_routed_experts=num_experts, n_shared_experts=1,
                      num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
                      norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                      first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                      qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                      num_nextn_predict_layers=0, rope_interleave=True,
                      # YaRN as DeepSeek-V3's releases (factor 40 from 4096 positions, mscale = mscale_all_dim = 1),
                      # scaled to the tiny's 2048 positions.
                      rope_parameters={"rope_type": "yarn", "rope_theta": rope_theta, "factor": 4.0,
                                       "original_max_position_embeddings": max_position_embeddings // 4,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    torch.manual_seed(seed)
    model = model_class(config_class(**common)).to(torch.float32)
    if family == "deepseek_v3":
        _draw_expert_bias(model)
    model.save_pretrained(out, safe_serialization=True)
    _pin_tokenizer_class(out)
    if family == "deepseek_v3":
        _name_deepseek_routing(out)
    return out


def _save_tokenizer(out: Path, vocab_size: int, seed: int, digits: str):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size, seed, digits=digits), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[BOS_LIKE], chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def _classes(family: str) -> tuple[type, type]:
    """transformers' (config class, causal-LM class) of `family`."""
    import transformers

    prefix = {"qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}[family]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def _draw_expert_bias(model) -> None:
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.02 * torch.randn(buf.shape))


def _name_deepseek_routing(out: Path) -> None:
    # transformers' DeepSeek-V3 always routes with a sigmoid and the expert bias (noaux_tc) and does not write
    # that down; vLLM reads it from the config.json (its defaults: softmax, no bias), as DeepSeek's releases state it.
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _pin_tokenizer_class(out: Path) -> None:
    # Qwen2's own tokenizer class needs vocab.json/merges.txt; the fast generic class reads tokenizer.json
    # alone, which is what vLLM and transformers both accept without trust_remote_code.
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")

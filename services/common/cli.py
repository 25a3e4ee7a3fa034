"""Subcommands that need no service: `rlfabric tiny-model`."""

from __future__ import annotations

import argparse
import sys

from services.common.tiny_model import DIGIT_SPLITS, FAMILIES


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random Qwen2 (or Qwen3-MoE, DeepSeek-V3) model with a byte-level BPE tokenizer (tests, "
             "the demo)",
        description="Writes a seeded, randomly initialised Qwen2 (or, with --family qwen3_moe / deepseek_v3, "
        "Qwen3-MoE / DeepSeek-V3) model "
        "in HF layout, loadable by transformers, vLLM and Megatron, with a real byte-level BPE tokenizer carrying "
        "the ChatML special tokens. No hub access.",
    )
    p.add_argument("out_dir", help="output folder (created; must be empty if it exists)")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="model family (default qwen2)")
    p.add_argument("--num-experts", type=int, default=8, help="MoE families: routed experts (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="MoE families: experts per token (default 2)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer and embedding size (default 4096)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--num-layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer corpus (default 0)")
    p.add_argument("--digits", choices=DIGIT_SPLITS, default="bpe",
                   help="how numbers become tokens: bpe (merged like other text, the default) or single (one "
                        "token per digit: the learnable addition task of `make demo`)")
    p.set_defaults(func=_tiny_model)


def _tiny_model(args: argparse.Namespace) -> int:
    from services.common.tiny_model import write_tiny_model

    try:
        out = write_tiny_model(args.out_dir, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                               num_layers=args.num_layers, seed=args.seed, digits=args.digits,
                               family=args.family, num_experts=args.num_experts, num_experts_per_tok=args.top_k)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

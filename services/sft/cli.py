"""`rlfabric sft`: warm a small HF model up on (prompt, answer) rows before GRPO (see services/sft/train.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    from services.sft.train import LR_DECAY_STYLES, SftSettings

    d = SftSettings()
    p = subparsers.add_parser(
        "sft", help="supervised warm-up of a small HF model on (prompt, answer) rows (CPU, transformers)",
        description="Fine-tunes a Hugging Face causal LM on the answer tokens of (prompt, answer) rows and writes "
        "the model, its tokenizer and sft_summary.json (settings, final loss, held-out greedy accuracy) to OUT.")
    p.add_argument("model", type=Path, help="HF model folder to start from")
    p.add_argument("data", type=Path, help="rows (.jsonl/.json/.parquet) with a prompt and an answer field")
    p.add_argument("out", type=Path, help="output HF folder (replaced atomically)")
    p.add_argument("--held-out", type=Path, default=None, help="rows to measure greedy accuracy on at the end")
    p.add_argument("--prompt-key", default="problem", help="prompt field (default: problem)")
    p.add_argument("--answer-key", default="answer", help="answer field (default: answer)")
    p.add_argument("--template", default=d.template, help=f"prompt template from templates.json (default: {d.template})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default: {d.steps})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"rows per step (default: {d.batch_size})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW peak learning rate (default: {d.lr:g})")
    p.add_argument("--lr-decay-style", default=d.lr_decay_style, choices=LR_DECAY_STYLES,
                   help=f"decay to 0 at the last step (default: {d.lr_decay_style})")
    p.add_argument("--lr-warmup-iters", type=int, default=d.lr_warmup_iters,
                   help=f"linear warm-up steps (default: {d.lr_warmup_iters})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"default: {d.weight_decay:g}")
    p.add_argument("--stop-at-accuracy", type=float, default=None, metavar="ACC",
                   help="stop once greedy accuracy on the first --check-rows TRAINING rows reaches ACC "
                        "(checked every --check-every steps; --steps is then a cap)")
    p.add_argument("--check-every", type=int, default=d.check_every, help=f"default: {d.check_every}")
    p.add_argument("--check-rows", type=int, default=d.check_rows, help=f"default: {d.check_rows}")
    p.add_argument("--seed", type=int, default=d.seed, help=f"batch order and init seed (default: {d.seed})")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_sft)


def _read_rows(path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    from services.common.errors import DataError
    from services.data.readers import open_rows

    rows = []
    for row in open_rows(path):
        missing = [k for k in (prompt_key, answer_key) if k not in row.data]
        if missing:
            raise DataError(f"{row.where}: no field {missing[0]!r}; the row has {sorted(row.data)}")
        rows.append((str(row.data[prompt_key]), str(row.data[answer_key])))
    return rows


def _sft(args: argparse.Namespace) -> int:
    from services.common.errors import DataError
    from services.sft.train import SftSettings, train

    for name in ("steps", "batch_size", "check_every", "check_rows"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        rows = _read_rows(args.data, args.prompt_key, args.answer_key)
        held_out = _read_rows(args.held_out, args.prompt_key, args.answer_key) if args.held_out else []
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = SftSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, lr_decay_style=args.lr_decay_style,
                           lr_warmup_iters=args.lr_warmup_iters, weight_decay=args.weight_decay, seed=args.seed,
                           template=args.template, stop_at_accuracy=args.stop_at_accuracy,
                           check_every=args.check_every, check_rows=args.check_rows)

    def progress(step: int, loss: float) -> None:
        if not args.quiet:
            print(f"sft step {step}/{settings.steps} | loss {loss:.4f}", flush=True)

    import torch

    torch.set_num_threads(1)
    result = train(args.model, rows, args.out, settings, held_out_rows=held_out, progress=progress)
    acc = "" if result.held_out_greedy_accuracy is None else (
        f", held-out greedy accuracy {result.held_out_greedy_accuracy:.3f} on {result.held_out_rows} rows")
    stopped = "" if result.train_check_accuracy is None else (
        f" (stopped at train-check accuracy {result.train_check_accuracy:.3f})")
    print(f"sft: {result.steps_run} steps{stopped} x {settings.batch_size} rows, AdamW lr {settings.lr:g} "
          f"({settings.lr_decay_style}, warm-up {settings.lr_warmup_iters}), final loss "
          f"{result.final_loss:.4f}{acc}, {result.seconds:.0f} s -> {args.out}", flush=True)
    return 0

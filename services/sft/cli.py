"""`rlfabric sft`: warm a small HF model up on (prompt, answer) rows before GRPO (see services/sft/train.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Flags that set an SftSettings field: (flag, field, type, help). Unset flags keep the recipe's (or the
# default) value, so `--recipe addition --steps 500` changes the steps only.
_SETTING_FLAGS = (
    ("--template", "template", str, "prompt template from templates.json"),
    ("--steps", "steps", int, "optimizer steps (a cap with --stop-at-accuracy)"),
    ("--batch-size", "batch_size", int, "rows per step"),
    ("--lr", "lr", float, "AdamW peak learning rate"),
    ("--lr-decay-style", "lr_decay_style", str, "constant, linear or cosine (to 0 at the last step)"),
    ("--lr-warmup-iters", "lr_warmup_iters", int, "linear warm-up steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay"),
    ("--stop-at-accuracy", "stop_at_accuracy", float,
     "stop once greedy accuracy on the first --check-rows TRAINING rows reaches this"),
    ("--check-every", "check_every", int, "steps between those checks"),
    ("--check-rows", "check_rows", int, "training rows the check reads"),
    ("--seed", "seed", int, "batch order and init seed"),
)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    from services.sft.train import RECIPES, SftSettings

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
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="start from named settings (addition: the warm-up of `make demo`); flags override them")
    for flag, name, kind, text in _SETTING_FLAGS:
        p.add_argument(flag, dest=name, type=kind, default=None, help=f"{text} (default: {getattr(d, name)})")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_sft)


def settings_from_args(args: argparse.Namespace):
    """The recipe's settings (or the defaults) with every flag given on the command line; ValueError if bad."""
    import dataclasses

    from services.sft.train import LR_DECAY_STYLES, RECIPES, SftSettings

    base = RECIPES[args.recipe] if args.recipe else SftSettings()
    given = {name: getattr(args, name) for _, name, _, _ in _SETTING_FLAGS if getattr(args, name) is not None}
    settings = dataclasses.replace(base, **given)
    for name in ("steps", "batch_size", "check_every", "check_rows"):
        if getattr(settings, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    if settings.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style {settings.lr_decay_style!r}: expected one of {', '.join(LR_DECAY_STYLES)}")
    return settings


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
    from services.common.model_paths import require_model_dir
    from services.sft.train import train

    try:
        require_model_dir(args.model, "model")  # before transformers, which would take it for a hub id
        settings = settings_from_args(args)
        rows = _read_rows(args.data, args.prompt_key, args.answer_key)
        held_out = _read_rows(args.held_out, args.prompt_key, args.answer_key) if args.held_out else []
    except (DataError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

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

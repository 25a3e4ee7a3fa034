"""Synthetic arithmetic prompts for the demo, the tests and the benchmarks.

Two tasks: the benchmarks' W1 form ("What is A + B? The answer is", A, B up to 999), which exercises every
service; and the W2 learning race ("A+B=", A, B in 0..99), which a tiny model learns: `make demo` warms it
up on the train split, then GRPO improves it and the held-out split measures by how much.
Rows look like DeepScaleR's (`problem`, `answer`), so they go through the stock `deepscaler.yaml`
preprocessing (with `prompt_type: empty` to keep the prompt as is).
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic_rows(count: int, *, seed: int = 0, max_operand: int = 999) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"problem": f"What is {a} + {b}? The answer is", "answer": str(a + b)})
    return rows


def write_arithmetic_jsonl(path: str | Path, count: int, *, seed: int = 0, max_operand: int = 999) -> Path:
    return write_rows_jsonl(path, arithmetic_rows(count, seed=seed, max_operand=max_operand))


def write_rows_jsonl(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """Writes `rows` as JSONL, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def addition_split(*, held_out: int = 500, max_operand: int = 99, seed: int = 0) -> tuple[list[dict[str, str]],
                                                                                            list[dict[str, str]]]:
    """The W2 task, every problem "A+B=" (A, B in 0..max_operand) once: (train rows, held-out rows).

    The pairs are shuffled with `seed` and the first `held_out` of them are held out, so no held-out problem
    is ever trained on (neither in the warm-up nor by GRPO).
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < held_out < len(pairs):
        raise ValueError(f"held_out must be in 1..{len(pairs) - 1}, got {held_out}")
    random.Random(seed).shuffle(pairs)
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return rows[held_out:], rows[:held_out]


def write_addition_task(out_dir: str | Path, *, held_out: int = 500, seed: int = 0) -> tuple[Path, Path]:
    """Writes `train.jsonl` and `heldout.jsonl` of `addition_split` under `out_dir`; returns both paths."""
    train, test = addition_split(held_out=held_out, seed=seed)
    out = Path(out_dir)
    return write_rows_jsonl(out / "train.jsonl", train), write_rows_jsonl(out / "heldout.jsonl", test)

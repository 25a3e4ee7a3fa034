"""Synthetic arithmetic prompts (the benchmarks' W1 form) for the demo, the smoke tests and the benchmarks.

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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(count, seed=seed, max_operand=max_operand)))
    tmp.replace(path)
    return path

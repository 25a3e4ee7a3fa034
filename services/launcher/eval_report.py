"""What `rlfabric eval` writes: every sample (JSONL), the figures (JSON) and the table (markdown).

The table has the shape of the seed's tables (one row per dataset, plain columns):

| dataset | problems | n | pass@1 | pass@8 | mean@8 | mean length | left out |
|---|---|---|---|---|---|---|---|

Files are written under temporary names and renamed into place, so a crash never leaves half a result.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO


def _pass_keys(results: Mapping[str, Mapping[str, float]]) -> list[str]:
    keys = {k for figures in results.values() for k in figures if k.startswith("pass@")}
    return sorted(keys, key=lambda k: int(k.split("@")[1]))


def markdown_table(results: Mapping[str, Mapping[str, float]], settings: Any) -> str:
    """One row per dataset: problems, samples per problem, pass@k columns, mean@n, mean length, left out."""
    passes = _pass_keys(results)
    mean = f"mean@{settings.n}"
    header = ["dataset", "problems", "n", *passes, mean, "mean length", "left out (too long)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, f in results.items():
        row = [name, f"{f['problems']:.0f}", str(settings.n), *(f"{f[k]:.4f}" for k in passes), f"{f[mean]:.4f}",
               f"{f['response_length/mean']:.1f}", f"{f.get('left_out_too_long', 0):.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def describe(settings: Any, model: str) -> str:
    """One line saying what was measured."""
    how = "greedy" if settings.temperature == 0 else f"temperature {settings.temperature:g}, top-p {settings.top_p:g}"
    rules = ", ".join(name for name, _ in settings.verifiers)
    return (f"model {model}: {settings.n} sample(s) per problem, {how}, at most {settings.max_tokens} tokens, "
            f"scored by {rules} (correct: reward >= {settings.threshold:g})")


def print_table(results: Mapping[str, Mapping[str, float]], settings: Any, model: str,
                stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    print(describe(settings, model), file=out)
    print(markdown_table(results, settings), file=out, end="", flush=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_outputs(out: Path, samples: Sequence[Any], results: Mapping[str, Mapping[str, float]], settings: Any, *,
                  model: str, template: str, seconds: float) -> None:
    """samples.jsonl, results.json and results.md under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in samples:
        row = dataclasses.asdict(s)
        row["correct"] = s.reward >= settings.threshold
        rows.append(json.dumps(row, ensure_ascii=False))
    _write_atomically(out / "samples.jsonl", "\n".join(rows) + "\n")
    summary = {"model": model, "template": template, "seconds": round(seconds, 3),
               "settings": dataclasses.asdict(settings), "results": results}
    _write_atomically(out / "results.json", json.dumps(summary, indent=2) + "\n")
    _write_atomically(out / "results.md", describe(settings, model) + "\n\n" + markdown_table(results, settings))

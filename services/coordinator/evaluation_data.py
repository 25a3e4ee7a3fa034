"""Evaluation problems: the named eval sets, reading rows, rendering prompts with the seed's templates.

The named sets are the files of `../shared/data/eval/` (see its README): MATH-500, AIME 2024 and 2025, AMC,
Minerva Math and OlympiadBench. Any other .json/.jsonl/.parquet file with a problem and an answer field
works too (for example the held-out split of `make demo`). Answers come in several shapes across these files
and are turned into the one ground-truth text a verifier reads:
- text stays as written; a float with an integral value loses its ".0" (AMC's `27.0` -> "27");
- a list of one answer is that answer (Minerva); a longer list (OlympiadBench's multiple answers) is joined
  with ", ", the form a response lists them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import DataError

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "eval"

# Name -> file under the eval directory.
EVAL_SETS: dict[str, str] = {
    "math500": "math500_deepscaler.json",
    "aime2024": "aime2024_deepscaler.json",
    "aime2025": "aime25_qwen-eval.jsonl",
    "amc": "amc2022-23_deepscaler.json",
    "amc23": "amc23_qwen-eval.jsonl",
    "minerva": "minerva_deepscaler.json",
    "olympiadbench": "olympiad_bench_deepscaler.json",
}


@dataclass(frozen=True)
class EvalProblem:
    """One problem: where it comes from, its text, the ground truth, and the prompt token ids."""

    dataset: str
    index: int
    problem: str
    answer: str
    prompt_ids: np.ndarray  # int32 [prompt_length]


def resolve_dataset(spec: str, eval_dir: Path = DEFAULT_EVAL_DIR) -> tuple[str, Path]:
    """(name, path) of a named eval set or of a file path; DataError listing the names otherwise."""
    if spec in EVAL_SETS:
        path = (eval_dir / EVAL_SETS[spec]).resolve()
        if not path.is_file():
            raise DataError(f"eval set {spec!r}: {path} not found; pass --eval-dir DIR holding {EVAL_SETS[spec]}")
        return spec, path
    path = Path(spec)
    if path.is_file():
        return path.stem, path
    raise DataError(f"--dataset {spec!r} is neither a named eval set ({', '.join(EVAL_SETS)}) nor a file")


def answer_text(value: Any, where: str) -> str:
    """The ground truth as text (see module doc); DataError naming the row for other shapes."""
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: answer {value!r} is not text, a number or a list of them")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, list | tuple) and value:
        return ", ".join(answer_text(v, where) for v in value)
    raise DataError(f"{where}: answer {value!r} is not text, a number or a non-empty list of them")


def load_problems(name: str, path: Path, tokenizer: Any, template: str, *, prompt_key: str = "problem",
                  answer_key: str = "answer", limit: int | None = None,
                  max_prompt_length: int | None = None) -> tuple[list[EvalProblem], int]:
    """The problems of one file with their prompts, and how many were left out as too long.

    Args:
        template: a name from configs/model/templates.json (the prompt is `template(problem)`).
        limit: keep the first `limit` rows (None: all).
        max_prompt_length: leave out prompts of this many tokens or more (they leave no room to answer).
    """
    from services.data.readers import open_rows
    from services.data.templates import get_template

    tmpl = get_template(template)
    problems: list[EvalProblem] = []
    too_long = 0
    for row in open_rows(path):
        if limit is not None and len(problems) + too_long >= limit:
            break
        data: Mapping[str, Any] = row.data
        for key in (prompt_key, answer_key):
            if key not in data:
                raise DataError(f"{row.where}: no field {key!r}; the row has {sorted(data)}")
        if not isinstance(data[prompt_key], str) or not data[prompt_key].strip():
            raise DataError(f"{row.where}: field {prompt_key!r} must be non-empty text")
        ids = np.asarray(tmpl.encode_prompt(tokenizer, data[prompt_key]), dtype=np.int32)
        if max_prompt_length is not None and len(ids) >= max_prompt_length:
            too_long += 1
            continue
        problems.append(EvalProblem(name, row.index, data[prompt_key], answer_text(data[answer_key], row.where), ids))
    if not problems:
        raise DataError(f"{path}: no problem to evaluate ({too_long} prompts too long)")
    return problems, too_long

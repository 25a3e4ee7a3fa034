"""`rlfabric sft`: the learning-rate schedule, the answer-only labels, a short run that learns, recipes and
flags, and clear errors for bad rows."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.sft.train import IGNORE_INDEX, RECIPES, Example, SftSettings, collate, lr_factor, train


@pytest.mark.parametrize(("style", "warm", "step", "expected"), [
    ("constant", 4, 1, 0.25),   # warm-up: step / warm
    ("constant", 4, 4, 1.0),
    ("constant", 4, 9, 1.0),
    ("linear", 0, 1, 1.0),      # progress (step - 1) / steps: 0 at the first step ...
    ("linear", 0, 10, 0.1),     # ... 9/10 at the last of 10
    ("cosine", 0, 1, 1.0),
    ("cosine", 0, 6, 0.5),      # progress 5/10: (1 + cos(pi/2)) / 2
    ("linear", 2, 3, 1.0),      # decay starts after the warm-up: progress 0 at step 3
])
def test_lr_factor(style: str, warm: int, step: int, expected: float) -> None:
    settings = SftSettings(steps=10, lr_decay_style=style, lr_warmup_iters=warm)
    assert lr_factor(step, settings) == pytest.approx(expected)


def test_collate_labels_the_answer_and_eos_only() -> None:
    ids, mask, labels = collate([Example([5, 6], [7, 2]), Example([5], [8, 9, 2])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 2], [5, 8, 9, 2]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 7, 2], [IGNORE_INDEX, 8, 9, 2]]
    ids, mask, labels = collate([Example([5], [2]), Example([5, 6, 7], [2])], pad_id=0)
    assert ids.tolist()[0] == [5, 2, 0, 0] and mask.tolist()[0] == [1, 1, 0, 0]
    assert labels.tolist()[0] == [IGNORE_INDEX, 2, IGNORE_INDEX, IGNORE_INDEX]


def test_a_short_run_learns_and_writes_a_loadable_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [(f"{a}+{a}=", str(2 * a)) for a in range(8)]
    losses: list[float] = []
    settings = SftSettings(steps=40, batch_size=8, lr=3e-3)
    result = train(tiny_model_dir, rows, tmp_path / "out", settings, held_out_rows=rows,
                   progress=lambda step, loss: losses.append(loss), progress_every=10)
    assert result.steps_run == 40 and len(losses) == 4
    assert losses[-1] < 0.5 * losses[0]
    assert 0.0 <= result.held_out_greedy_accuracy <= 1.0 and result.held_out_rows == 8
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["settings"]["lr"] == 3e-3 and summary["steps_run"] == 40
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # The source's tokenizer files, as they were (its pinned class is the one vLLM loads without remote code).
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == (
        tiny_model_dir / "tokenizer_config.json").read_text()
    a, b = AutoTokenizer.from_pretrained(tmp_path / "out"), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert a("12+34=")["input_ids"] == b("12+34=")["input_ids"]


def test_stop_at_accuracy_stops_at_the_first_check(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [("1+1=", "2")] * 4
    settings = SftSettings(steps=100, batch_size=4, stop_at_accuracy=0.0, check_every=5, check_rows=2)
    result = train(tiny_model_dir, rows, tmp_path / "out", settings)
    assert result.steps_run == 5 and result.train_check_accuracy is not None


def test_recipe_and_flags() -> None:
    from services.sft.cli import _SETTING_FLAGS, settings_from_args

    args = argparse.Namespace(recipe="addition", **{name: None for _, name, _, _ in _SETTING_FLAGS})
    assert settings_from_args(args) == RECIPES["addition"]
    args.steps = 500
    assert settings_from_args(args).steps == 500 and settings_from_args(args).lr == RECIPES["addition"].lr
    args.batch_size = 0
    with pytest.raises(ValueError, match="--batch-size must be >= 1"):
        settings_from_args(args)


def test_cli_names_a_row_without_the_answer_field(tiny_model_dir: Path, tmp_path: Path, repo_root: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n" + json.dumps({"problem": "2+2="}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "sft", str(tiny_model_dir), str(data),
                           str(tmp_path / "out")], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "rows.jsonl" in proc.stderr and "'answer'" in proc.stderr
    assert not (tmp_path / "out").exists()

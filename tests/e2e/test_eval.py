"""`rlfabric eval` end to end: it starts a rollout replica and a reward worker, samples MATH-500 and AIME 2024
problems with the qwen_r1 template, scores them, and writes every sample plus a table whose figures follow
from those samples (pass@k recomputed here from the JSONL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.coordinator.pass_at_k import dataset_pass_at_k


def test_eval_writes_samples_and_a_consistent_table(tiny_model_dir: Path, shared_data: Path, repo_root: Path,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "--model", str(tiny_model_dir), "--dataset", "math500",
         "--dataset", "aime2024", "--eval-dir", str(shared_data / "eval"), "--limit", "5", "-n", "3", "--k", "1",
         "--k", "3", "--max-tokens", "16", "--seed", "7", "--verifier-function", "math_equiv", "--out", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 5 * 3
    assert {(r["dataset"], r["index"], r["sample"]) for r in rows} == {
        (d, i, s) for d in ("math500", "aime2024") for i in range(5) for s in range(3)}
    assert all(0 < r["response_length"] <= 16 and r["scores"].keys() == {"math_equiv"} for r in rows)
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["seed"] == 7 and results["settings"]["temperature"] == 1.0
    for dataset in ("math500", "aime2024"):
        mine = [r for r in rows if r["dataset"] == dataset]
        correct = [sum(r["correct"] for r in mine if r["index"] == i) for i in range(5)]
        figures = results["results"][dataset]
        assert figures["problems"] == 5
        assert figures["pass@1"] == pytest.approx(dataset_pass_at_k(correct, 3, 1))
        assert figures["pass@3"] == pytest.approx(dataset_pass_at_k(correct, 3, 3))
        assert figures["mean@3"] == pytest.approx(sum(r["reward"] for r in mine) / 15)
    table = (out / "results.md").read_text()
    assert "| dataset | problems | n | pass@1 | pass@3 | mean@3 |" in table
    assert "| math500 | 5 | 3 |" in table and "| aime2024 | 5 | 3 |" in table
    assert "| math500 | 5 | 3 |" in proc.stdout


def test_eval_refuses_bad_flags(repo_root: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--model", str(tiny_model_dir), "-n", "2",
                           "--k", "4"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--k 4: k must be in 1..n (2)" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--model", str(tiny_model_dir), "--dataset",
                           "no-such-set"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "neither a named eval set" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.cli", "eval", "--model", str(tmp_path)], cwd=repo_root,
                          capture_output=True, text=True, timeout=300)  # a folder that is not a model
    assert proc.returncode == 2 and "has no config.json" in proc.stderr, proc.stderr

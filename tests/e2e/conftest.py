"""Fixtures for whole-system runs: an arithmetic prompt set preprocessed for the session's tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.data.synthetic import write_arithmetic_jsonl


@pytest.fixture(scope="session")
def arith_prefix(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """64 "What is A + B? The answer is" prompts (W1's form) with their sums as labels, preprocessed."""
    root = tmp_path_factory.mktemp("arith")
    write_arithmetic_jsonl(root / "arith.jsonl", 64)
    prefix = root / "data" / "arith"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/deepscaler.yaml",
         "--set", f"input={root / 'arith.jsonl'}", "--set", f"tokenizer_name_or_path={tiny_model_dir}",
         "--set", f"output_prefix={prefix}", "--set", "prompt_type=empty", "--set", "workers=1", "--quiet"],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return prefix

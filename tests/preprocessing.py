"""Preprocessing a test's JSONL rows the way a user does (`rlfabric preprocess` with the DeepScaleR dataset YAML)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def preprocess_jsonl(repo_root: Path, jsonl: Path, tokenizer_dir: Path, prefix: Path) -> Path:
    """Rows with `problem`/`answer` fields -> Megatron indexed prompts and labels at `prefix`, no prompt template."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/deepscaler.yaml",
         "--set", f"input={jsonl}", "--set", f"tokenizer_name_or_path={tokenizer_dir}",
         "--set", f"output_prefix={prefix}", "--set", "prompt_type=empty", "--set", "workers=1", "--quiet"],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return prefix

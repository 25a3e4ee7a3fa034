"""Upstream MindSpeed-RL configs held as text in the tests, written where their `defaults: model:` include resolves."""

from __future__ import annotations

from pathlib import Path


def write_upstream(repo_root: Path, tmp_path: Path, name: str, text: str, model: str = "qwen25_32b") -> Path:
    """`text` as `tmp_path/name`, beside the reference copy of MindSpeed-RL's model block `model` (as in its
    configs/ folder)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    block = repo_root.parent / f"shared/reference/mindspeed_rl/configs/model/{model}.yaml"
    (tmp_path / "model" / f"{model}.yaml").write_text(block.read_text())
    path = tmp_path / name
    path.write_text(text)
    return path

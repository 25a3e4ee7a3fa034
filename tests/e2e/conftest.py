"""Whole-system runs: their prompt set (`arith_prefix`) is the session's, in tests/conftest.py; the demo's
supervised warm-up (`addition_warmup`, ~80 s) is shared by the learning and reproducibility runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.addition_work import write_addition_work


@pytest.fixture(scope="session")
def addition_warmup(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """`make demo`'s work folder up to its GRPO step (tests/e2e/addition_work.py)."""
    return write_addition_work(tmp_path_factory.mktemp("addition"), repo_root)

"""Session-wide fixtures: the repo, shared data, one private Redis, one tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Several services share 2 cores in CI: one torch thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = (REPO_ROOT / ".." / "shared" / "data").resolve()
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path}: the repo must sit beside shared/")
    return path


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from services.common.redis_store import start_private_redis

    server = start_private_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))

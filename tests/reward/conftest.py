"""Fixtures of the reward tests: plugin specs for misbehaving verifiers, real cases, a running worker."""

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FAULTY = Path(__file__).with_name("faulty_verifiers.py")
FAULTY_PLUGINS = {name: f"{FAULTY}:{name}" for name in ("sleep_forever", "raise_error", "return_nan", "kill_process", "sleepy")}


@pytest.fixture(scope="session")
def faulty_plugins() -> dict[str, str]:
    """Plugin specs (name -> "/path/faulty_verifiers.py:function") for the misbehaving verifiers."""
    return dict(FAULTY_PLUGINS)


@pytest.fixture(scope="session")
def verifier_cases(shared_data: Path) -> list[dict]:
    with (shared_data / "verifier_cases.jsonl").open() as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def strict_cases(verifier_cases: list[dict]) -> list[dict]:
    """Not disputed and no convention_dependent reason: 341 cases (README of the shared data)."""
    return [c for c in verifier_cases if not c.get("disputed") and not c.get("convention_dependent")]


@pytest.fixture(scope="session")
def raw_responses(shared_data: Path) -> list[dict]:
    """The 800 real Qwen2.5-Math responses as {response, ground_truth, score} records."""
    records = []
    with (shared_data / "verifier" / "raw" / "qwen25math_math_cot_100_responses.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            for response, verdict in zip(row["code"], row["score"], strict=True):
                records.append({"response": response, "ground_truth": row["gt"], "score": verdict})
    return records


@pytest.fixture(scope="module")
def reward_worker(redis_url: str) -> Iterator["object"]:
    """An in-process reward worker with two pool processes, the faulty plugins and a token."""
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    options = RewardWorkerOptions(processes=2, redis_url=redis_url, auth_token="s3cret", plugins=FAULTY_PLUGINS,
                                  deadline_s=5.0, registry_poll_s=0.2, metrics_port=0)
    with RewardWorker(options) as worker:
        yield worker


@pytest.fixture
def external_verifier(repo_root: Path):
    """The example custom verifier, as a separate process; yields its endpoint."""
    script = repo_root / "examples" / "verifiers" / "last_number_verifier.py"
    process = subprocess.Popen([sys.executable, str(script), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on (\S+:\d+)", line)
        assert match, f"unexpected first line from the verifier: {line!r}"
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=10)

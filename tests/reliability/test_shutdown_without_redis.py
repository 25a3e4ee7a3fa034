"""SIGTERM of a service whose Redis is gone: it exits within its drain timeout.

Deregistration on shutdown used to retry for the Redis client's whole retry window (REDIS_RETRY_WINDOW_S,
60 s), so a reward worker took 70-74 s to exit, past its own --drain-timeout-s 30 and Kubernetes' 30 s grace.
`Registration.close` now gives up after DEREGISTER_TIMEOUT_S (the lease ends the registration anyway).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.redis_store import REDIS_RETRY_WINDOW_S, Registry, connect, start_private_redis

DRAIN_TIMEOUT_S = 20.0  # well under the retry window, so the old behaviour cannot pass
assert DRAIN_TIMEOUT_S < REDIS_RETRY_WINDOW_S


def serve_args(service: str, model: Path, tmp_path: Path) -> list[str]:
    """`rlfabric SERVICE serve` flags (the drain timeout of each: reward's flag, the others' 10 s stop grace)."""
    return {
        "reward": ["reward", "serve", "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--worker-id", "gone-redis"],
        "coordinator": ["coordinator", "serve", "--instance-id", "gone-redis", "--insecure", "--runs-dir",
                        str(tmp_path / "runs")],
        "rollout": ["rollout", "serve", "--model", str(model), "--dtype", "float32", "--tensor-parallel-size", "1",
                    "--max-model-len", "256", "--max-num-seqs", "4", "--num-threads", "1", "--instance-id", "gone-redis",
                    "--insecure"],
        "trainer": ["trainer", "serve", "--hf-dir", str(model), "--instance-id", "gone-redis", "--insecure"],
    }[service]


# Rollout and trainer load vLLM / Megatron (tens of seconds): `make soak`. They deregister the same way.
@pytest.mark.parametrize("service", ["coordinator", "reward", pytest.param("rollout", marks=pytest.mark.slow),
                                     pytest.param("trainer", marks=pytest.mark.slow)])
def test_sigterm_with_redis_stopped_exits_within_the_drain_timeout(service: str, repo_root: Path,
                                                                  tiny_model_dir: Path, tmp_path: Path) -> None:
    if service == "rollout":
        pytest.importorskip("vllm")
    redis_server = start_private_redis()
    log = tmp_path / f"{service}.log"
    argv = [sys.executable, "-m", "services.cli", "--log-level", "INFO", *serve_args(service, tiny_model_dir, tmp_path),
            "--redis-url", redis_server.url, "--address", "127.0.0.1:0"]
    proc = subprocess.Popen(argv, cwd=repo_root, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        registry = Registry(connect(redis_server.url))
        deadline = time.monotonic() + 300
        while not registry.members(service):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        redis_server.stop()
        stopped = time.monotonic()
        proc.terminate()
        code = proc.wait(timeout=DRAIN_TIMEOUT_S)  # raises TimeoutExpired where the old code retried for 60 s
        print(f"{service} exited {time.monotonic() - stopped:.1f} s after SIGTERM")
        assert code == 0, log.read_text()[-3000:]
        assert "did not deregister" in log.read_text()  # it said why it left its registration to the lease
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        redis_server.stop()

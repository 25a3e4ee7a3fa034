"""A reward worker removed at run time (SIGTERM, as `rlfabric system scale reward N` sends) drains: it
deregisters, the coordinator's pool sends it nothing new and half-closes its stream, it answers every sample
it holds and exits. Nothing is re-sent (so nothing could be scored twice) and nothing is lost."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rlfabric.v1 import reward_pb2
from services.common.redis_store import Registry, connect
from services.coordinator.reward_pool import RewardClientPool

SLEEPY = Path(__file__).resolve().parents[1] / "reward" / "faulty_verifiers.py"


def start_worker(repo_root: Path, redis_url: str, worker_id: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--log-level", "INFO", "reward", "serve", "--redis-url", redis_url,
         "--worker-id", worker_id, "--processes", "2", "--verifier-plugin", f"sleepy={SLEEPY}:sleepy"],
        cwd=repo_root, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_sigterm_drains_the_samples_a_worker_holds(repo_root: Path, redis_url: str, tmp_path: Path) -> None:
    registry = Registry(connect(redis_url))
    procs = {w: start_worker(repo_root, redis_url, w, tmp_path / f"{w}.log") for w in ("stays", "leaves")}
    try:
        deadline = time.monotonic() + 90
        while {m.instance_id for m in registry.members("reward")} != set(procs):
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.1)
        pool = RewardClientPool(registry, refresh_s=0.2)
        count = 40
        sent_sigterm = []

        def requests():
            for i in range(count):
                # Each takes 0.5 s: when SIGTERM comes, "leaves" holds samples it has not answered yet.
                yield reward_pb2.ScoreRequest(sample_id=f"s/{i}", response=f"0.5:{'ok' if i % 2 else 'no'}",
                                              ground_truth="ok", verifiers=[reward_pb2.VerifierSpec(name="sleepy",
                                                                                                    weight=1.0)])
                if i == count // 2:
                    time.sleep(0.3)
                    procs["leaves"].terminate()
                    sent_sigterm.append(time.monotonic())

        answers = Counter()
        after_sigterm = Counter()  # answers per worker that arrived after SIGTERM was sent
        for response in pool.score(requests()):
            answers[response.sample_id] += 1
            assert [s.error for s in response.scores] == [""]
            assert response.reward == (1.0 if int(response.sample_id.split("/")[1]) % 2 else 0.0)
            if sent_sigterm:
                after_sigterm[response.worker_id] += 1
        assert procs["leaves"].wait(timeout=60) == 0
        assert answers == Counter({f"s/{i}": 1 for i in range(count)})
        stats = pool.stats
        # Nothing was re-sent (so nothing could be scored twice): the leaving worker answered all it was sent,
        # including samples it held when SIGTERM came. (`stats.drained` counts the stream's end only when it
        # comes before the session's last answer, so it is not asserted.)
        assert stats.workers_lost == 0 and stats.resent == 0 and stats.hedged == 0, stats
        assert stats.per_worker["leaves"] > 0 and sum(stats.per_worker.values()) == count
        assert after_sigterm["leaves"] > 0, after_sigterm
        log = (tmp_path / "leaves.log").read_text()
        assert f"scored {stats.per_worker['leaves']} verifications" in log, log[-2000:]
        assert {m.instance_id for m in registry.members("reward")} == {"stays"}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)

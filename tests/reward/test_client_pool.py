"""The coordinator-side pool over separately started workers: failover, dedup, joining mid-stream."""

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rlfabric.v1 import reward_pb2
from services.common.redis_store import Registry, connect
from services.coordinator.reward_pool import RewardClientPool

SLEEPY_PLUGIN = f"sleepy={Path(__file__).with_name('faulty_verifiers.py')}:sleepy"


class WorkerProcess:
    """`python -m services.reward` as a separate process, registered in Redis under `worker_id`."""

    def __init__(self, repo_root: Path, redis_url: str, worker_id: str, log_dir: Path) -> None:
        self.worker_id = worker_id
        self.log = (log_dir / f"{worker_id}.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "--redis-url", redis_url, "--worker-id", worker_id,
             "--processes", "1", "--lease-s", "2", "--log-level", "WARNING", "--verifier-plugin", SLEEPY_PLUGIN],
            cwd=repo_root, stdout=self.log, stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()


def wait_registered(registry: Registry, worker_ids: set[str], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not worker_ids <= {m.instance_id for m in registry.members("reward")}:
        assert time.monotonic() < deadline, f"workers {worker_ids} did not register within {timeout_s} s"
        time.sleep(0.1)


@pytest.fixture
def spawn(repo_root, redis_url, tmp_path):
    started: list[WorkerProcess] = []

    def start(worker_id: str) -> WorkerProcess:
        worker = WorkerProcess(repo_root, redis_url, worker_id, tmp_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def sample_requests(raw_responses, count: int, prefix: str):
    for i, record in zip(range(count), itertools.cycle(raw_responses)):
        yield reward_pb2.ScoreRequest(
            sample_id=f"{prefix}/{i}", response=record["response"], ground_truth=record["ground_truth"],
            verifiers=[reward_pb2.VerifierSpec(name="math_equiv", weight=1.0)])


def run_kill_one_of_two(spawn, redis_url, raw_responses, count: int) -> None:
    registry = Registry(connect(redis_url))
    victim, survivor = spawn(f"victim-{count}"), spawn(f"survivor-{count}")
    wait_registered(registry, {victim.worker_id, survivor.worker_id})
    pool = RewardClientPool(registry, max_inflight_per_worker=32, refresh_s=0.2)
    answers = Counter()
    for response in pool.score(sample_requests(raw_responses, count, f"kill{count}")):
        answers[response.sample_id] += 1
        assert [s.error for s in response.scores] == [""]
        assert response.reward in (0.0, 1.0)
        if sum(answers.values()) == count // 4:
            victim.kill()  # mid-stream: both workers hold samples in flight now
    assert set(answers) == {f"kill{count}/{i}" for i in range(count)}
    assert set(answers.values()) == {1}  # every sample exactly one score
    assert pool.stats.workers_lost == 1 and pool.stats.resent > 0  # failover really happened
    assert pool.stats.per_worker.get(survivor.worker_id, 0) > count // 2


def test_sigkill_of_one_of_two_workers_mid_stream_of_2000(spawn, redis_url, raw_responses):
    run_kill_one_of_two(spawn, redis_url, raw_responses, 2000)


def sleepy_requests(count: int, prefix: str, first_s: float, then_s: float):
    """`count` samples of the `sleepy` plugin: the first two take `first_s`, the rest `then_s`; every
    third is wrong (reward 0), so a score handed to the wrong sample shows."""
    for i in range(count):
        seconds = first_s if i < 2 else then_s
        yield reward_pb2.ScoreRequest(sample_id=f"{prefix}/{i}", response=f"{seconds}:{'wrong' if i % 3 else 'ok'}",
                                      ground_truth="ok", verifiers=[reward_pb2.VerifierSpec(name="sleepy", weight=1.0)])


def test_sigkill_before_the_first_answer_fails_over_within_seconds_once_per_sample(spawn, redis_url):
    # The pool's defaults, as the coordinator uses them (a 60 s sample timeout among them): the victim
    # dies while it holds half the samples and has answered none on this stream. Its stream must fail
    # at once (no gRPC retry policy holding the call open), its samples go to the survivor once each.
    registry = Registry(connect(redis_url))
    victim, _survivor = spawn("victim"), spawn("survivor")
    wait_registered(registry, {"victim", "survivor"})
    count = 60
    normal_pool = RewardClientPool(registry)
    started = time.monotonic()
    normal = Counter(r.sample_id for r in normal_pool.score(sleepy_requests(count, "normal", 1.0, 0.05)))
    normal_s = time.monotonic() - started
    assert len(normal) == count and normal_pool.stats.per_worker.keys() == {"victim", "survivor"}

    pool = RewardClientPool(registry)
    killed_at = []

    def requests():
        yield from sleepy_requests(count, "kill", 1.0, 0.05)
        time.sleep(0.3)  # dispatched to both workers; the first answers take 1 s
        killed_at.append(time.monotonic())
        victim.kill()

    started = time.monotonic()
    answers = Counter()
    for response in pool.score(requests()):
        answers[response.sample_id] += 1
        index = int(response.sample_id.split("/")[1])
        assert [s.error for s in response.scores] == [""]
        assert response.reward == (0.0 if index % 3 else 1.0)  # its own score, not a neighbour's
    killed_s = time.monotonic() - started
    assert answers == Counter({f"kill/{i}": 1 for i in range(count)})  # every id, exactly once
    stats = pool.stats
    assert stats.workers_lost == 1 and stats.gave_up == 0 and stats.duplicates_dropped == 0
    assert stats.hedged == 0  # found by the broken stream, not by the 60 s sample timeout
    assert stats.per_worker == {"survivor": count}  # the victim answered nothing
    assert stats.resent == stats.sent - count > 0  # each of the victim's samples re-sent exactly once
    ((lost_id, _endpoint), lost_at), = pool.lost.items()
    assert lost_id == "victim"
    detected_s = lost_at - killed_at[0]
    print(f"\nkilled-worker iteration: {killed_s:.1f} s (normal {normal_s:.1f} s, {killed_s / normal_s:.2f}x); "
          f"dead worker noticed {detected_s:.2f} s after SIGKILL; {stats.resent} samples re-sent once each")


def test_worker_joining_mid_stream_receives_work(spawn, redis_url, raw_responses):
    registry = Registry(connect(redis_url))
    first = spawn("first")
    wait_registered(registry, {first.worker_id})
    late = {}

    def requests():
        yield from sample_requests(raw_responses, 100, "join/a")
        late["worker"] = spawn("late")
        wait_registered(registry, {"late"})
        time.sleep(1.0)  # > refresh_s: the pool has seen the newcomer
        yield from sample_requests(raw_responses, 400, "join/b")

    pool = RewardClientPool(registry, max_inflight_per_worker=16, refresh_s=0.2)
    answers = Counter(r.sample_id for r in pool.score(requests()))
    assert len(answers) == 500 and set(answers.values()) == {1}
    assert pool.stats.per_worker.get("late", 0) > 0
    assert pool.stats.per_worker.get("first", 0) > 100


def test_duplicate_sample_ids_get_one_answer(spawn, redis_url, raw_responses):
    registry = Registry(connect(redis_url))
    worker = spawn("dedup")
    wait_registered(registry, {worker.worker_id})
    requests = list(sample_requests(raw_responses, 20, "dup"))
    pool = RewardClientPool(registry)
    answers = Counter(r.sample_id for r in pool.score(requests + requests[:5]))
    assert len(answers) == 20 and set(answers.values()) == {1}


def test_unresponsive_worker_samples_are_resent_after_the_deadline(spawn, redis_url, raw_responses):
    registry = Registry(connect(redis_url))
    frozen, healthy = spawn("frozen"), spawn("healthy")
    wait_registered(registry, {"frozen", "healthy"})
    # keepalive_s: long enough that only the sample timeout can notice the silent worker in this test.
    pool = RewardClientPool(registry, max_inflight_per_worker=16, refresh_s=0.2, sample_timeout_s=2.0,
                            keepalive_s=120.0)
    answers = Counter()
    try:
        for response in pool.score(sample_requests(raw_responses, 300, "frozen")):
            answers[response.sample_id] += 1
            if sum(answers.values()) == 50:
                os.kill(frozen.process.pid, signal.SIGSTOP)  # alive, connected, silent
    finally:
        os.kill(frozen.process.pid, signal.SIGKILL)
        frozen.process.wait(timeout=10)
    assert len(answers) == 300 and set(answers.values()) == {1}
    assert pool.stats.hedged > 0 and pool.stats.workers_lost == 0  # re-sent on the deadline, not on a break
    assert pool.stats.gave_up == 0  # the silent worker stopped receiving samples once it was overdue
    assert pool.stats.per_worker[healthy.worker_id] > 200


def test_no_worker_and_failing_input_are_reported(redis_url):
    registry = Registry(connect(redis_url))
    pool = RewardClientPool(registry, service="reward-nobody", no_worker_timeout_s=0.5, refresh_s=0.1)
    with pytest.raises(RuntimeError, match="no reward worker registered under service 'reward-nobody'"):
        list(pool.score([reward_pb2.ScoreRequest(sample_id="a", response="1", ground_truth="1")]))

    def broken_rollout():
        yield reward_pb2.ScoreRequest(sample_id="b", response="1", ground_truth="1")
        raise ValueError("rollout stream broke")

    with pytest.raises(RuntimeError, match="rollout stream broke"):
        list(pool.score(broken_rollout()))

"""The Redis layer against a real private redis-server: leases, heartbeats, journal."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from services.common.redis_store import Registry, RunJournal, connect, start_private_redis
from services.common.service_kind import ServiceKind


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_private_redis_starts_and_stops() -> None:
    server = start_private_redis()
    client = connect(server.url)
    assert client.ping()
    server.stop()
    assert server.process.poll() is not None
    assert not server.workdir.exists()


def test_private_redis_in_a_relative_directory_keeps_its_journal(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    server = start_private_redis("run/redis", appendonly=True)
    try:
        RunJournal(connect(server.url), "r").write(phase="done")
    finally:
        server.stop()
    assert (tmp_path / "run" / "redis" / "redis.log").is_file()  # a given directory is kept (for resume)
    again = start_private_redis("run/redis", appendonly=True)
    try:
        assert RunJournal(connect(again.url), "r").read() == {"phase": "done"}  # the append-only file came back
    finally:
        again.stop()


def test_heartbeats_keep_a_registration_alive_past_its_lease(redis_url: str) -> None:
    registry = Registry(connect(redis_url), prefix="t-alive")
    with registry.register("reward", "w1", "127.0.0.1:1", lease_s=0.6, metadata={"slots": 4}):
        time.sleep(1.5)  # 2.5 leases
        members = registry.members("reward")
        assert [(m.instance_id, m.endpoint, m.metadata) for m in members] == [("w1", "127.0.0.1:1", {"slots": 4})]
    assert registry.members("reward") == []  # close() deregisters at once


def test_service_kinds_are_the_key_names_every_process_shares(redis_url: str) -> None:
    # The enum's values are on the wire: a process of another version reads these exact keys.
    assert {k.value for k in ServiceKind} == {"coordinator", "reward", "rollout", "tools", "trainer"}
    client = connect(redis_url)
    registry = Registry(client, prefix="t-kinds")
    with registry.register(ServiceKind.REWARD, "w1", "127.0.0.1:1"):
        assert client.exists("t-kinds:members:reward:w1")
        assert [m.instance_id for m in registry.members("reward")] == ["w1"]  # a plain name finds it too


def test_killed_instance_leaves_the_registry_within_its_lease(redis_url: str) -> None:
    lease_s = 1.0
    code = (
        "import sys, time; from services.common.redis_store import Registry, connect; "
        f"r = Registry(connect({redis_url!r}), prefix='t-kill').register('rollout', 'victim', '127.0.0.1:9', lease_s={lease_s}); "
        "print('up', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        registry = Registry(connect(redis_url), prefix="t-kill")
        assert [m.instance_id for m in registry.members("rollout")] == ["victim"]
        proc.kill()
        proc.wait()
        killed_at = time.monotonic()
        assert wait_until(lambda: registry.members("rollout") == [], timeout_s=lease_s + 1.0)
        # It was still present right after the kill only because its lease had not run out.
        assert time.monotonic() - killed_at <= lease_s + 1.0
    finally:
        proc.kill()


def test_registration_comes_back_after_redis_loses_it(redis_url: str) -> None:
    client = connect(redis_url)
    registry = Registry(client, prefix="t-flush")
    with registry.register("trainer", "t0", "127.0.0.1:2", lease_s=0.6):
        for key in client.scan_iter("t-flush:*"):
            client.delete(key)
        assert registry.members("trainer") == []
        assert wait_until(lambda: len(registry.members("trainer")) == 1, timeout_s=1.0)


def test_invalid_lease_is_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        Registry(connect(redis_url)).register("x", "y", "z", lease_s=0)


def test_run_journal_round_trip_and_idempotent_replay(redis_url: str) -> None:
    journal = RunJournal(connect(redis_url), "run-a")
    assert not journal.exists()
    journal.write(phase="rollout", cursor={"consumed_batches": 3}, weights_version=2)
    journal.record_iteration(3, {"timing/all": 1.5}, phase="done", weights_version=3)
    journal.record_iteration(3, {"timing/all": 1.5}, phase="done", weights_version=3)  # a replayed write
    assert journal.read() == {"phase": "done", "cursor": {"consumed_batches": 3}, "weights_version": 3, "iteration": 3}
    assert journal.iterations() == {3: {"timing/all": 1.5}}
    journal.delete()
    assert not journal.exists()


def test_journal_and_registrations_ride_out_a_redis_restart(tmp_path) -> None:
    """Redis SIGKILLed and started again on the same port and append-only file: a journal write made while it
    is down waits and lands, earlier writes survive, and a registration comes back with its next heartbeat."""
    import threading

    server = start_private_redis(str(tmp_path / "redis"), appendonly=True)
    try:
        client = connect(server.url)
        journal = RunJournal(client, "restart")
        journal.write(phase="running", iteration=3)
        client.execute_command("BGREWRITEAOF")  # the AOF holds everything so far, whatever fsync timing does
        assert wait_until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0, 10)
        registration = Registry(client).register("reward", "w0", "127.0.0.1:1", lease_s=1.5)
        server.process.kill()
        server.process.wait()
        restarter = threading.Timer(1.0, server.restart)
        restarter.start()
        try:
            journal.write(phase="rollout", current_iteration=4)  # blocks until Redis is back, then lands
        finally:
            restarter.join()  # never leave a restarted server behind
        state = journal.read()
        assert (state["phase"], state["iteration"], state["current_iteration"]) == ("rollout", 3, 4)
        assert wait_until(lambda: [m.instance_id for m in Registry(client).members("reward")] == ["w0"], 10)
        registration.close()
    finally:
        server.stop()


def test_iteration_metrics_reads_one_journaled_iteration(redis_url: str) -> None:
    from services.common.redis_store import RunJournal, connect

    journal = RunJournal(connect(redis_url), "one-field")
    journal.record_iteration(1, {"a": 1.5})
    assert journal.iteration_metrics(1) == {"a": 1.5}
    assert journal.iteration_metrics(2) is None


def test_a_resume_forgets_the_metrics_of_the_iterations_it_computes_again(redis_url: str) -> None:
    from services.common.redis_store import RunJournal, connect

    journal = RunJournal(connect(redis_url), "forget-after")
    for i in (1, 2, 3):
        journal.record_iteration(i, {"a": float(i)}, detail={"batches": [i]})
    assert journal.forget_iterations_after(1) == [2, 3]
    assert journal.iterations() == {1: {"a": 1.0}} and journal.details()[3] == {"batches": [3]}
    assert journal.forget_iterations_after(1) == []

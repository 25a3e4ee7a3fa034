"""num_workers, rate_limit and the queue; the CLI; the non-root (user namespace) mode; a host without bwrap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from services.cli import main
from services.sandbox.admission import Admission, AdmissionRefusedError

REPO = Path(__file__).resolve().parents[2]


def test_rate_limit_spaces_run_starts():
    admission = Admission(num_workers=4, rate_limit=5.0, max_queue=10, queue_timeout_s=5.0)
    started = time.monotonic()
    for _ in range(7):  # a burst of 5, then one start per 0.2 s
        with admission.slot():
            pass
    assert 0.35 <= time.monotonic() - started < 1.5


def test_full_queue_and_queue_timeout_are_refused_naming_the_flags():
    admission = Admission(num_workers=1, rate_limit=0.0, max_queue=1, queue_timeout_s=0.3)
    outcome: list[tuple[str, str]] = []

    def waiter() -> None:
        try:
            with admission.slot():
                outcome.append(("ran", ""))
        except AdmissionRefusedError as e:
            outcome.append((e.reason, str(e)))

    with admission.slot() as lease:
        assert lease.number == 0
        thread = threading.Thread(target=waiter)
        thread.start()
        while admission.waiting == 0:
            time.sleep(0.01)
        with pytest.raises(AdmissionRefusedError, match=r"1 requests already wait \(--max-queue 1\)") as refused:
            with admission.slot():
                pass
        assert refused.value.reason == "queue_full"
        thread.join()
    assert outcome == [("queue_timeout", "no worker was free within 0.3 s (--queue-timeout-s; --num-workers 1, "
                                         "--rate-limit 0/s)")]


def test_a_retired_slot_comes_back_under_a_new_number():
    admission = Admission(num_workers=1, rate_limit=0.0, max_queue=1, queue_timeout_s=1.0)
    with admission.slot() as lease:
        lease.retire()
    with admission.slot() as lease:
        assert lease.number == 1  # uid base+1 from now on; base+0 is never handed out again


def test_num_workers_runs_one_at_a_time_and_a_full_queue_gets_429(server_factory):
    client = server_factory(num_workers=1, max_queue=1)
    code = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint(start, time.time())"
    bodies: list[dict] = []
    threads = [threading.Thread(target=lambda: bodies.append(client.run(code))) for _ in range(2)]

    def load(key: str) -> int:
        return json.loads(client.get("/health")[1])[key]

    threads[0].start()
    while load("running") == 0:
        time.sleep(0.02)
    threads[1].start()
    while load("waiting") == 0:
        time.sleep(0.02)
    status, body = client.post({"code": "print(1)", "language": "python"})
    assert status == 429 and body["status"] == "SandboxError" and body["run_result"] is None
    assert body["message"] == "the sandbox is full: 1 requests already wait (--max-queue 1); retry later"
    for thread in threads:
        thread.join()
    spans = sorted(tuple(map(float, b["run_result"]["stdout"].split())) for b in bodies)
    assert [b["status"] for b in bodies] == ["Success", "Success"]
    assert spans[0][1] <= spans[1][0]  # the second run started after the first ended
    _, metrics = client.get("/metrics")
    assert b'rlfabric_sandbox_refused_total{reason="queue_full"} 1.0' in metrics


def test_cli_serves_and_stops_on_sigterm(tmp_path, bwrap_ready, make_client):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "sandbox", "serve", "--port", "0",
                             "--num-workers", "1", "--max-run-timeout-s", "5", "--scratch-root", str(scratch)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("sandbox serving on http://127.0.0.1:"), (line, proc.stderr.read())  # type: ignore
        client = make_client(line.split()[3])
        client.assert_serving()
        health = json.loads(client.get("/health")[1])
        assert health["mode"] == ("privileged" if os.geteuid() == 0 else "userns")
        assert health["limits"]["max_run_timeout_s"] == 5.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert list(scratch.iterdir()) == []  # the runs' folders went with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_bad_limits_and_a_host_without_bwrap(capsys, monkeypatch):
    assert main(["sandbox", "serve", "--max-processes", "0"]) == 2
    assert "--max-processes must be positive, got 0" in capsys.readouterr().err
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["sandbox", "serve"]) == 1
    assert "bubblewrap (bwrap) is not installed: `make setup` installs Debian's package" in capsys.readouterr().err


USERNS_PROGRAM = r"""
import json, sys
from services.sandbox.runner import Sandbox, SandboxLimits
from services.sandbox.schema import RunCodeRequest
sandbox = Sandbox(SandboxLimits(max_processes=16, max_run_timeout_s=5), python="/usr/bin/python3",
                  scratch_root=sys.argv[1])
sandbox.check()
programs = {
    "identity": "import os\nprint(os.getuid())\nfor p in ['/x', '/usr/x', '/proc/sys/vm/drop_caches']:\n"
                "    try:\n        open(p, 'w')\n    except OSError as e:\n        print(e.errno)",
    "forks": "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
             "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
}
out = {"mode": sandbox.mode}
for name, code in programs.items():
    result = sandbox.run(RunCodeRequest(code=code, language="python", run_timeout=5), slot=0)
    out[name] = [result.response["status"], result.response["run_result"]["stdout"],
                 result.response["run_result"]["stderr"][-200:]]
sandbox.close()
print(json.dumps(out))
"""


def test_non_root_mode_runs_in_a_user_namespace(bwrap_ready):
    """As root, the same runner run by an unprivileged user (uid 65534, the system python) takes the userns path."""
    system_python = shutil.which("python3", path="/usr/bin")
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("needs root (to become uid 65534) and /usr/bin/python3")
    version = subprocess.run([system_python, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True).stdout.strip()
    readable = all(Path(p).stat().st_mode & stat.S_IXOTH for p in [REPO, *REPO.parents])
    if version != "True" or not readable:
        pytest.skip("/usr/bin/python3 is older than 3.10, or the repository is not readable by other users")
    scratch = tempfile.mkdtemp(prefix="rlfabric-userns-test-")
    os.chown(scratch, 65534, 65534)
    try:
        done = subprocess.run([system_python, "-c", USERNS_PROGRAM, scratch], cwd=REPO, user=65534, group=65534,
                              extra_groups=[], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": scratch},
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["mode"] == "userns"
    assert out["identity"][:2] == ["Success", "65534\n30\n30\n13\n"]  # EROFS, EROFS, EACCES
    children, errno = map(int, out["forks"][1].split())
    assert out["forks"][0] == "Success" and errno == 11 and children < 16
    assert out["network"][0] == "Failed" and "Network is unreachable" in out["network"][2]

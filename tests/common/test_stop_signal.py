"""services/common/stop_signal.py: a service's wait for SIGTERM/SIGINT, in a child process (the handlers it installs
would otherwise stay in the test process)."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Signals that come before the handlers are in are ignored (not fatal), so the test can send until one lands. With
# `other_thread`, the main thread blocks both signals once a helper thread (which does not) is running, so that
# every signal lands on the helper: what happens in a service whenever gRPC's or Redis's threads take it.
CHILD = """
import signal, sys, threading, time
from services.common import stop_signal
from services.common.stop_signal import wait_for_stop_signal
stop_signal._POLL_S = 3600.0  # only the wakeup byte can end the wait in time
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
if sys.argv[1] == "other_thread":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
print("waiting", flush=True)
print(wait_for_stop_signal().name, flush=True)
time.sleep(0.5)  # a drain, during which a second signal must not kill the process
print("drained", flush=True)
"""


def _signal_until_a_line(proc: subprocess.Popen, sig: signal.Signals, deadline_s: float = 30.0) -> str:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        proc.send_signal(sig)
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline()
    raise AssertionError(f"no line within {deadline_s} s of sending {sig.name}")


@pytest.mark.parametrize("where", ["main_thread", "other_thread"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_signal_ends_the_wait_and_a_second_one_is_absorbed(sig: signal.Signals, where: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, where], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            bufsize=1)
    try:
        assert proc.stdout.readline() == "waiting\n"
        assert _signal_until_a_line(proc, sig) == f"{sig.name}\n"
        proc.send_signal(sig)  # during the drain
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, out) == (0, "drained\n")

"""Blocking a service's main thread until SIGTERM or SIGINT, whichever thread the signal lands on.

A process-directed signal goes to any thread that does not block it: in a service that is often one of gRPC's or
Redis's threads, not the main one. CPython runs the Python handler only in the main thread, once that thread
executes bytecode again, and a main thread asleep in `threading.Event.wait()` (a lock acquire with no timeout) is
not woken by a signal another thread took: it slept on, SIGTERM unanswered, until killed. CI caught a coordinator
in that state (py-spy: the main thread in `Event.wait`, 40 minutes after its SIGTERM). Here the C-level handler,
which runs in whichever thread got the signal, writes the signal's number to a pipe (`signal.set_wakeup_fd`), and
the main thread sleeps reading that pipe.
"""

from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_POLL_S = 1.0  # a backstop: the wakeup byte ends the wait at once


def wait_for_stop_signal() -> signal.Signals:
    """Installs SIGTERM/SIGINT handlers and blocks until one arrives; returns it. Call it from the main thread.

    The handlers stay installed afterwards: a second signal during the drain is absorbed, as before, rather than
    killing the process half-way through it.
    """
    received: list[int] = []
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd's requirement: a full pipe must not block a signal handler
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: received.append(signum))  # no lock taken in the handler
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    while True:
        if select.select([read_end], [], [], _POLL_S)[0]:
            for byte in os.read(read_end, 64):
                if byte in STOP_SIGNALS:
                    return signal.Signals(byte)
        if received:
            return signal.Signals(received[0])

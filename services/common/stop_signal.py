"""Blocking a service's main thread until SIGTERM or SIGINT, without the handler touching a lock.

A signal handler runs in the main thread, between two bytecodes of whatever it was doing. A handler that sets a
`threading.Event` the main thread is waiting on can therefore run while that thread holds the Event's own lock
(inside `Event.wait`, before it sleeps), and `Event.set` then waits for that lock forever: the process ignores
every later SIGTERM and has to be killed. CI once had a coordinator, sent SIGTERM a moment after it started
serving, that never exited; this is the likely cause (it did not repeat on demand). Here the handler only writes
the signal's number to a pipe, which the main thread reads.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def wait_for_stop_signal() -> signal.Signals:
    """Installs SIGTERM/SIGINT handlers and blocks until one arrives; returns it.

    The handlers stay installed (and the pipe open) afterwards: a second signal during the drain is absorbed, as
    before, rather than killing the process half-way through it.
    """
    read_end, write_end = os.pipe()

    def handle(signum: int, _frame: object) -> None:
        try:
            os.write(write_end, bytes([signum]))
        except OSError:  # the pipe is full of earlier signals: the first is the one that counts
            pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)
    return signal.Signals(os.read(read_end, 1)[0])  # retried after the handler runs (PEP 475)

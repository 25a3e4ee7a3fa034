"""Who runs when: `num_workers` runs at once, `rate_limit` run starts per second, a bounded queue for the rest.

A request takes a start token (a token bucket refilled at `rate_limit` per second, holding at most
max(1, rate_limit); 0 means no rate limit), then a worker slot (slot i runs as uid base + i in privileged mode, so
each slot's process count is its own). While it waits for either it counts against `max_queue`; a request that
finds the queue full, or waits longer than `queue_timeout_s`, is refused at once with the reason (HTTP 429), so
a client backs off instead of piling up connections.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class AdmissionRefusedError(Exception):
    """The request was not admitted; the message says why and names the flag that sets the limit."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # metrics label: queue_full, queue_timeout


class Lease:
    """A held worker slot. `retire()` when a run's processes may have outlived it: the slot goes back to the pool
    under a new number (a new uid), never the old one."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.retired = False

    def retire(self) -> None:
        self.retired = True


class Admission:
    def __init__(self, *, num_workers: int, rate_limit: float, max_queue: int, queue_timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"--num-workers must be at least 1, got {num_workers}")
        if not (math.isfinite(rate_limit) and rate_limit >= 0):
            raise ValueError(f"--rate-limit must be >= 0 run starts per second (0: unlimited), got {rate_limit}")
        if max_queue < 0 or not (math.isfinite(queue_timeout_s) and queue_timeout_s > 0):
            raise ValueError(f"--max-queue must be >= 0 and --queue-timeout-s > 0, got {max_queue}, "
                             f"{queue_timeout_s}")
        self.num_workers, self.rate_limit = num_workers, rate_limit
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(num_workers):
            self._slots.put(slot)
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._tokens = max(1.0, rate_limit)
        self._refilled = time.monotonic()
        self._next_slot = num_workers

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    @contextmanager
    def slot(self) -> Iterator[Lease]:
        """Holds a worker slot for the body; raises AdmissionRefusedError when the request cannot be admitted."""
        lease = Lease(self._acquire())
        try:
            yield lease
        finally:
            with self._lock:
                self._running -= 1
                if lease.retired:  # a fresh number, so the old slot's uid is never reused
                    lease.number = self._next_slot
                    self._next_slot += 1
            self._slots.put(lease.number)

    def _acquire(self) -> int:
        deadline = time.monotonic() + self.queue_timeout_s
        with self._lock:
            if self._waiting >= self.max_queue and self._slots.empty():
                raise AdmissionRefusedError(
                    "queue_full", f"the sandbox is full: {self._waiting} requests already wait "
                                  f"(--max-queue {self.max_queue}); retry later")
            self._waiting += 1
        try:
            self._take_token(deadline)
            try:
                slot = self._slots.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._timed_out() from None
            with self._lock:
                self._running += 1
            return slot
        finally:
            with self._lock:
                self._waiting -= 1

    def _take_token(self, deadline: float) -> None:
        if self.rate_limit <= 0:
            return
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(max(1.0, self.rate_limit), self._tokens + (now - self._refilled) * self.rate_limit)
                self._refilled = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                wait = (1.0 - self._tokens) / self.rate_limit
            if now + wait > deadline:
                raise self._timed_out()
            time.sleep(wait)

    def _timed_out(self) -> AdmissionRefusedError:
        return AdmissionRefusedError(
            "queue_timeout", f"no worker was free within {self.queue_timeout_s:g} s (--queue-timeout-s; "
                             f"--num-workers {self.num_workers}, --rate-limit {self.rate_limit:g}/s)")

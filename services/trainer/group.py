"""Rank 0 -> all ranks fan-out of trainer operations, and liveness of the other ranks.

Owns:
- `CommandBus`: rank 0 broadcasts each operation (name + keyword arguments, pickled) over a gloo
  group; every rank runs it on its `TrainerWorker` in lockstep; each rank's outcome (ok or the error
  text) is gathered back so that a failure anywhere fails the call on rank 0.
- `Liveness`: every non-zero rank keeps one TCP connection open to rank 0. When a rank's process
  dies, its kernel closes the socket and rank 0 sees EOF at once, so a call that is waiting for that
  rank inside a collective is failed (UNAVAILABLE) by the server instead of hanging until the
  collective's own timeout. A dead rank breaks the group for good: every later call fails fast.
- `GroupExecutor` (rank 0): runs operations one at a time on a dedicated thread and lets the gRPC
  handler wait with its deadline while watching liveness.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

STOP = "__stop__"
# How long a failed collective waits for the liveness watcher to attribute it to a dead rank.
LIVENESS_GRACE_S = 2.0


class GroupBrokenError(RuntimeError):
    """A rank died (or the group failed); the trainer group must be restarted."""


class OperationFailedError(RuntimeError):
    """An operation raised on one or more ranks (the group is still usable)."""

    def __init__(self, message: str, kinds: set[str]) -> None:
        super().__init__(message)
        self.kinds = kinds  # exception class names seen, e.g. {"ValueError"}


class Liveness:
    """TCP keep-open connections from ranks 1..W-1 to rank 0."""

    def __init__(self, on_dead: Callable[[int], None] | None = None) -> None:
        self.dead: set[int] = set()
        self._on_dead = on_dead
        self._conns: dict[socket.socket, int] = {}
        self._client: socket.socket | None = None
        self._stop = threading.Event()
        self._died = threading.Event()

    def start(self) -> None:
        """Collective: rank 0 listens (on MASTER_ADDR's host); the others connect to it."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if world == 1:
            return
        addr = [None]
        if rank == 0:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            server = _listen_on(host, world)
            addr = [(host, server.getsockname()[1])]
        dist.broadcast_object_list(addr, src=0)
        if rank == 0:
            while len(self._conns) < world - 1:
                conn, _ = server.accept()
                peer = int(conn.recv(8).decode().strip())
                self._conns[conn] = peer
            server.close()
            threading.Thread(target=self._watch, name="trainer-liveness", daemon=True).start()
        else:
            self._client = socket.create_connection(tuple(addr[0]))
            self._client.sendall(f"{rank:<8d}".encode())

    def _watch(self) -> None:
        while not self._stop.is_set() and self._conns:
            readable, _, _ = select.select(list(self._conns), [], [], 0.5)
            for conn in readable:
                try:
                    data = conn.recv(1)
                except OSError:
                    data = b""
                if not data:
                    peer = self._conns.pop(conn)
                    conn.close()
                    if self._stop.is_set():
                        return
                    self.dead.add(peer)
                    self._died.set()
                    logger.error("trainer rank %d died (its liveness connection closed)", peer)
                    if self._on_dead:
                        self._on_dead(peer)

    def wait_for_death(self, timeout_s: float) -> bool:
        """Whether a rank is known dead, waiting up to `timeout_s` for the watcher to see one."""
        return self._died.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()


def _listen_on(host: str, backlog: int) -> socket.socket:
    """A listening socket on `host`'s interface only (the other ranks reach rank 0 there, nobody else needs to)."""
    try:
        return socket.create_server((host, 0), backlog=backlog)
    except OSError as e:  # MASTER_ADDR names no local interface (a service address in front of this pod)
        logger.warning("cannot bind MASTER_ADDR %s (%s): the liveness socket listens on every interface", host, e)
        return socket.create_server(("", 0), backlog=backlog)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, tuple[str, str] | None]:
    """`fn()`'s result and None, or None and (exception type, one-line reason) when it raised.

    The traceback stays in this rank's log: the reason goes to the caller, who should not see file paths or
    code lines of the server (docs/security.md).
    """
    try:
        return fn(), None
    except Exception as e:
        logger.exception("trainer operation failed on rank %d", dist.get_rank())
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return None, (type(e).__name__, f"rank {dist.get_rank()}: {type(e).__name__}: {reason}")


class CommandBus:
    """Lockstep execution of named operations on every rank."""

    def __init__(self, handlers: dict[str, Callable[..., Any]]) -> None:
        self.handlers = handlers
        self.world = dist.get_world_size()

    def call(self, op: str, **kwargs: Any) -> Any:
        """Rank 0: run `op` on all ranks; return rank 0's result or raise OperationFailedError."""
        if self.world > 1:
            dist.broadcast_object_list([(op, kwargs)], src=0)
        result, error = _outcome(lambda: self.handlers[op](**kwargs))
        errors = [error]
        if self.world > 1:
            gathered: list = [None] * self.world
            dist.gather_object(error, gathered, dst=0)
            errors = gathered
        failed = [e for e in errors if e]
        if failed:
            raise OperationFailedError("; ".join(text for _, text in failed), {kind for kind, _ in failed})
        return result

    def stop(self) -> None:
        if self.world > 1:
            dist.broadcast_object_list([(STOP, {})], src=0)

    def serve_forever(self) -> None:
        """Ranks > 0: run every broadcast operation until STOP."""
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            op, kwargs = box[0]
            if op == STOP:
                return
            _result, error = _outcome(lambda op=op, kwargs=kwargs: self.handlers[op](**kwargs))
            dist.gather_object(error, None, dst=0)


class GroupExecutor:
    """Rank 0: one operation at a time on a dedicated thread, awaited with a deadline."""

    def __init__(self, bus: CommandBus, liveness: Liveness) -> None:
        self.bus = bus
        self.liveness = liveness
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-op")
        self.broken: str | None = None

    def run(self, op: str, timeout_s: float | None, **kwargs: Any) -> Any:
        """Run `op` on every rank; raise GroupBrokenError when a rank is dead, TimeoutError past the deadline."""
        self._check()
        fut = self._pool.submit(self.bus.call, op, **kwargs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                pass
            except OperationFailedError:
                raise
            except Exception as e:  # a collective failed (for example a peer reset the connection)
                # A dead peer reaches the collective and the liveness socket at about the same moment; on a
                # busy machine the collective can win, so give the watcher a moment to name the rank.
                self.liveness.wait_for_death(LIVENESS_GRACE_S)
                self.broken = f"{op} failed in a collective: {e}"
                self._check()
                raise
            self._check()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{op} did not finish within {timeout_s:.1f}s")

    def _check(self) -> None:
        if self.liveness.dead:
            self.broken = f"trainer rank(s) {sorted(self.liveness.dead)} died"
        if self.broken:
            raise GroupBrokenError(f"{self.broken}; the trainer group must be restarted")

    def shutdown(self) -> None:
        if not self.broken:
            try:
                self._pool.submit(self.bus.stop).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.warning("could not stop the other ranks cleanly")
        self._pool.shutdown(wait=False, cancel_futures=True)

"""`rate_limit` across tool servers: a semaphore in Redis, the counterpart of upstream's named Ray actor.

Upstream (`execution_pool.py`) makes every tool call acquire one slot of a cluster-wide semaphore of `rate_limit`
slots (a Ray actor named "rate-limiter") when `enable_global_rate_limit` is on. Here the tool servers of a run
share Redis, so the semaphore is a sorted set `rlfabric:tools:inflight:{tool}`: one member per call holding a
slot, scored with the Redis time (ms) its hold lapses. Acquiring is one Lua script (drop lapsed holds; take a
slot when fewer than `rate_limit` are held), so no two servers can both take the last slot, and the hold of a
server that dies mid-call lapses on its own. Holds are per tool name (upstream's one actor served every tool,
and the first tool created fixed its size for all: a quirk not kept).

Without Redis, or while Redis is unreachable, the limit is this process's alone (a warning says so); a call is
never refused because the limiter is down.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.tools.outcome import Deadline

logger = logging.getLogger(__name__)

KEY_PREFIX = "rlfabric:tools:inflight"
# Past a call's deadline, how long its hold lasts if its server dies before releasing it.
HOLD_SLACK_S = 5.0

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  return 1
end
return 0
"""


def limiter_client(url: str) -> redis.Redis:
    """A Redis client that fails fast (1 s, no retries): a call waiting on the limiter must not wait on Redis."""
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0,
                                retry=Retry(NoBackoff(), 0))


class SlotLimit:
    """At most `limit` holders at once: across servers through `client`, else within this process."""

    def __init__(self, tool: str, limit: int, client: redis.Redis | None) -> None:
        self.tool = tool
        self.limit = limit
        self.key = f"{KEY_PREFIX}:{tool}"
        self._client = client
        self._script = client.register_script(_ACQUIRE) if client is not None else None
        self._local = threading.BoundedSemaphore(limit)
        self._held_locally: set[str] = set()
        self._lock = threading.Lock()
        self._warned_at = 0.0

    def acquire(self, holder: str, deadline: Deadline) -> bool:
        """Takes a slot for `holder` (a unique call id); False when none frees up before `deadline`."""
        if self._script is None:
            return self._acquire_locally(holder, deadline)
        while True:
            try:
                hold_ms = int((deadline.remaining() + HOLD_SLACK_S) * 1000)
                if self._script(keys=[self.key], args=[self.limit, holder, hold_ms]) == 1:
                    return True
            except redis.RedisError as e:
                self._warn(e)
                return self._acquire_locally(holder, deadline)
            if deadline.expired():
                return False
            time.sleep(min(deadline.remaining(), random.uniform(0.01, 0.05)))

    def release(self, holder: str) -> None:
        with self._lock:
            if holder in self._held_locally:
                self._held_locally.discard(holder)
                self._local.release()
                return
        if self._client is not None:
            try:
                self._client.zrem(self.key, holder)
            except redis.RedisError as e:  # the hold lapses by itself
                self._warn(e)

    def _acquire_locally(self, holder: str, deadline: Deadline) -> bool:
        if not self._local.acquire(timeout=deadline.remaining()):
            return False
        with self._lock:
            self._held_locally.add(holder)
        return True

    def _warn(self, error: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at > 30:
            self._warned_at = now
            logger.warning("tool %s: Redis unreachable for the global rate_limit (%s); limiting within this "
                           "server only until it answers", self.tool, error)

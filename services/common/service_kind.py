"""The services that register in Redis (`services.common.redis_store.Registry`), by the name their keys carry.

A module of its own, importing nothing, so that the command-line parsers (which `rlfabric --help` builds all of)
can name the services without loading the Redis client.
"""

from __future__ import annotations

from enum import StrEnum


class ServiceKind(StrEnum):
    """Each value is the `{service}` of `rlfabric:members:{service}:{instance_id}`, and so on the wire between
    every process of a run: renaming one is a protocol change. The launchers name their children after it too
    (`reward-0`, `tools-1`), which is how `rlfabric system` finds a child's registration."""

    COORDINATOR = "coordinator"
    REWARD = "reward"
    ROLLOUT = "rollout"
    TOOLS = "tools"
    TRAINER = "trainer"

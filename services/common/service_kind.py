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


class TrainerRole(StrEnum):
    """What a trainer group does (services/trainer/roles.py: the config section each reads). The value is the
    `role` of the trainer's registration metadata, so it too is on the wire: the coordinator finds its trainers by
    it."""

    ACTOR = "actor"          # trains the policy
    REFERENCE = "reference"  # the frozen policy of the KL term
    CRITIC = "critic"        # PPO's value model

"""Helpers of the weight-sync tests, built on the rollout and trainer tests' own helpers."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _d in ("rollout", "trainer"):
    if str(_TESTS / _d) not in sys.path:
        sys.path.append(str(_TESTS / _d))

from rollout_helpers import generate, group_request, hf_greedy, tokens  # noqa: E402
from trainer_helpers import REPO, rank_env  # noqa: E402

__all__ = ["PROMPTS", "REPO", "hf_greedy_all", "rank_env", "rollout_greedy", "serve_rollout"]

PROMPTS = [[5, 99, 1200, 7, 3000, 42], [17, 18, 19, 20], [4000, 3, 3, 812, 90, 91, 92, 2048]]


def rollout_greedy(stub, prompts: Sequence[Sequence[int]], max_tokens: int = 12, version: int = 0) -> list[list[int]]:
    samples = generate(stub, [group_request(f"g{i}", p, version=version, temperature=0.0, max_tokens=max_tokens)
                              for i, p in enumerate(prompts)])
    by_group = {s.group_id: tokens(s) for s in samples}
    return [by_group[f"g{i}"] for i in range(len(prompts))]


def hf_greedy_all(model, prompts: Sequence[Sequence[int]], max_tokens: int = 12) -> list[list[int]]:
    return [hf_greedy(model, p, max_tokens) for p in prompts]


def serve_rollout(engine):
    """A started Rollout server over `engine` (several servers may share one engine: several targets)."""
    from services.rollout.engine import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, _ = create_rollout_server(engine, SamplingOptions(max_tokens=16, temperature=1.0), metrics_port=0)
    server.start()
    return server

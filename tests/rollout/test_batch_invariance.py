"""What `rlfabric.deterministic` relies on in the CPU rollout: a seeded sample's tokens and log-probs do not depend
on what else the engine batches with it (vLLM's batch invariance mode is for GPUs and Ascend only). The engine
runs in the test process, which tests/conftest.py puts on MKL's path as `deterministic` puts a rollout
(services/common/determinism.py); on an AVX-512 host without it, the log-probs differ in the last bit."""

from __future__ import annotations

import numpy as np
from rollout_helpers import generate, group_request, log_probs, tokens

PROMPT = [5, 17, 29, 3, 11, 42, 7]
MAX_NEW = 24


def _others(k: int) -> list:
    rng = np.random.default_rng(k)
    return [group_request(f"other-{k}-{i}", rng.integers(3, 60, size=int(rng.integers(3, 40))).tolist(), n=4,
                          temperature=1.0, max_tokens=MAX_NEW, seed=100 + i) for i in range(6)]


def test_a_seeded_sample_is_the_same_alone_and_in_any_batch(rollout_stub) -> None:
    mine = group_request("mine", PROMPT, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=7)
    alone = generate(rollout_stub, [mine])
    crowded = [s for s in generate(rollout_stub, _others(1) + [mine] + _others(2)) if s.sample_id.startswith("mine")]
    first = [s for s in generate(rollout_stub, [mine] + _others(3)) if s.sample_id.startswith("mine")]
    for run in (crowded, first):
        assert len(run) == len(alone) == 4
        for a, b in zip(sorted(alone, key=lambda s: s.sample_id), sorted(run, key=lambda s: s.sample_id), strict=True):
            assert tokens(a) == tokens(b)
            assert np.array_equal(log_probs(a), log_probs(b))  # bitwise

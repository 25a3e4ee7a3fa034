"""Rule verifiers: pure functions `(response, ground_truth) -> float`, one module each.

Every verifier has the same signature and return type (`Verifier`); `registry.VERIFIERS` maps the
MindSpeed-RL names (`rl_config.verifier_function`) to them. No I/O, no gRPC, no process management here:
deadlines and crash isolation are the pool's job (`services/reward/pool.py`).
"""

from services.reward.verifiers.registry import VERIFIERS, Verifier, VerifierEntry, get_verifier

__all__ = ["VERIFIERS", "Verifier", "VerifierEntry", "get_verifier"]

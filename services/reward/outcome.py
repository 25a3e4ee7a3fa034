"""The result of one verification, whatever ran it (pool process or remote verifier)."""

from dataclasses import dataclass

# Failure kinds (the `reason` label of rlfabric_reward_errors_total, plus "timeout").
TIMEOUT = "timeout"
EXCEPTION = "exception"
NON_FINITE = "non_finite"
CRASH = "crash"
REMOTE = "remote"
CIRCUIT_OPEN = "circuit_open"


@dataclass(frozen=True)
class Outcome:
    """A verifier's verdict on one sample: `score` is 0.0 whenever `reason` is set."""

    score: float
    latency_s: float
    reason: str = ""
    error: str = ""

    @classmethod
    def failed(cls, reason: str, error: str, latency_s: float) -> "Outcome":
        return cls(score=0.0, latency_s=latency_s, reason=reason, error=f"{reason}: {error}")

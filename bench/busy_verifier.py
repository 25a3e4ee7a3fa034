"""A CPU-bound stand-in verifier for the scaling benchmark: about 3 ms of pure-Python work per sample.

3 ms is what math-verify costs per sample on one core of these machines (~270 verifications/s), so this
shows how workers scale when verification, not gRPC plumbing, is the cost. Loaded as a plugin:
`--verifier-plugin busy_3ms=bench/busy_verifier.py:busy_3ms`.
"""

import time


def busy_3ms(response: str, ground_truth: str) -> float:
    """Spins for 3 ms of process CPU time, then scores 1.0 iff the response ends with the label."""
    deadline = time.process_time() + 0.003
    while time.process_time() < deadline:
        pass
    return 1.0 if response.rstrip().endswith(ground_truth) else 0.0

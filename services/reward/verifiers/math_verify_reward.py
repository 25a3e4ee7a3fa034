"""`math_verify_reward`: the think/answer format regex plus HuggingFace math-verify's verdict.

1.0 iff the response has the `format` structure and math-verify finds the answer equal to the label
(gold parsed as `\\boxed{label}` with LaTeX extraction; prediction with expression then LaTeX extraction,
as MindSpeed-RL's `compute_math_score`), else 0.0. math-verify's own timeouts use `signal.alarm`, which
fails outside the main thread, so they are disabled here; the pool enforces the deadline instead.
"""

from services.reward.verifiers import format as think_answer_format
from services.reward.verifiers.math.symbolic import math_verify_equal


def score(response: str, ground_truth: str) -> float:
    """1.0 when the format holds and math-verify accepts the answer, else 0.0."""
    if think_answer_format.score(response, ground_truth) != 1.0:
        return 0.0
    return 1.0 if math_verify_equal(response, ground_truth) else 0.0

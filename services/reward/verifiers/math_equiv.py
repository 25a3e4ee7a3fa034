"""`math_equiv`: rlfabric's own accuracy rule, 1.0 iff the final answer equals the label.

The final answer is the last `\\boxed{}` content, else the last `Answer:` line (`math/extract.py`); none
scores 0.0. Equality is `math/equivalence.py`: an exact fast path, then math-verify.
"""

from services.reward.verifiers.math.equivalence import answers_equivalent
from services.reward.verifiers.math.extract import final_answer


def score(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer is equivalent to `ground_truth`, else 0.0."""
    answer = final_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equivalent(answer, ground_truth) else 0.0

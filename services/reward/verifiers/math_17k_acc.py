"""`math_17k_acc`: 1.0 iff mathruler grades the last `\\boxed{}` content equal to the label.

As MindSpeed-RL (DAPO-Math-17k recipe): `mathruler.grader.extract_boxed_content` then `grade_answer`,
no format requirement. Unlike upstream, a response without a (closed) box has no answer and scores 0
instead of grading the string "None".
"""

from mathruler.grader import grade_answer

from services.reward.verifiers.math.extract import mathruler_boxed_answer


def score(response: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer grades equal to `ground_truth` under mathruler, else 0.0."""
    answer = mathruler_boxed_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if grade_answer(answer, ground_truth) else 0.0

"""`base_acc`: format gate plus mathruler grading, for base models prompted with the R1 template.

1.0 iff the whole response matches `<think>.*</think>.*<answer>.*\\boxed{.*}.*</answer>` (DOTALL) and the
last boxed answer grades equal to the label under mathruler; else 0.0.
"""

import re

from mathruler.grader import grade_answer

from services.reward.verifiers.math.extract import mathruler_boxed_answer

_FORMAT = re.compile(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", re.DOTALL)


def score(response: str, ground_truth: str) -> float:
    """1.0 when the R1 format holds and the boxed answer is correct, else 0.0."""
    if _FORMAT.fullmatch(response) is None:
        return 0.0
    answer = mathruler_boxed_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if grade_answer(answer, ground_truth) else 0.0

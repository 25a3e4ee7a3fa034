"""`math_17k_acc`: 1.0 iff mathruler grades the last `\\boxed{}` content equal to the label.

As MindSpeed-RL (DAPO-Math-17k recipe): `mathruler.grader.extract_boxed_content` then `grade_answer`,
no format requirement. Unlike upstream, a response without a (closed) box has no answer and scores 0
instead of grading the string "None".
"""

from mathruler.grader import extract_boxed_content, grade_answer

from services.reward.verifiers.extract import closing_brace

_NO_BOX = "None"  # what mathruler returns when it finds no closed box
_OPENER = "\\boxed{"


def boxed_answer(response: str) -> str | None:
    """mathruler's last-box extraction, with "no closed box" mapped to None rather than "None"."""
    start = response.rfind(_OPENER)
    if start < 0:
        return None
    content = extract_boxed_content(response)
    # A box that really contains "None" is an answer; an unclosed box is not.
    if content == _NO_BOX and closing_brace(response, start + len(_OPENER) - 1) is None:
        return None
    return content


def math_17k_acc(response: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer grades equal to `ground_truth` under mathruler, else 0.0."""
    answer = boxed_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if grade_answer(answer, ground_truth) else 0.0

"""`strict_format`: +1.0 when each tag appears exactly once and in order, else -0.5.

Tags: `<think>`, `</think>`, `<answer>`, one `\\boxed{...}`, `</answer>`, in that order; the response must
start with `<think>` and end with `</answer>` (MindSpeed-RL's `_validate_response_structure`).
"""

import re

_BOXED = re.compile(r"\\boxed\{.*?\}")
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_strict_structure(response: str) -> bool:
    """True when the think/answer/boxed structure appears exactly once each, in order."""
    if any(response.count(tag) != 1 for tag in _TAGS):
        return False
    boxes = _BOXED.findall(response)
    if len(boxes) != 1:
        return False
    think_start, think_end, answer_start, answer_end = (response.find(tag) for tag in _TAGS)
    boxed_start = _BOXED.search(response).start()
    ordered = think_start < think_end < answer_start < boxed_start < answer_end
    return ordered and response.startswith("<think>") and response.endswith("</answer>")


def score(response: str, ground_truth: str) -> float:
    """+1.0 for the exact structure, -0.5 otherwise; `ground_truth` is unused."""
    del ground_truth
    return 1.0 if has_strict_structure(response) else -0.5

"""`retool_reward`: MindSpeed-RL's ReTool rule, +1.0 for the right boxed answer, else -1.0 eased by tool use.

Upstream (`rule_verifier.retool_reward`): DAPO's `compute_score(..., strict_box_verify=True)`, i.e. the last
`\\boxed{...}` within the response's last 100 characters (300, then 100), its content compared to the label as
strings, exactly (no normalisation, no stripping): +1.0 equal, -1.0 otherwise (also without a closed box). A
wrong answer then gains 0.1 per tool round the rollout made, capped at 0: min(0, -1.0 + rounds * 0.1), so
trying the tool beats not trying while a right answer always beats both.

A tool round is one tool-response turn the rollout appended (upstream's per-sample `tool_call_num`, one per
turn however many calls ran in parallel in it). The verifier sees the response text only, so it counts rounds
there: runs of `<tool_response>...</tool_response>` blocks with only whitespace between them (the parallel
answers of one turn) count once. A model that writes such blocks itself counts them too; when the rollout hands
the exact count to the verifiers, `retool_score(..., tool_rounds=n)` takes it.
"""

import re

_TAIL_CHARS = 100
_BOXED = "\\boxed{"
_TOOL_BONUS = 0.1
_TOOL_RESPONSE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)


def strict_boxed_answer(response: str) -> str | None:
    """Content of the last closed `\\boxed{...}` in the last 100 characters, as upstream extracts it."""
    tail = response[-_TAIL_CHARS:]
    start = tail.rfind(_BOXED)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(tail)):
        if tail[i] == "{":
            depth += 1
        elif tail[i] == "}":
            depth -= 1
            if depth == 0:
                return tail[start + len(_BOXED):i]
    return None


def count_tool_rounds(response: str) -> int:
    """Tool-response turns in `response`: runs of `<tool_response>` blocks separated by whitespace only."""
    rounds, previous_end = 0, None
    for match in _TOOL_RESPONSE.finditer(response):
        if previous_end is None or response[previous_end:match.start()].strip():
            rounds += 1
        previous_end = match.end()
    return rounds


def retool_score(response: str, ground_truth: str, tool_rounds: int) -> float:
    """+1.0 when the strict boxed answer equals `ground_truth`, else min(0, -1.0 + tool_rounds * 0.1)."""
    score = 1.0 if strict_boxed_answer(response) == ground_truth else -1.0
    if tool_rounds and score < 0:
        score = min(0.0, score + tool_rounds * _TOOL_BONUS)  # upstream's arithmetic, for identical floats
    return float(score)


def score(response: str, ground_truth: str) -> float:
    """`retool_score` with the tool rounds counted in the response text."""
    return retool_score(response, ground_truth, count_tool_rounds(response))

"""Answer extraction shared by the verifiers: the last `\\boxed{...}` and the last `Answer:` line.

All return None when the response holds no answer. MindSpeed-RL's `math_17k_acc` turns a missing box
into the literal string "None" (mathruler's `extract_boxed_content`), which then grades as an answer;
here a missing or unclosed box is no answer at all (`mathruler_boxed_answer`).
"""

import re

from mathruler.grader import extract_boxed_content

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_BOXED = "\\boxed{"
_MATHRULER_NO_BOX = "None"  # what mathruler returns when it finds no closed box
# `Answer: ...` on its own line (DAPO's prompt asks for it); the last one wins.
_ANSWER_LINE = re.compile(r"(?im)^[ \t>*#]*(?:final\s+)?answer\s*[:：]\s*(.+?)\s*$")


def closing_brace(text: str, open_index: int) -> int | None:
    """Index of the brace closing the one at `open_index`, or None when it is never closed."""
    depth = 0
    for i in range(open_index, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` (or `\\fbox{...}`), stripped; None when there is none."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    open_index = text.index("{", start)
    close = closing_brace(text, open_index)
    if close is None:
        return None
    return text[open_index + 1 : close].strip()


def last_answer_line(text: str) -> str | None:
    """Text after the last `Answer:` line marker, without surrounding `$` signs; None when absent."""
    matches = _ANSWER_LINE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    return answer or None


def final_answer(text: str) -> str | None:
    """The response's final answer: the last boxed content, else the last `Answer:` line, else None."""
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    return last_answer_line(text)


def mathruler_boxed_answer(response: str) -> str | None:
    """mathruler's last-box extraction, with "no closed box" mapped to None rather than "None"."""
    start = response.rfind(_BOXED)
    if start < 0:
        return None
    content = extract_boxed_content(response)
    # A box that really contains "None" is an answer; an unclosed box is not.
    if content == _MATHRULER_NO_BOX and closing_brace(response, start + len(_BOXED) - 1) is None:
        return None
    return content

"""`retool_reward`: a case table against MindSpeed-RL's rule (values worked out from upstream's code)."""

from __future__ import annotations

import pytest

from services.reward.verifiers import get_verifier
from services.reward.verifiers.retool import count_tool_rounds, retool_score, score, strict_boxed_answer

ROUND = "\nuser\n<tool_response>\n42\n</tool_response>\nassistant\n"  # one tool turn, decoded without specials


@pytest.mark.parametrize(("response", "label", "expected"), [
    # right answer: +1, whatever the tool use
    ("so \\boxed{42}", "42", 1.0),
    (f"<tool_call>...</tool_call>{ROUND}so \\boxed{{42}}", "42", 1.0),
    # wrong answer, no tool use: -1
    ("so \\boxed{41}", "42", -1.0),
    # wrong after one tool turn: -1 + 0.1 (upstream's floats: -1 + 1 * 0.1)
    (f"{ROUND}so \\boxed{{41}}", "42", -1 + 0.1),
    # three turns: -1 + 3 * 0.1 = -0.6999999999999999, upstream's exact value
    (f"{ROUND}a{ROUND}b{ROUND}so \\boxed{{41}}", "42", -1 + 3 * 0.1),
    # twelve turns: capped at 0, never above a right answer
    (ROUND.join(["x"] * 13) + "\\boxed{41}", "42", 0.0),
    # strict: compared as strings, so a space or a normalisable form is wrong
    ("so \\boxed{ 42 }", "42", -1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", -1.0),
    # only the last 100 characters are read: an early box is not seen
    ("\\boxed{42}" + "." * 100, "42", -1.0),
    # the last box wins; nested braces are kept
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    # an unclosed box is no answer
    ("so \\boxed{42", "42", -1.0),
])
def test_cases(response, label, expected):
    assert score(response, label) == expected
    assert get_verifier("retool_reward")(response, label) == expected


def test_parallel_answers_of_one_turn_count_once():
    turn = "\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
    assert count_tool_rounds(f"x{turn}\ny{turn}") == 2
    assert count_tool_rounds("no tools") == 0


def test_exact_count_when_the_rollout_gives_it():
    assert retool_score("\\boxed{1}", "2", tool_rounds=5) == -1 + 5 * 0.1
    assert retool_score("\\boxed{2}", "2", tool_rounds=5) == 1.0
    assert strict_boxed_answer("no box") is None

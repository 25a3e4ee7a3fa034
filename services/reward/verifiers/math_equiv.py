"""`math_equiv`: rlfabric's default accuracy rule, 1.0 iff the final answer equals the label.

Three steps, cheapest first:
1. Extraction: the last `\\boxed{}` content, else the last `Answer:` line; none -> 0.0 (no answer).
2. Exact fast path: both sides normalised with value-keeping rewrites (`answer_values.py`); equal strings
   are equal; numbers, tuples, intervals, sets and lists of numbers, and named values (`x = 5`), are
   compared exactly; plain algebra (polynomials, rational functions and their equations) is decided by
   sympy's expression parser and `cancel` in about a millisecond (`algebra.py`). Most right and most
   wrong answers need no LaTeX parsing at all.
3. Otherwise math-verify's symbolic comparison of the two answers (timeouts off; the pool bounds time).

The fast path declines whatever it cannot decide exactly: values that differ only beyond 4 significant
digits (where math-verify's float rounding may call them equal), mixed kinds (a tuple against a bare
list), functions, roots, inequalities, matrices. Those go to step 3.
"""

from fractions import Fraction

from services.reward.verifiers.algebra import algebra_equal
from services.reward.verifiers.answer_values import answer_value, normalize_answer, rounded, split_named
from services.reward.verifiers.extract import final_answer
from services.reward.verifiers.symbolic import answers_equal_symbolic

_CONSTANTS = {"e", "i", "pi", "inf", "infty", "oo", "infinity"}


def _has_letter(text: str) -> bool:
    return any(char.isalpha() for char in text.replace("\\frac", ""))


def _compare_values(left: object, right: object) -> bool | None:
    if left == right:
        return True
    if left[0] != right[0] or rounded(left) == rounded(right):
        return None  # a tuple against a list, or a near-tie: not decidable here
    return False


def _percent(text: str) -> tuple[str, bool]:
    return (text[:-1], True) if text.endswith("%") else (text, False)


def decide(left: str, right: str) -> bool | None:
    """Exact verdict on two normalised answers, or None when only a symbolic check can tell."""
    if left == right:
        return True
    left_named, right_named = split_named(left), split_named(right)
    if left_named and "=" not in right:
        return decide(left_named[1], right)
    if right_named and "=" not in left:
        return decide(left, right_named[1])
    if left_named and right_named and left_named[0] == right_named[0]:
        return decide(left_named[1], right_named[1])
    (left, left_percent), (right, right_percent) = _percent(left), _percent(right)
    left_value, right_value = answer_value(left), answer_value(right)
    if left_value is None or right_value is None:
        # A bare word against a number ("AZYUK2A" vs "2") is never equal, unless the word is a constant.
        for word, other in ((left, right_value), (right, left_value)):
            if (other is not None and other[0] == "num" and word.isalnum() and word[0].isalpha()
                    and word.lower() not in _CONSTANTS):
                return False
        if _has_letter(left) and _has_letter(right):
            return algebra_equal(left, right)  # polynomials, rational functions, their equations
        return None
    verdict = _compare_values(left_value, right_value)
    if verdict is False and left_percent != right_percent and left_value[0] == right_value[0] == "num":
        ratio = left_value[1] / right_value[1] if right_value[1] else None
        if ratio in (100, Fraction(1, 100)):
            return None  # "25%" against "0.25": a convention, let math-verify decide
    return verdict


def answers_equivalent(answer: str, ground_truth: str) -> bool:
    """True when two extracted answers denote the same value (exact fast path, then math-verify)."""
    left, right = normalize_answer(answer), normalize_answer(ground_truth)
    if not left or not right:
        return False  # an empty box is no answer
    verdict = decide(left, right)
    if verdict is not None:
        return verdict
    return answers_equal_symbolic(answer, ground_truth)


def math_equiv(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer is equivalent to `ground_truth`, else 0.0."""
    answer = final_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equivalent(answer, ground_truth) else 0.0

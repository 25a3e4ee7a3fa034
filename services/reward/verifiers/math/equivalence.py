"""When two extracted answers are equal: the exact fast path, then math-verify.

1. Exact fast path: both sides normalised with value-keeping rewrites (`answer_values.py`); equal strings
   are equal; numbers, tuples, intervals, sets and lists of numbers, and named values (`x = 5`), are
   compared exactly; so are the structured forms of `structure.py` (inequalities against inequalities
   or intervals, `\\pm a`, lists of named values, numbers in a base, matrices cell by cell); plain
   algebra (polynomials, rational functions and their equations) is decided by sympy's expression
   parser and `cancel` in about a millisecond (`algebra.py`), and roots, sequences `F_{n}` and finite
   sums by `expressions.py` (equal by canonical form, unequal by evaluation at a few points). Most right
   and most wrong answers need no LaTeX parsing at all.
2. Otherwise math-verify's symbolic comparison of the two answers (`symbolic.py`; timeouts off, the pool
   bounds time).

The fast path declines whatever it cannot decide exactly: values that differ only beyond 4 significant
digits (where math-verify's float rounding may call them equal), mixed kinds (a tuple against a bare
list), functions like sin or log, identities that need a theorem. Those go to step 2.
"""

from fractions import Fraction

from services.reward.verifiers.math.algebra import algebra_equal
from services.reward.verifiers.math.answer_values import answer_value, normalize_answer, rounded, split_named
from services.reward.verifiers.math.expressions import expressions_equal
from services.reward.verifiers.math.structure import (
    base_number,
    inequality_set,
    interval_set,
    matrix_cells,
    named_list,
    plus_minus,
)
from services.reward.verifiers.math.symbolic import answers_equal_symbolic

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


def _all_or_none(verdicts: list[bool | None]) -> bool | None:
    if False in verdicts:
        return False
    return None if None in verdicts else True


def _decide_structured(left: str, right: str) -> bool | None:
    """Verdicts on the forms of `structure.py`; None when neither side is one of them."""
    left_matrix, right_matrix = matrix_cells(left), matrix_cells(right)
    if left_matrix is not None and right_matrix is not None:
        if [len(row) for row in left_matrix] != [len(row) for row in right_matrix]:
            return None  # shapes differ, or a row break was lost in the text: math-verify reads it
        return _all_or_none([decide(a, b) for row_a, row_b in zip(left_matrix, right_matrix, strict=True)
                             for a, b in zip(row_a, row_b, strict=True)])
    left_relation, right_relation = inequality_set(left), inequality_set(right)
    if left_relation is not None or right_relation is not None:
        # An inequality against an inequality or an interval: compare solution sets.
        left_set = left_relation if left_relation is not None else interval_set(left)
        right_set = right_relation if right_relation is not None else interval_set(right)
        if left_set is None or right_set is None:
            return None
        return left_set == right_set
    for one, other in ((left, right), (right, left)):
        signs = plus_minus(one)
        if signs is not None:
            value = answer_value(other)
            if value is not None and value[0] == "bag" and all(item[0] == "num" for item in value[1]):
                return frozenset(item[1] for item in value[1]) == signs  # "\\pm 3" is the set {3, -3}
            if value is not None and value[0] == "num":
                return False  # one number is not two
            return None
    left_base, right_base = base_number(left), base_number(right)
    if left_base is not None and right_base is not None and left_base[1] == right_base[1]:
        return left_base == right_base  # same base: same digits
    left_names, right_names = named_list(left), named_list(right)
    if left_names is not None and right_names is not None:
        if set(left_names) != set(right_names):
            return None
        return _all_or_none([decide(value, right_names[name]) for name, value in left_names.items()])
    return None


def _equation_against_value(answer: str, label: str) -> bool:
    """True for a label equation that assigns nothing (`2x + z = 1`) against an answer without `=`.

    math-verify unwraps a label `x = 1` to its value, but compares an equation whose left side is an
    expression with the answer as it is: an expression is never equal to an equation.
    """
    if "=" in answer or any(op in answer for op in ("<", ">", "\\le", "\\ge")):
        return False
    sides = label.split("=")
    if len(sides) != 2 or not sides[0] or not sides[1]:
        return False
    lhs = sides[0]
    return any(op in lhs[1:] for op in "+-") and "(" not in lhs and "{" not in lhs


def decide(left: str, right: str) -> bool | None:
    """Exact verdict on two normalised answers, or None when only a symbolic check can tell."""
    if left == right:
        return True
    structured = _decide_structured(left, right)
    if structured is not None:
        return structured
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
            verdict = algebra_equal(left, right)  # polynomials, rational functions, their equations
            if verdict is not None:
                return verdict
        if _equation_against_value(left, right):
            return False
        return expressions_equal(left, right)  # roots, sequences, sums
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


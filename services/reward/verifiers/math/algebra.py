"""Exact comparison of plain algebraic answers (polynomials, rational functions, their equations).

math-verify parses LaTeX with an ANTLR grammar that costs tens to hundreds of milliseconds per answer.
Answers written with only numbers, single-letter variables, `+ - * / ^`, parentheses and `\\frac` are
parsed here with sympy's Python-expression parser instead (about a millisecond) and decided exactly:
- two expressions are equal iff `cancel(a - b) == 0` (a decision procedure for rational functions);
- two equations `A = B`, `C = D` are equal iff (A - B) / (C - D) cancels to a nonzero constant
  (math-verify's reading too: `x^2/16 + y^2/12 = 1/4` equals `x^2/4 + y^2/3 = 1`).
Decimals become exact rationals. Anything else (functions, roots, inequalities, huge powers, the letters
e and i, an equation against an expression) returns None and goes to math-verify.
"""

import re

import sympy

from services.reward.verifiers.math.extract import closing_brace
from services.reward.verifiers.math.sympy_parse import has_names, parse_side

_PLAIN = re.compile(r"^[0-9a-zA-Z+\-*/^().=]+$")
_HUGE_POWER = re.compile(r"\^\(?\d{3,}|\d{40,}")
_FRAC = "\\frac{"


def _tex_to_python(text: str) -> str | None:
    """`\\frac{a}{b}` -> `((a)/(b))`, `\\cdot`/`\\times` -> `*`, braces -> parentheses; None if other TeX."""
    text = text.replace("\\cdot", "*").replace("\\times", "*")
    while _FRAC in text:
        start = text.index(_FRAC)
        numerator_end = closing_brace(text, start + len(_FRAC) - 1)
        if numerator_end is None or numerator_end + 1 >= len(text) or text[numerator_end + 1] != "{":
            return None
        denominator_end = closing_brace(text, numerator_end + 1)
        if denominator_end is None:
            return None
        numerator = text[start + len(_FRAC) : numerator_end]
        denominator = text[numerator_end + 2 : denominator_end]
        text = f"{text[:start]}(({numerator})/({denominator})){text[denominator_end + 1:]}"
    if "\\" in text:
        return None
    return text.replace("{", "(").replace("}", ")")


def _parse(text: str) -> sympy.Expr | None:
    if _HUGE_POWER.search(text) or has_names(text):
        return None
    return parse_side(text, {char: sympy.Symbol(char) for char in set(text) if char.isalpha()})


def _sides(text: str) -> list[sympy.Expr] | None:
    parts = text.split("=")
    if len(parts) > 2:
        return None
    sides = [_parse(part) for part in parts]
    return None if any(side is None for side in sides) else sides


def algebra_equal(left: str, right: str) -> bool | None:
    """Exact verdict for two normalised plain-algebra answers, or None when they are not plain algebra."""
    left_py, right_py = _tex_to_python(left), _tex_to_python(right)
    if left_py is None or right_py is None or not _PLAIN.match(left_py) or not _PLAIN.match(right_py):
        return None
    left_sides, right_sides = _sides(left_py), _sides(right_py)
    if left_sides is None or right_sides is None or len(left_sides) != len(right_sides):
        return None
    if len(left_sides) == 1:
        return sympy.cancel(left_sides[0] - right_sides[0]) == 0
    left_zero = left_sides[0] - left_sides[1]
    right_zero = right_sides[0] - right_sides[1]
    if sympy.cancel(left_zero) == 0 or sympy.cancel(right_zero) == 0:
        return None  # an identity like x = x: leave it to math-verify
    ratio = sympy.cancel(left_zero / right_zero)
    return bool(ratio.is_number and ratio != 0)

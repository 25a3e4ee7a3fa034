"""Cheap verdicts on answers beyond plain algebra: roots, subscripted sequences and finite sums.

`algebra.py` decides polynomials and rational functions exactly. This module reads a little more LaTeX
(`\\sqrt{a}`, `\\sqrt[n]{a}`, `X_{k}` as the value of a sequence X at k, `\\sum_{k=a}^{b}`) into sympy
through its Python-expression parser (milliseconds, where math-verify's LaTeX parser and `simplify`
take 0.05-2 s on the same answers), and decides only what it can decide soundly:
- equal: the difference of the two expressions is 0 after sympy's canonical form and `cancel`
  (sums are equal when their bounds and summands are: sympy orders products canonically);
- not equal: both sides evaluate, at a few positive integer points with every sequence replaced by a
  fixed table of integers, to values that differ by more than 1e-3 relative. Expressions that are equal
  never differ at a point, so this cannot reject a right answer; values that agree to 3 digits (a
  rounded decimal against a root) are left to math-verify, whose float rounding decides them.
Two equations compare by their zero forms `A - B` (their ratio must be a nonzero constant). Everything
else (functions like sin or log, the letters e and i, inequalities, words) returns None.
"""

import functools
import random
import re

import sympy
from sympy.core.function import AppliedUndef

from services.reward.verifiers.math.sympy_parse import has_names, parse_side

_PLAIN = re.compile(r"^[0-9a-zA-Z+\-*/().=,]+$")
_HUGE = re.compile(r"\*\*\(?\d{3,}|\d{40,}")
_RELATIVE_TOLERANCE = 1e-3
# Positive integer points: sums need integer bounds, roots stay real.
_POINTS = ((2, 3, 5, 7, 11, 13), (3, 7, 2, 11, 5, 4), (6, 4, 9, 3, 8, 2))
_MAX_TERMS = 60  # a sum longer than this at a probe point is not cheap: no verdict


class _NotOursError(Exception):
    """The text uses LaTeX this reader does not handle."""


def _group(text: str, start: int) -> tuple[str, int]:
    """The argument at `start`: a `{...}` group's content or a single character; and the index after it."""
    if start >= len(text):
        raise _NotOursError
    if text[start] != "{":
        if text[start] == "\\":
            raise _NotOursError
        return text[start], start + 1
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[start + 1 : i], i + 1
    raise _NotOursError


def _term_end(text: str, start: int) -> int:
    """End of the product that starts at `start`: the next top-level `+`, `-`, `=` or `,`."""
    depth = 0
    for i in range(start, len(text)):
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:
                return i
        elif depth == 0 and char in "+-=," and i > start:
            return i
    return len(text)


def _convert(text: str, functions: set[str]) -> str:
    """LaTeX (normalised) -> sympy Python syntax; raises _NotOursError on anything else."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("\\sum_", i):
            lower, i = _group(text, i + 5)
            if i >= len(text) or text[i] != "^":
                raise _NotOursError
            upper, i = _group(text, i + 1)
            variable, sep, start = lower.partition("=")
            if not sep or len(variable) != 1 or not variable.isalpha():
                raise _NotOursError
            end = _term_end(text, i)
            body = _convert(text[i:end], functions)
            out.append(f"Sum(({body}),({variable},({_convert(start, functions)}),({_convert(upper, functions)})))")
            i = end
        elif text.startswith("\\frac", i):
            numerator, i = _group(text, i + 5)
            denominator, i = _group(text, i)
            out.append(f"(({_convert(numerator, functions)})/({_convert(denominator, functions)}))")
        elif text.startswith("\\sqrt", i):
            i += 5
            degree = "2"
            if i < len(text) and text[i] == "[":
                close = text.find("]", i)
                if close < 0:
                    raise _NotOursError
                degree, i = _convert(text[i + 1 : close], functions), close + 1
            radicand, i = _group(text, i)
            out.append(f"(({_convert(radicand, functions)})**(1/({degree})))")
        elif text.startswith("\\cdot", i) or text.startswith("\\times", i):
            out.append("*")
            i += 5 if text.startswith("\\cdot", i) else 6
        elif text[i] == "\\":
            raise _NotOursError
        elif text[i] == "_":
            name = out[-1] if out else ""
            if len(name) != 1 or not name.isalpha():
                raise _NotOursError
            functions.add(name)
            index, i = _group(text, i + 1)
            out.append(f"({_convert(index, functions)})")
        elif text[i] == "^":
            exponent, i = _group(text, i + 1)
            out.append(f"**({_convert(exponent, functions)})")
        elif text[i] == "{":
            inner, i = _group(text, i)
            out.append(f"({_convert(inner, functions)})")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[sympy.Expr, ...] | None:
    """The sides of an expression or equation (cached: a label is parsed once per process)."""
    functions: set[str] = set()
    try:
        python = _convert(text, functions)
    except _NotOursError:
        return None
    bare = python.replace("Sum(", "(")
    if not _PLAIN.match(python) or _HUGE.search(python) or has_names(bare):
        return None
    names: dict[str, object] = {char: sympy.Symbol(char) for char in set(bare) if char.isalpha()}
    names.update({name: sympy.Function(name) for name in functions})
    names["Sum"] = sympy.Sum
    sides = []
    for part in python.split("="):
        expr = parse_side(part, names)
        if expr is None:
            return None
        sides.append(expr)
    return tuple(sides) if len(sides) <= 2 else None


def _table_value(function: sympy.Expr) -> sympy.Integer:
    # A fixed pseudo-random integer per (sequence, index): both answers see the same sequence.
    return sympy.Integer(random.Random(f"{function.func}:{function.args}").randint(1, 10**6))


def _value_at(expr: sympy.Expr, point: tuple[int, ...], symbols: list[sympy.Symbol]) -> complex | None:
    substituted = expr.subs({symbol: point[j % len(point)] + j // len(point) for j, symbol in enumerate(symbols)})
    for total in substituted.atoms(sympy.Sum):
        low, high = total.limits[0][1:]
        if not (low.is_integer and high.is_integer) or high - low > _MAX_TERMS:
            return None
    substituted = substituted.doit()
    substituted = substituted.replace(lambda e: isinstance(e, AppliedUndef), _table_value)
    if substituted.free_symbols:
        return None
    try:
        value = complex(sympy.N(substituted, 30))
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def _differs(left: sympy.Expr, right: sympy.Expr, *, proportional: bool) -> bool:
    """True when the two expressions differ at some probe point (or, for zero forms of equations,
    are not proportional there). False means "no difference seen", not "equal"."""
    symbols = sorted(left.free_symbols | right.free_symbols, key=lambda s: s.name)
    ratio = None
    for point in _POINTS:
        a, b = _value_at(left, point, symbols), _value_at(right, point, symbols)
        if a is None or b is None:
            return False
        scale = max(abs(a), abs(b))
        if not proportional:
            if abs(a - b) > _RELATIVE_TOLERANCE * scale and abs(a - b) > 1e-9:
                return True
            continue
        if scale < 1e-9:
            continue
        if abs(a) < 1e-9 * scale or abs(b) < 1e-9 * scale:
            return True  # one side's equation holds at this point and the other's does not
        if ratio is None:
            ratio = a / b
        elif abs(a / b - ratio) > _RELATIVE_TOLERANCE * abs(ratio):
            return True
    return False


def expressions_equal(left: str, right: str) -> bool | None:
    """Verdict on two normalised answers with roots, sequences or sums; None when not decidable here."""
    left_sides, right_sides = _parse(left), _parse(right)
    if left_sides is None or right_sides is None or len(left_sides) != len(right_sides):
        return None
    try:
        if len(left_sides) == 1:
            a, b = left_sides[0], right_sides[0]
            if a == b or sympy.cancel(a - b) == 0:
                return True
            return False if _differs(a, b, proportional=False) else None
        left_zero = left_sides[0] - left_sides[1]
        right_zero = right_sides[0] - right_sides[1]
        if left_zero == 0 or right_zero == 0:
            return None  # an identity: math-verify's business
        if sympy.cancel(left_zero - right_zero) == 0 or sympy.cancel(left_zero + right_zero) == 0:
            return True
        return False if _differs(left_zero, right_zero, proportional=True) else None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, RecursionError, sympy.SympifyError):
        return None

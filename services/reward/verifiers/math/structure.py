"""Exact readings of structured answers that `answer_values.py` leaves alone: no sympy, no LaTeX parser.

Each reader takes a normalised answer (`normalize_answer`) and returns a comparable value, or None when
the answer is not of its form; `math_equiv.decide` compares the values. The forms:
- one-variable inequalities with number bounds (`-2 \\le x \\le 7`, `5 \\geq x`, `-x > -1`) and the
  intervals they may be compared with (`[-2,7]`, `(0,1)`, `[3,\\infty)`): a solution set
  (low, low closed, high, high closed), as math-verify reads a relation against a set;
- `\\pm a`: the set {a, -a};
- lists of named values (`a_3 = 2, a_{37} = 19`): name -> value, when no name repeats;
- numbers in a base (`1112122_3`): digits and base;
- matrices (`pmatrix`, `bmatrix`, `matrix`): rows of cells, each cell compared on its own.
Only the variable's coefficient +1 or -1 is read: `2x < 2` against `x < 1` is left to math-verify, which
compares relations by their sides, not by their solution sets.
"""

import re
from fractions import Fraction

from services.reward.verifiers.math.answer_values import as_number, split_named, split_top_level

# Relation tokens after normalisation (spaces are gone, so `\geqx` is `\geq` then `x`).
_RELATION = re.compile(r"\\leq(?:slant)?|\\geq(?:slant)?|\\le(?![a-z])|\\ge(?![a-z])|\\lt(?![a-z])|\\gt(?![a-z])"
                       r"|<=|>=|≤|≥|<|>")
_LESS = {"\\leq": "<=", "\\leqslant": "<=", "\\le": "<=", "<=": "<=", "≤": "<=", "\\lt": "<", "<": "<"}
_GREATER = {"\\geq": ">=", "\\geqslant": ">=", "\\ge": ">=", ">=": ">=", "≥": ">=", "\\gt": ">", ">": ">"}
# The variable of an inequality: a letter with an optional subscript, or a function value `f(x)`.
_VARIABLE = re.compile(r"^-?(?:[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?(?:\([A-Za-z]\))?)$")
_INFINITY = {"\\infty": 1, "+\\infty": 1, "-\\infty": -1, "\\inf": 1, "-\\inf": -1, "oo": 1, "-oo": -1}
_BASE_NUMBER = re.compile(r"^([0-9A-Za-z]+)_\{?(\d{1,2})\}?$")
# Determinants (`vmatrix`) are numbers, not matrices: not read here.
_MATRIX = re.compile(r"^\\begin\{([pbB]?matrix)\}(.*)\\end\{\1\}$", re.DOTALL)
_PLUS_MINUS = re.compile(r"^\\pm(.+)$")

# A solution set on the real line: (low, low closed, high, high closed); None bounds are infinite.
SolutionSet = tuple[Fraction | None, bool, Fraction | None, bool]


def _bound(text: str) -> tuple[Fraction | None, int] | None:
    """(value, 0) for a number, (None, +1/-1) for plus/minus infinity, None otherwise."""
    if text in _INFINITY:
        return None, _INFINITY[text]
    number = as_number(text)
    return (number, 0) if number is not None else None


def _relations(text: str) -> tuple[list[str], list[str]] | None:
    """Parts and relation operators of a top-level chain like `a<x<=b`; None when there is no relation."""
    parts, ops, start = [], [], 0
    depth = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            match = _RELATION.match(text, i)
            if match:
                parts.append(text[start:i])
                ops.append(match.group(0))
                i = start = match.end()
                continue
        i += 1
    parts.append(text[start:])
    if not ops or len(ops) > 2 or any(not part for part in parts):
        return None
    return parts, [_LESS.get(op) or _GREATER[op] for op in ops]


def _flip(op: str) -> str:
    return {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]


def inequality_set(text: str) -> SolutionSet | None:
    """The solution set of a one-variable inequality with number bounds, else None.

    `a < x <= b`, `x > a`, `a >= x` and the same with `-x` (which flips the relation).
    """
    chain = _relations(text)
    if chain is None:
        return None
    parts, ops = chain
    variables = [i for i, part in enumerate(parts) if _VARIABLE.match(part) and as_number(part) is None
                 and part.lstrip("-") not in _INFINITY]
    if len(variables) != 1:
        return None
    index = variables[0]
    negated = parts[index].startswith("-")
    low: Fraction | None = None
    high: Fraction | None = None
    low_closed = high_closed = False
    for side, op in ((index - 1, ops[index - 1] if index > 0 else None), (index + 1, ops[index] if index < len(ops) else None)):
        if op is None:
            continue
        bound = _bound(parts[side])
        if bound is None or bound[1] != 0:
            return None  # `x < \infty` and friends: leave them to math-verify
        value = bound[0]
        # Write every relation as `variable op value`.
        relation = op if side > index else _flip(op)
        if negated:
            relation, value = _flip(relation), -value
        if relation in ("<", "<="):
            if high is not None:
                return None
            high, high_closed = value, relation == "<="
        else:
            if low is not None:
                return None
            low, low_closed = value, relation == ">="
    if len(ops) == 2 and (low is None or high is None):
        return None  # `a < x > b` is not an interval
    return low, low_closed, high, high_closed


def interval_set(text: str) -> SolutionSet | None:
    """The set of an interval written `(a,b)`, `[a,b)`, `[a,\\infty)`, ...; None otherwise."""
    if len(text) < 5 or text[0] not in "([" or text[-1] not in ")]":
        return None
    parts = split_top_level(text[1:-1])
    if len(parts) != 2:
        return None
    low, high = _bound(parts[0]), _bound(parts[1])
    if low is None or high is None or low[1] == 1 or high[1] == -1:
        return None
    if low[0] is not None and high[0] is not None and low[0] >= high[0]:
        return None
    return low[0], text[0] == "[" and low[0] is not None, high[0], text[-1] == "]" and high[0] is not None


def plus_minus(text: str) -> frozenset[Fraction] | None:
    """`\\pm a` for a number a: {a, -a}; None otherwise."""
    match = _PLUS_MINUS.match(text)
    if not match:
        return None
    number = as_number(match.group(1))
    return None if number is None else frozenset({number, -number})


def named_list(text: str) -> dict[str, str] | None:
    """`a=1,b=2` (two or more named values, no name repeated): name -> value text; None otherwise."""
    items = [item for item in split_top_level(text, ",;") if item]
    if len(items) < 2:
        return None
    named = [split_named(item) for item in items]
    if any(pair is None for pair in named):
        return None
    names = [pair[0] for pair in named]
    if len(set(names)) != len(names):
        return None  # `p=5,q=2;p=7,q=2`: a repeated name means grouped solutions, not a flat list
    return dict(named)


def base_number(text: str) -> tuple[str, int] | None:
    """`1112122_3`: (digits without leading zeros, base) when every digit is valid in the base."""
    match = _BASE_NUMBER.match(text)
    if not match:
        return None
    base = int(match.group(2))
    if not 2 <= base <= 36:
        return None
    digits = match.group(1).lower()
    try:
        int(digits, base)
    except ValueError:
        return None
    return digits.lstrip("0") or "0", base


def matrix_cells(text: str) -> list[list[str]] | None:
    """Rows of cell texts of a `pmatrix`/`bmatrix`/`matrix` environment; None otherwise.

    A trailing row break before `\\end` (also when an over-escaped label left a single backslash) is
    no extra row.
    """
    match = _MATRIX.match(text)
    if not match:
        return None
    body = match.group(2).rstrip("\\")
    if "\\begin" in body:
        return None  # nested environments
    rows = [row.split("&") for row in body.split("\\\\")]
    if any(not cell for row in rows for cell in row):
        return None
    return rows

"""The one sympy parse of cheap answers: Python-expression syntax in, a finite sympy expression or None out.

`algebra.py` and `expressions.py` both turn normalised LaTeX into Python syntax and hand it here; the
parser settings, the letters that are not ours to read and the checks on the result live only here.
"""

import re

import sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    rationalize,
    standard_transformations,
)

TRANSFORMS = standard_transformations + (convert_xor, rationalize, implicit_multiplication_application)
# Two letters in a row could be a function name (sin, ln, exp, pi, ...): not ours to read.
_WORD = re.compile(r"[A-Za-z]{2,}")
# e and i read as Euler's number and the imaginary unit in math-verify; as variables they would differ.
_CONSTANT_LETTERS = frozenset("eiEI")


def has_names(text: str) -> bool:
    """True when `text` holds a word (a function or constant name) or the letters e or i."""
    return bool(_WORD.search(text) or _CONSTANT_LETTERS.intersection(text))


def parse_side(text: str, names: dict[str, object]) -> sympy.Expr | None:
    """`text` (Python syntax) as a finite sympy expression over `names`; None when it is not one."""
    try:
        expr = parse_expr(text, local_dict=names, transformations=TRANSFORMS, evaluate=True)
    except (SyntaxError, TypeError, ValueError, ZeroDivisionError, AttributeError, sympy.SympifyError):
        return None
    if not isinstance(expr, sympy.Expr) or expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        return None
    return expr

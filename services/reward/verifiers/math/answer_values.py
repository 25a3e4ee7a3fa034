"""Exact, cheap reading of final answers: canonical strings and the values of plain numbers and lists.

Used by `math_equiv` before any symbolic work. Every rewrite here keeps the answer's value (spacing,
`\\left`/`\\right`, `\\dfrac`, `$`, `\\text{}` wrappers, degree marks, thousands separators, a unit word
after a number), and `answer_value` only reads what it can read exactly: integers, decimals, `a/b`,
`\\frac{a}{b}`, tuples/intervals `(a,b]`, sets `\\{a,b\\}` and bare lists `a, b and c` of those, and
named values `x = 5`. Anything else is None, which sends the pair to math-verify.
"""

import re
from fractions import Fraction

# Removed outright: TeX spacing and sizing that never change a value.
_NOISE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad")
_REPLACE = (("\\$", ""), ("$", ""), (",\\! ", ","), (",\\!", ","), ("\\textbf{", "\\text{"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"), ("{,}", ","), ("\\le ", "\\leq "),
            ("\\ge ", "\\geq "), ("\\textnormal{", "\\text{"))
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°")
_MATH_DELIMITERS = re.compile(r"^\\[(\[](.*)\\[)\]]$", re.DOTALL)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
# A number followed by a unit in words: "125 miles", "10\text{ square units}", "28 percent".
_NUMBER_WITH_UNIT = re.compile(
    r"^([+-]?[\d.,]+|[+-]?\\frac\{\d+\}\{\d+\})\s*(?:\\text\{\s*([A-Za-z][A-Za-z .]*)\}|\s([A-Za-z][A-Za-z ]*))\.?$"
)
_PERCENT_WORDS = {"percent", "percentage", "pct"}
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)$")
_SLASH_FRACTION = re.compile(r"^([+-]?\d+)/(\d+)$")
_TEX_FRACTION = re.compile(r"^([+-]?)\\frac\{?(-?\d+)\}?\{?(\d+)\}?$")
_IMPLICIT_TIMES = re.compile(r"(\d)\*([A-Za-z])")
# TeX shorthand with single-token arguments: \frac94 is \frac{9}{4}, \sqrt3 is \sqrt{3}.
_SHORT_FRAC = re.compile(r"\\frac(\d)(\d)")
_SHORT_SQRT = re.compile(r"\\sqrt(\d)")
# A mixed number, as math-verify reads it: 918\frac{1}{2} is 918 + 1/2.
_MIXED = re.compile(r"^([+-]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_MEMBER = re.compile(r"^([A-Za-z])\\in(?![A-Za-z])(.+)$")
# A label escaped twice (`\\\\left`) reads as a line break before a command; undo the escaping.
_DOUBLE_ESCAPE = re.compile(r"\\\\(?=[A-Za-z])")
# A row break followed by spaces (`\\\\ 0 & 1`): the spaces go first, so `\\ ` (a TeX space) cannot eat it.
_ROW_BREAK_SPACES = re.compile(r"\\\\\s+")
# The left side of a named value: a name, not an expression (no operators, not a number).
_NAME = re.compile(r"^(?=.*[A-Za-z])[A-Za-z0-9_{}()|:,\\']+$")
_SPACED_LIST_WORD = re.compile(r",?\s+(?:and|or)\s+")
_TEXT_LIST_WORD = re.compile(r",?\s*\\text\{\s*(?:and|or)\s*\}\s*")
_LIST_WORDS = re.compile(r",?(?:\\text\{(?:and|or)\}|\b(?:and|or)\b)")


def normalize_answer(answer: str) -> str:
    """Canonical string for an answer, using only rewrites that keep its value."""
    text = _DOUBLE_ESCAPE.sub(r"\\", answer.strip())
    text = _ROW_BREAK_SPACES.sub(r"\\\\", text)
    for old, new in _REPLACE:
        text = text.replace(old, new)
    text = _DEGREES.sub("", text).strip()
    delimited = _MATH_DELIMITERS.match(text)
    if delimited:
        text = delimited.group(1).strip()
    unit = _NUMBER_WITH_UNIT.match(text)
    if unit:
        words = (unit.group(2) or unit.group(3) or "").strip().lower()
        text = unit.group(1) + ("%" if words in _PERCENT_WORDS else "")
    text = _TEXT_LIST_WORD.sub(",", text)
    for _ in range(3):  # nested wrappers unwrap one level per pass
        unwrapped = _WRAPPERS.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    for noise in _NOISE:
        text = text.replace(noise, "")
    text = _SPACED_LIST_WORD.sub(",", text)  # "1 and 2", "6 \text{ and } 8" are lists
    # Before spaces go: "32, 349" is a list of two numbers, "32,349" one number.
    thousands = _THOUSANDS.match(text.strip().rstrip(".")) is not None
    text = "".join(text.split()).rstrip(".")
    text = text.replace("\\%", "%")
    if len(text) > 2 and text[0] == "{" and text[-1] == "}" and "}" not in text[1:-1]:
        text = text[1:-1]
    if thousands:
        text = text.replace(",", "")
    text = _IMPLICIT_TIMES.sub(r"\1\2", text)
    text = _SHORT_SQRT.sub(r"\\sqrt{\1}", _SHORT_FRAC.sub(r"\\frac{\1}{\2}", text))
    if _encloses(text, "(", ")") and len(split_top_level(text[1:-1])) == 1:
        text = text[1:-1]  # "(1/3)" is 1/3; "(1,3)" stays a pair
    return text


def as_number(text: str) -> Fraction | None:
    """The exact value of a plain number (integer, decimal, `a/b`, `\\frac{a}{b}`), else None."""
    if _DECIMAL.match(text):
        return Fraction(text)
    match = _SLASH_FRACTION.match(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _TEX_FRACTION.match(text)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) == "-" else value
    match = _MIXED.match(text)
    if match and int(match.group(4)) != 0:
        value = int(match.group(2)) + Fraction(int(match.group(3)), int(match.group(4)))
        return -value if match.group(1) == "-" else value
    return None


def split_top_level(text: str, separators: str = ",") -> list[str]:
    """Split on separators that are not inside brackets or braces."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char in separators and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _encloses(text: str, opener: str, closer: str) -> bool:
    """True when `text` starts with `opener`, ends with `closer` and that pair encloses all of it."""
    if len(text) < 2 or not text.startswith(opener) or not text.endswith(closer):
        return False
    depth = 0
    for i, char in enumerate(text[len(opener) : len(text) - len(closer)]):
        depth += (char in "([{") - (char in ")]}")
        if depth < 0:
            return False
        del i
    return depth == 0


def split_named(text: str) -> tuple[str, str] | None:
    """(name, value) for `name=value` with one top-level `=` and a name-like left side, else None."""
    member = _MEMBER.match(text)
    if member:
        return member.group(1), member.group(2)  # x \in [a, b]
    parts = split_top_level(text, "=")
    if len(parts) != 2 or not parts[1] or parts[1].startswith("="):
        return None
    name, value = parts
    return (name, value) if _NAME.match(name) and as_number(name) is None else None


def answer_value(text: str) -> object | None:
    """A hashable exact value for numbers, sequences, sets and lists of them; None when not exact.

    Forms: ("num", Fraction), ("seq", brackets, values) for tuples and intervals (order and bracket
    kind matter), ("bag", frozenset) for sets and bare lists (order and repeats do not). Only the whole
    answer may be a named value (`x = 5`); named items inside lists are left to math-verify.
    """
    number = as_number(text)
    if number is not None:
        return ("num", number)
    named = split_named(text)
    if named is not None:
        return answer_value(named[1])
    return _composite_value(text)


def _element(text: str) -> object | None:
    number = as_number(text)
    return ("num", number) if number is not None else _composite_value(text)


def _composite_value(text: str) -> object | None:
    if _encloses(text, "\\{", "\\}"):
        return _bag(split_top_level(text[2:-2], ",;"))
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and _encloses("(" + text[1:-1] + ")", "(", ")"):
        values = [_element(part) for part in split_top_level(text[1:-1], ",;")]
        if len(values) < 2 or None in values:
            return None
        return ("seq", text[0] + text[-1], tuple(values))
    items = split_top_level(_LIST_WORDS.sub(",", text), ",;")
    if len(items) > 1:
        return _bag(items)
    return None


def _bag(items: list[str]) -> object | None:
    # Named items ("p=5,q=2;p=7,q=2") may group into tuples in ways a flat reading gets wrong.
    values = [_element(item) for item in items if item]
    if not values or None in values:
        return None
    return ("bag", frozenset(values))  # a set: math-verify reads a repeated element once


def rounded(value: object) -> object:
    """`value` with every number rounded to 4 significant digits (to spot near-ties)."""
    if isinstance(value, Fraction):
        return float(f"{float(value):.4g}")
    if isinstance(value, tuple | frozenset):
        return type(value)(rounded(v) for v in value)
    return value

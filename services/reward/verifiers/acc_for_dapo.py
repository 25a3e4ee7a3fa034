"""`acc_for_dapo`: DAPO's rule, +1.0 when the last `Answer:` line matches the label, else -1.0.

Only the last 300 characters are read (DAPO: the longest MATH-500 answer is 159 characters). Both sides
go through the Minerva normalisation (Lewkowycz et al. 2022, appendix D): keep the right-hand side of
the last `=`, drop units and filler words, unwrap `\\text{}`/`\\boxed{}`, canonicalise `\\frac`/`\\sqrt`
shorthand, strip thousands separators from integers. Exact string equality after that.
"""

import re

_TAIL_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NO_ANSWER = "[INVALID]"

# (before, after) string replacements, applied in order.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Units, filler words and TeX spacing removed outright.
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
)
_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    # TeX shorthand: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def minerva_normalize(answer: str) -> str:
    """Minerva's final-answer normalisation (string in, canonical string out)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in _UNWRAP:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def acc_for_dapo(response: str, ground_truth: str) -> float:
    """+1.0 when the normalised last `Answer:` equals the normalised label, else -1.0."""
    matches = _ANSWER.findall(response[-_TAIL_CHARS:])
    predicted = minerva_normalize(matches[-1] if matches else _NO_ANSWER)
    return 1.0 if predicted == minerva_normalize(ground_truth) else -1.0

"""`step`: rewards visible step-by-step reasoning, min(1, markers / 3).

Markers (MindSpeed-RL's pattern): `Step N:`, a numbered line `N.` at the start of the text, a line
starting with `-` or `*`, and the words `First,` `Second,` `Next,` `Finally,`.
"""

import re

_STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def score(response: str, ground_truth: str) -> float:
    """min(1.0, number of step markers / 3); `ground_truth` is unused."""
    del ground_truth
    return min(1.0, len(_STEP_MARKERS.findall(response)) / 3)

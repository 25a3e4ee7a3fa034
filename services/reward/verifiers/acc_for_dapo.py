"""`acc_for_dapo`: DAPO's rule, +1.0 when the last `Answer:` line matches the label, else -1.0.

Only the last 300 characters are read (DAPO: the longest MATH-500 answer is 159 characters). Both sides
go through the Minerva normalisation (`math/minerva.py`); exact string equality after that.
"""

import re

from services.reward.verifiers.math.minerva import minerva_normalize

_TAIL_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NO_ANSWER = "[INVALID]"


def score(response: str, ground_truth: str) -> float:
    """+1.0 when the normalised last `Answer:` equals the normalised label, else -1.0."""
    matches = _ANSWER.findall(response[-_TAIL_CHARS:])
    predicted = minerva_normalize(matches[-1] if matches else _NO_ANSWER)
    return 1.0 if predicted == minerva_normalize(ground_truth) else -1.0

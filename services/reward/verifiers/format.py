"""`format`: 1.0 iff the response is `<think>...</think>` then `<answer>...</answer>` and nothing else.

The regex is MindSpeed-RL's: `^<think>.*?</think>\\s*<answer>.*?</answer>$` with DOTALL and MULTILINE
(so `$` may match before a final newline, as upstream).
"""

import re

_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)


def score(response: str, ground_truth: str) -> float:
    """1.0 when the think/answer format holds, else 0.0; `ground_truth` is unused."""
    del ground_truth
    return 1.0 if _FORMAT.match(response) else 0.0

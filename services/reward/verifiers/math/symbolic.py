"""HuggingFace math-verify, called with its signal-based timeouts disabled.

`math_verify.parse`/`verify` default to `signal.alarm` timeouts, which raise outside the main thread
(gRPC servicer threads) and interfere with pool processes; the reward pool enforces deadlines by killing
the process instead, so both timeouts are off here. Parsed labels are cached: every sample of a prompt
group (and every epoch) shares its label, and parsing LaTeX costs milliseconds.
"""

import functools
import logging

from math_verify import parse, verify
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

# math-verify warns on every call that its timeout is disabled; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)
logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
logging.getLogger("math_verify.grader").setLevel(logging.ERROR)

_GOLD_CONFIG = [LatexExtractionConfig()]
_PRED_CONFIG = [ExprExtractionConfig(), LatexExtractionConfig()]


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str) -> list:
    return parse("\\boxed{" + ground_truth + "}", _GOLD_CONFIG, parsing_timeout=None)


def math_verify_equal(prediction_text: str, ground_truth: str) -> bool:
    """True when math-verify finds the answer in `prediction_text` equal to `ground_truth`.

    The label is parsed as `\\boxed{ground_truth}`; the prediction with expression then LaTeX extraction
    (MindSpeed-RL's `compute_math_score` configuration).
    """
    gold = _parse_gold(ground_truth)
    predicted = parse(prediction_text, _PRED_CONFIG, parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


@functools.lru_cache(maxsize=8192)
def answers_equal_symbolic(answer: str, ground_truth: str) -> bool:
    """math-verify on an already extracted answer (cached: a group often repeats an answer)."""
    return math_verify_equal("\\boxed{" + answer + "}", ground_truth)

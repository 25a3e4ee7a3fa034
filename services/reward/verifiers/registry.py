"""Name -> verifier table: the built-in rules, under MindSpeed-RL's `verifier_function` names.

A plain dict, no decorators: add a rule by writing its module and one line here. Registered remote
verifiers (`Reward.RegisterVerifier`) live in Redis (`services/reward/verifier_store.py`) and may not
reuse these names.
"""

from collections.abc import Callable
from dataclasses import dataclass

from services.reward.verifiers.acc import acc
from services.reward.verifiers.acc_for_dapo import acc_for_dapo
from services.reward.verifiers.base_acc import base_acc
from services.reward.verifiers.format import format_reward
from services.reward.verifiers.math_17k_acc import math_17k_acc
from services.reward.verifiers.math_equiv import math_equiv
from services.reward.verifiers.math_verify_reward import math_verify_reward
from services.reward.verifiers.step import step
from services.reward.verifiers.strict_format import strict_format

# Every verifier: (response decoded without special tokens, ground-truth label) -> finite score.
Verifier = Callable[[str, str], float]

# Recorded with every built-in score; bump when a rule's verdicts change.
BUILTIN_VERSION = "1"


@dataclass(frozen=True)
class VerifierEntry:
    """A built-in verifier: its function and a one-line description."""

    fn: Verifier
    description: str


VERIFIERS: dict[str, VerifierEntry] = {
    "math_equiv": VerifierEntry(math_equiv, "1/0: boxed or Answer: line equals the label (fast path, then math-verify)"),
    "math_17k_acc": VerifierEntry(math_17k_acc, "1/0: mathruler grade of the last \\boxed{} (MindSpeed-RL)"),
    "base_acc": VerifierEntry(base_acc, "1/0: <think>/<answer>/\\boxed format and mathruler grade"),
    "acc": VerifierEntry(acc, "+1 correct / -0.5 wrong / -1 no \\boxed{}"),
    "format": VerifierEntry(format_reward, "1/0: ^<think>.*?</think>\\s*<answer>.*?</answer>$"),
    "strict_format": VerifierEntry(strict_format, "+1 / -0.5: each tag exactly once, in order"),
    "step": VerifierEntry(step, "min(1, step markers / 3)"),
    "acc_for_dapo": VerifierEntry(acc_for_dapo, "+1/-1: last Answer: line, Minerva-normalised (DAPO)"),
    "math_verify_reward": VerifierEntry(math_verify_reward, "1/0: format regex and HF math-verify"),
}


def get_verifier(name: str) -> Verifier:
    """The built-in verifier called `name`; ValueError listing the known names otherwise."""
    entry = VERIFIERS.get(name)
    if entry is None:
        raise ValueError(f"unknown verifier {name!r}; built-in verifiers are: {', '.join(sorted(VERIFIERS))}")
    return entry.fn

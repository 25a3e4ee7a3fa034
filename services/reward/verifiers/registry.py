"""Name -> verifier table: the built-in rules, under MindSpeed-RL's `verifier_function` names.

A plain dict, no decorators: add a rule by writing its module (one `score(response, ground_truth) ->
float`) and one line here. The pool runs these (and `--verifier-plugin` rules); `Reward.RegisterVerifier`
refuses these names for remote verifiers, which live in Redis (`services/reward/verifier_store.py`).
"""

from collections.abc import Callable
from dataclasses import dataclass

from services.reward.verifiers import (
    acc,
    acc_for_dapo,
    base_acc,
    math_17k_acc,
    math_equiv,
    math_verify_reward,
    retool,
    step,
    strict_format,
)
from services.reward.verifiers import format as format_rule  # `format` would shadow the builtin

# Every verifier: (response decoded without special tokens, ground-truth label) -> finite score.
Verifier = Callable[[str, str], float]

# Recorded with every built-in score; bump when a rule's verdicts change.
BUILTIN_VERSION = "1"


@dataclass(frozen=True)
class VerifierEntry:
    """A built-in verifier: its function and a one-line description (shown by `ListVerifiers`)."""

    fn: Verifier
    description: str


VERIFIERS: dict[str, VerifierEntry] = {
    "math_equiv": VerifierEntry(math_equiv.score,
                                "1/0: boxed or Answer: line equals the label (fast path, then math-verify)"),
    "math_17k_acc": VerifierEntry(math_17k_acc.score, "1/0: mathruler grade of the last \\boxed{} (MindSpeed-RL)"),
    "base_acc": VerifierEntry(base_acc.score, "1/0: <think>/<answer>/\\boxed format and mathruler grade"),
    "acc": VerifierEntry(acc.score, "+1 correct / -0.5 wrong / -1 no \\boxed{}"),
    "format": VerifierEntry(format_rule.score, "1/0: ^<think>.*?</think>\\s*<answer>.*?</answer>$"),
    "strict_format": VerifierEntry(strict_format.score, "+1 / -0.5: each tag exactly once, in order"),
    "step": VerifierEntry(step.score, "min(1, step markers / 3)"),
    "acc_for_dapo": VerifierEntry(acc_for_dapo.score, "+1/-1: last Answer: line, Minerva-normalised (DAPO)"),
    "math_verify_reward": VerifierEntry(math_verify_reward.score, "1/0: format regex and HF math-verify"),
    "retool_reward": VerifierEntry(retool.score, "+1 exact last \\boxed{} in the tail, else min(0, -1 + 0.1/tool round)"),
}


def get_verifier(name: str) -> Verifier:
    """The built-in verifier called `name`; ValueError listing the known names otherwise."""
    entry = VERIFIERS.get(name)
    if entry is None:
        raise ValueError(f"unknown verifier {name!r}; built-in verifiers are: {', '.join(sorted(VERIFIERS))}")
    return entry.fn

"""`acc`: +1.0 for a correct boxed answer, -0.5 for a wrong one, -1.0 when there is no box.

MindSpeed-RL's graded accuracy rule. The response is cut at the first stop word (`</s>`, `<|im_end|>`,
`<|endoftext|>`) as upstream; equivalence is `math_equiv`'s (`math/equivalence.py`).
"""

from services.reward.verifiers.math.equivalence import answers_equivalent
from services.reward.verifiers.math.extract import last_boxed_content

_STOP_WORDS = ("</s>", "<|im_end|>", "<|endoftext|>")


def score(response: str, ground_truth: str) -> float:
    """+1.0 correct, -0.5 wrong, -1.0 without a closed `\\boxed{}`."""
    for stop_word in _STOP_WORDS:
        response = response.split(stop_word, 1)[0]
    answer = last_boxed_content(response)
    if answer is None:
        return -1.0
    return 1.0 if answers_equivalent(answer, ground_truth) else -0.5

"""Rule verifiers: one module per registered rule, each a pure `score(response, ground_truth) -> float`.

`registry.VERIFIERS` maps MindSpeed-RL's `rl_config.verifier_function` names to them. No I/O, no gRPC,
no process management here: deadlines and crash isolation are the pool's job (`services/reward/pool.py`).
The math-equivalence helpers the rules share (answer extraction, normalisation, exact and symbolic
comparison) are the `math/` sub-package.

| rule | reads from the response | scores |
|---|---|---|
| `math_equiv` | last `\\boxed{}`, else last `Answer:` line | 1.0 equal to the label (exact fast path, then math-verify), else 0.0 |
| `math_17k_acc` | last closed `\\boxed{}` (mathruler) | 1.0 mathruler `grade_answer` holds, else 0.0; no box: 0.0 |
| `base_acc` | whole response, then last `\\boxed{}` | 1.0 `<think>.*</think>.*<answer>.*\\boxed{.*}.*</answer>` and mathruler grade, else 0.0 |
| `acc` | last closed `\\boxed{}` before the first stop word | +1.0 equal (as `math_equiv`), -0.5 wrong, -1.0 no box |
| `format` | whole response | 1.0 `^<think>.*?</think>\\s*<answer>.*?</answer>$`, else 0.0; label unused |
| `strict_format` | whole response | +1.0 each tag and one `\\boxed{}` exactly once, in order, else -0.5; label unused |
| `step` | step markers (`Step N:`, `N.`, list bullets, First/Second/Next/Finally) | min(1.0, markers / 3); label unused |
| `acc_for_dapo` | last `Answer:` in the last 300 characters | +1.0 Minerva-normalised equal, else -1.0 |
| `math_verify_reward` | whole response (format), then math-verify's extraction | 1.0 `format` holds and math-verify equal, else 0.0 |
| `retool_reward` | last closed `\\boxed{}` in the last 100 characters; `<tool_response>` turns | +1.0 exactly equal, else min(0, -1.0 + 0.1 x tool turns) |

Every rule returns a finite Python float for any pair of strings; a rule that raises, hangs or returns a
non-finite value costs that sample a 0.0 with an error (the pool's doing, not the rule's).
"""

from services.reward.verifiers.registry import VERIFIERS, Verifier, VerifierEntry, get_verifier

__all__ = ["VERIFIERS", "Verifier", "VerifierEntry", "get_verifier"]

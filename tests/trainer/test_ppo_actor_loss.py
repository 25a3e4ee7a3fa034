"""PPO's actor loss: the actor's loss with per-token advantages (`UpdateRequest.token_advantages`), no KL term and
token-mean aggregation, against MindSpeed-RL's own `PPOActorLossFunc._compute_ppo_policy_loss`; then the Update path
that feeds it.

tests/trainer/mindspeed_ppo_actor_loss.json holds fixed float64 inputs (tests/mindspeed_expected.py's `ppo_case`:
ragged responses, a multi-turn mask with holes) and upstream's loss, clip fraction, ppo_kl, entropy and gradients
with respect to the log-probs and the entropy, made by running upstream's function from a MindSpeed-RL export
(`python -m tests.trainer.test_ppo_actor_loss --mindspeed <export of mindspeed_rl/>`, commit MINDSPEED_COMMIT).
rlfabric's `grpo_loss` must give the same loss, ppo_kl, entropy and gradients in float64, maximum difference 0, and
the same clip fraction as float32 (upstream computes the fraction in float32, rlfabric in the log-probs' dtype;
both are the same count over the same token count, so they agree once rounded to float32). Upstream logs
`actor/pg_loss` as |pg_loss - entropy_coeff * entropy|, which is rlfabric's |actor/loss|: rlfabric's
`actor/pg_loss` is the surrogate alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.grpo_loss import grpo_loss
from services.trainer.packing import make_packed_micro_batch
from services.trainer.step import SequenceRows, make_micro_batch, response_slices
from services.trainer.update import Experience, UpdateOptions, micro_batch_loss
from tests.mindspeed_expected import MINDSPEED_COMMIT, ppo_case
from tests.verl_expected import hexes, unhex

FIXTURE_PATH = Path(__file__).parent / "mindspeed_ppo_actor_loss.json"

CASES = [  # (name, seed, batch, width, holes, cliprange, entropy_coeff, on_policy)
    ("ppo_clip_0_2", 31, 6, 9, False, 0.2, 0.0, False),
    ("entropy_bonus", 32, 5, 12, False, 0.2, 0.01, False),
    ("clip_0_05_mostly_clipped", 33, 5, 7, False, 0.05, 0.0, False),
    ("on_policy_without_old_log_probs", 34, 4, 8, False, 0.2, 0.0, True),
    ("one_token_responses", 35, 4, 1, False, 0.2, 0.001, False),
    ("multi_turn_mask_with_holes", 36, 5, 10, True, 0.2, 0.001, False),
]


def case_inputs(seed: int, batch: int, width: int, holes: bool) -> dict[str, np.ndarray]:
    """Old log-probs and mask from `ppo_case`; current log-probs near the old ones, per-token advantages, entropy."""
    x = ppo_case(seed, batch, width, holes)
    g = torch.Generator().manual_seed(seed + 2000)
    old = torch.tensor(x["old_log_probs"])
    log_probs = old + 0.3 * torch.randn(batch, width, generator=g, dtype=torch.float64)
    advantages = torch.randn(batch, width, generator=g, dtype=torch.float64)
    entropy = 2.0 * torch.rand(batch, width, generator=g, dtype=torch.float64)
    outside = torch.tensor(x["mask"]) == 0
    log_probs[outside], advantages[outside] = 0.0, 0.0
    return {"old_log_probs": x["old_log_probs"], "log_probs": log_probs.numpy(), "advantages": advantages.numpy(),
            "entropy": entropy.numpy(), "mask": x["mask"]}


def _leaves(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(np.asarray(x["log_probs"]), requires_grad=True),
            torch.tensor(np.asarray(x["entropy"]), requires_grad=True))


def _grad(t: torch.Tensor) -> np.ndarray:
    return np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy()


# ----------------------------------------------------------------------------- upstream (fixture writer)


def upstream_results(export: Path) -> list[dict]:
    """Runs upstream's `_compute_ppo_policy_loss` on every case (MindSpeed-RL imported as tests/mindspeed_expected.py
    imports it: from the exported source, heavy imports stubbed; run in its own process)."""
    from tests.mindspeed_expected import import_mindspeed

    import_mindspeed(export)
    fn = importlib.import_module("mindspeed_rl.models.loss.ppo_actor_loss_func").PPOActorLossFunc._compute_ppo_policy_loss
    out = []
    for name, seed, batch, width, holes, clip, coeff, on_policy in CASES:
        x = case_inputs(seed, batch, width, holes)
        log_probs, entropy = _leaves(x)
        old = None if on_policy else torch.tensor(x["old_log_probs"])
        loss, clipfrac, ppo_kl, ent = fn(old_log_prob=old, log_prob=log_probs, advantages=torch.tensor(x["advantages"]),
                                         eos_mask=torch.tensor(x["mask"]), cliprange=clip, entropy=entropy,
                                         entropy_coeff=coeff)
        loss.backward()
        out.append({"name": name, "cliprange": clip, "entropy_coeff": coeff, "on_policy": on_policy,
                    "inputs": {k: (v.tolist() if k == "mask" else hexes(v)) for k, v in x.items()},
                    "expected": {"loss": loss.item().hex(), "clipfrac": clipfrac.item().hex(),
                                 "clipfrac_dtype": str(clipfrac.dtype), "ppo_kl": ppo_kl.item().hex(),
                                 "entropy": ent.item().hex(), "grad_log_probs": hexes(_grad(log_probs)),
                                 "grad_entropy": hexes(_grad(entropy))}})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write " + FIXTURE_PATH.name)
    parser.add_argument("--mindspeed", type=Path, required=True, help="an export of MindSpeed-RL's mindspeed_rl/")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    header = {"mindspeed_rl_commit": MINDSPEED_COMMIT,
              "made_by": "python -m tests.trainer.test_ppo_actor_loss --mindspeed <export>"}
    FIXTURE_PATH.write_text(json.dumps({**header, "cases": upstream_results(args.mindspeed.resolve())}, indent=1)
                            + "\n")
    print(f"wrote {FIXTURE_PATH}")


# ----------------------------------------------------------------------------- tests


def _fixture() -> dict:
    return json.loads(FIXTURE_PATH.read_text())


def rlfabric_loss(case: dict) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    x = {k: (np.asarray(v) if k == "mask" else unhex(v)) for k, v in case["inputs"].items()}
    log_probs, entropy = _leaves(x)
    old = None if case["on_policy"] else torch.tensor(x["old_log_probs"])
    loss, metrics = grpo_loss(log_probs, old, None, torch.tensor(x["advantages"]), torch.tensor(x["mask"]),
                              clip_ratio=case["cliprange"], use_kl=False, entropy_coeff=case["entropy_coeff"],
                              entropy=entropy, token_level_loss=True)
    loss.backward()
    return loss, metrics, log_probs, entropy


# Read when collected; absent only while main() writes it (test_the_fixture_covers_what_it_claims then fails).
@pytest.mark.parametrize("case", _fixture()["cases"] if FIXTURE_PATH.is_file() else [], ids=lambda c: c["name"])
def test_equal_to_mindspeed_rl_in_float64(case: dict) -> None:
    expected = case["expected"]
    loss, metrics, log_probs, entropy = rlfabric_loss(case)
    assert loss.dtype == torch.float64 and loss.item() == float.fromhex(expected["loss"])
    assert float(np.max(np.abs(_grad(log_probs) - unhex(expected["grad_log_probs"])))) == 0.0
    assert float(np.max(np.abs(_grad(entropy) - unhex(expected["grad_entropy"])))) == 0.0
    assert metrics["actor/ppo_kl"] == float.fromhex(expected["ppo_kl"])
    assert metrics["actor/entropy"] == float.fromhex(expected["entropy"])
    assert expected["clipfrac_dtype"] == "torch.float32"
    assert np.float32(metrics["actor/pg_clipfrac"]) == np.float32(float.fromhex(expected["clipfrac"]))
    assert abs(metrics["actor/loss"]) == abs(float.fromhex(expected["loss"]))  # what upstream logs as actor/pg_loss
    assert metrics["actor/kl_loss"] == 0.0  # PPO's actor has no KL term


def test_the_fixture_covers_what_it_claims() -> None:
    fixture = _fixture()
    assert fixture["mindspeed_rl_commit"] == MINDSPEED_COMMIT
    cases = {c["name"]: c for c in fixture["cases"]}
    assert list(cases) == [c[0] for c in CASES]
    clipfracs = [float.fromhex(c["expected"]["clipfrac"]) for c in cases.values()]
    assert max(clipfracs) > 0.3 and min(clipfracs) == 0.0  # clipping bites, and the on-policy case never clips
    assert float.fromhex(cases["on_policy_without_old_log_probs"]["expected"]["ppo_kl"]) == 0.0
    assert any(0 in row for row in cases["multi_turn_mask_with_holes"]["inputs"]["mask"])
    assert np.abs(unhex(cases["entropy_bonus"]["expected"]["grad_entropy"])).max() > 0
    for c in cases.values():  # advantages vary along each response: per-token, not a broadcast sequence value
        adv, mask = unhex(c["inputs"]["advantages"]), np.asarray(c["inputs"]["mask"]).astype(bool)
        if mask.sum(-1).max() > 1:
            assert any(len(set(a[m].tolist())) > 1 for a, m in zip(adv, mask, strict=True))


# ----------------------------------------------------------------------------- the Update path

PROMPTS, RESPONSES, VOCAB = [3, 2, 4], [5, 3, 1], 13


def _rows() -> SequenceRows:
    g = torch.Generator().manual_seed(0)
    return SequenceRows(torch.randint(0, VOCAB, (sum(PROMPTS) + sum(RESPONSES),), generator=g), torch.tensor(PROMPTS),
                        torch.tensor(RESPONSES))


def _update_loss(exp: Experience, opts: UpdateOptions, mb: dict, logits: torch.Tensor):
    logits = logits.detach().clone().requires_grad_(True)
    loss, metrics = micro_batch_loss(exp, opts, temperature=0.8, kl_coef=0.0)(logits, mb)
    loss.backward()
    return loss.detach(), metrics, logits.grad


def test_token_advantages_reach_the_loss_per_token_in_padded_and_packed_micro_batches() -> None:
    rows = _rows()
    g = torch.Generator().manual_seed(1)
    n = rows.num_response_tokens
    old, adv = -1.0 - torch.rand(n, generator=g), torch.randn(n, generator=g)
    exp = Experience(rows, None, old, None, token_advantages=adv)
    opts = UpdateOptions(use_kl=False, entropy_coeff=0.01, token_level_loss=True)
    mb = make_micro_batch(rows, [0, 1, 2])
    logits = torch.randn(3, mb["input_ids"].shape[1], VOCAB, generator=g)
    loss, metrics, _ = _update_loss(exp, opts, mb, logits)
    # by hand: the loss of the gathered log-probs with the [b, R] advantages sliced as the log-probs are
    from services.trainer.grpo_loss import compute_log_probs
    from services.trainer.step import gather_response_logits

    picked = gather_response_logits(logits, mb)
    logp, ent = compute_log_probs(picked, mb["resp_tokens"], 0.8, with_entropy=True)
    width = logp.shape[1]
    expected, _ = grpo_loss(logp, response_slices(old, rows, [0, 1, 2], width), None,
                            response_slices(adv, rows, [0, 1, 2], width), mb["response_mask"], clip_ratio=0.2,
                            use_kl=False, entropy_coeff=0.01, entropy=ent)
    assert torch.equal(loss, expected.detach())
    packed = make_packed_micro_batch(rows, [0, 1, 2], one_row=True)
    packed_logits = torch.randn(1, packed["input_ids"].shape[1], VOCAB, generator=g)
    # the same logits at the same response positions in the packed row
    flat = picked.reshape(-1, VOCAB)[mb["response_mask"].flatten().bool()]
    packed_logits[0, packed["resp_pos"][0]] = flat
    assert torch.allclose(_update_loss(exp, opts, packed, packed_logits)[0], loss, atol=1e-6)
    # the advantages are per token: averaging them over each response changes the loss
    mean_adv = torch.cat([adv[int(a):int(b)].mean().expand(int(b - a)) for a, b in
                          zip(rows.resp_offsets[:-1], rows.resp_offsets[1:], strict=True)])
    averaged = Experience(rows, None, old, None, token_advantages=mean_adv)
    assert abs(_update_loss(averaged, opts, mb, logits)[0].item() - loss.item()) > 1e-4


def test_constant_token_advantages_are_sequence_advantages_bitwise() -> None:
    rows = _rows()
    g = torch.Generator().manual_seed(2)
    old, seq_adv = -1.0 - torch.rand(rows.num_response_tokens, generator=g), torch.randn(len(rows), generator=g)
    per_token = torch.repeat_interleave(seq_adv, rows.response_lengths)
    opts = UpdateOptions(use_kl=False)
    mb = make_micro_batch(rows, [0, 1, 2])
    logits = torch.randn(3, mb["input_ids"].shape[1], VOCAB, generator=g)
    by_seq = _update_loss(Experience(rows, seq_adv, old, None), opts, mb, logits)
    by_token = _update_loss(Experience(rows, None, old, None, token_advantages=per_token), opts, mb, logits)
    assert torch.equal(by_seq[0], by_token[0]) and torch.equal(by_seq[2], by_token[2]) and by_seq[1] == by_token[1]


def test_an_experience_takes_exactly_one_kind_of_advantages() -> None:
    rows = _rows()
    n = rows.num_response_tokens
    with pytest.raises(ValueError, match="exactly one of advantages"):
        Experience(rows, torch.zeros(3), None, None, token_advantages=torch.zeros(n))
    with pytest.raises(ValueError, match="exactly one of advantages"):
        Experience(rows, None, None, None)
    with pytest.raises(ValueError, match=f"token_advantages has 3 values for {n} response tokens"):
        Experience(rows, None, None, None, token_advantages=torch.zeros(3))


if __name__ == "__main__":
    main()

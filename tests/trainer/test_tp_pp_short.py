"""The CI variant of test_parallel_equivalence.py's TP 2 x PP 2 test (the layout of configs/grpo_qwen25_7b_A3.yaml):
four gloo processes (tests/trainer/tp_pp_checks.py) take log-probs and one GRPO update from the HF weights and save
a checkpoint. The log-probs equal the HF model's, the grad norm and the converted checkpoint's weights equal one
plain-torch AdamW step on the HF model (tests/trainer/hf_reference.py). The soak test adds five updates and a
resume at this layout, against TP 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_log_probs, plain_torch_update
from rank_checks import make_experience, make_rows
from tp_pp_checks import KL_COEF, LR, TEMPERATURE
from trainer_helpers import run_ranks


def run_tp_pp_checks(hf: Path, work: Path, timeout_s: float = 600) -> dict:
    run_ranks("tp_pp_checks.py", 4, ["--hf", str(hf), "--work", str(work)], timeout_s=timeout_s)
    return torch.load(work / "results.pt", weights_only=False)


def test_tp2_pp2_log_probs_and_one_update_equal_hf_and_plain_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    import transformers

    from services.trainer.convert import convert_mcore_to_hf, load_hf_state

    torch.set_num_threads(1)
    got = run_tp_pp_checks(tiny_model_dir, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = make_rows(model.config.vocab_size, 1)
    assert (got["log_probs"] - hf_log_probs(model, rows, TEMPERATURE)).abs().max().item() < 1e-5

    norm = plain_torch_update(model.train(), rows, make_experience(rows, got["log_probs"], seed=7),
                              temperature=TEMPERATURE, kl_coef=KL_COEF, lr=LR)
    assert got["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # The checkpoint, written by four ranks, converted back: the weights of that one step.
    trained = load_hf_state(convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", hf_assets=tiny_model_dir))
    expected = model.state_dict()
    diffs = {name: (t - expected[name]).abs().max().item() for name, t in trained.items() if name in expected}
    assert len(diffs) == len(trained) and set(expected) - set(trained) <= {"lm_head.weight"}  # tied to the embedding
    # fp32 summation order differs; Adam's first step moves a weight by up to lr (2e-4) whatever its gradient, so
    # a few near-zero gradients may land anywhere in [-lr, lr]: the bound is well below one step.
    assert max(diffs.values()) < 2e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    # And the step did move the weights (equal weights would pass the bound above with no update at all).
    initial = load_hf_state(tiny_model_dir)
    assert max((trained[n] - initial[n]).abs().max().item() for n in diffs) > 1e-4

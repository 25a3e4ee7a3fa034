"""The trainer on an accelerator: the same rank checks as the CPU suite, on CUDA (NCCL) when a GPU is present.

Skips cleanly on machines without one (this project's CI). On a GPU machine with `pip install -e .[cuda]`:
`.venv/bin/pytest tests/trainer/test_trainer_on_device.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import run_rank_checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_megatron_logits_match_hf_and_updates_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    import transformers

    from services.trainer.convert import convert_hf_to_mcore
    from services.trainer.megatron_compat import accelerator_present

    assert accelerator_present()
    ckpt = convert_hf_to_mcore(tiny_model_dir, tmp_path / "converted", tp=1, pp=1)
    (path,) = run_rank_checks(1, [(1, 1)], tiny_model_dir, tmp_path, load=ckpt)
    result = torch.load(path, weights_only=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    # TF32 matmuls on the GPU: a looser bound than the CPU suite's 1e-5.
    assert torch.allclose(result["logits"].float().cpu(), expected, atol=2e-3)
    assert result["resume_max_abs_diff"] < 1e-6
    assert all(torch.isfinite(torch.tensor(float(v))) for m in result["metrics"] for v in m.values())

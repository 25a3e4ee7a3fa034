"""The demo's work folder for tests: base_model, task/{train,heldout}.jsonl, dataset/{train,heldout}, sft_model
(the supervised warm-up on "A+B=")."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_addition_work(work: Path, repo_root: Path, **model: str) -> Path:
    """Fills `work` as `make demo` does before GRPO; `model`: write_tiny_model's family (default the dense Qwen2)."""
    import torch

    from services.common.tiny_model import write_tiny_model
    from services.data.dataset_config import load_dataset_config
    from services.data.preprocess import preprocess
    from services.data.synthetic import write_addition_task
    from services.sft.train import RECIPES, train

    torch.set_num_threads(1)
    base = write_tiny_model(work / "base_model", vocab_size=512, digits="single", **model)
    train_rows, held_out = write_addition_task(work / "task", held_out=500)
    for split, path in (("train", train_rows), ("heldout", held_out)):
        preprocess(load_dataset_config(repo_root / "configs" / "datasets" / "deepscaler.yaml", [
            f"input={path}", f"tokenizer_name_or_path={base}", f"output_prefix={work / 'dataset' / split}",
            "prompt_type=empty", "workers=1"]))

    def rows(path: Path) -> list[tuple[str, str]]:
        return [(r["problem"], r["answer"]) for r in map(json.loads, path.read_text().splitlines())]

    train(base, rows(train_rows), work / "sft_model", RECIPES["addition"], held_out_rows=rows(held_out))
    return work


def demo_up_command(work: Path, run_dir: Path, iterations: int, *extra: str,
                    config: str = "configs/grpo_demo_cpu.yaml") -> list[str]:
    """`make demo`'s GRPO step (`rlfabric up configs/grpo_demo_cpu.yaml` with its custom verifier) on `work`, for
    `iterations`, sampling seed 1, no validation; `extra`: more `up` arguments; `config`: another config of the demo's
    task (configs/ppo_demo_cpu.yaml)."""
    verifier = f"leading_number={sys.executable} examples/grpo/leading_number_verifier.py --port {{port}}"
    return [sys.executable, "-m", "services.cli", "up", config,
            "-o", f"megatron_training.tokenizer_name_or_path={work / 'sft_model'}",
            "-o", f"megatron_training.data_path={work / 'dataset' / 'train'}",
            "-o", f"actor_config.load={work / 'sft_model'}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "-o", f"megatron_training.train_iters={iterations}", "-o", "rlfabric.val_interval=0",
            "-o", "rlfabric.val_before_train=false", "-o", "generate_config.sampling_config.seed=1",
            "--run-dir", str(run_dir), "--verifier-command", verifier, *extra]

"""One rank that measures activation memory for tests/trainer/test_memory.py (launched as a subprocess).

Usage: python tests/trainer/memory_checks.py --rank R --world W --port P --tp T --out FILE
Builds a small random GPTModel (TP = T, DP = W / T) per case and micro-batch shape, runs one training
forward/backward through Megatron's schedule with the GRPO log-prob loss under
services/trainer/memory.py's ActivationTracker, and writes (rank 0) the peak and what is left after backward
per case and shape, with the model shape, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SPEC = dict(model_type="qwen2", vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=True, qk_norm=False)
# (rows, sequence length, response length) of one micro-batch
SHAPES = [(1, 64, 32), (2, 96, 60), (1, 256, 160)]
CASES: dict[str, dict] = {
    "none": {},
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block_2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
    "activation": dict(recompute_activation_function=True),
}
TP2_CASES = {"none": {}, "sp": dict(sequence_parallel=True),
             "sp_full": dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1)}


def measure(model, rows: int, seq: int, resp: int) -> tuple[int, int]:
    from services.trainer import grpo_loss
    from services.trainer.memory import ActivationTracker
    from services.trainer.step import (
        SequenceRows,
        gather_response_logits,
        make_micro_batch,
        run_micro_batches,
    )

    g = torch.Generator().manual_seed(seq)
    batch = SequenceRows(torch.randint(0, SPEC["vocab_size"], (rows * seq,), generator=g),
                         torch.full((rows,), seq - resp), torch.full((rows,), resp))

    def loss_fn(logits, mb):
        logits = gather_response_logits(logits, mb)
        lp, _ = grpo_loss.compute_log_probs(logits, mb["resp_tokens"].to(logits.device), 1.0)
        return -lp.mean(), {}

    model.train()
    with ActivationTracker(model) as act:
        run_micro_batches(model, [make_micro_batch(batch, list(range(rows)))], loss_fn, forward_only=False)
    model.zero_grad(set_to_none=True)
    return act.peak_bytes, act.current_bytes


def main() -> int:
    ap = argparse.ArgumentParser()
    for k in ("rank", "world", "port", "tp"):
        ap.add_argument(f"--{k}", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from services.common.model_spec import ModelSpec
    from services.trainer import parallel
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.model import build_gpt_model

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    parallel.init_model_parallel(a.tp, 1, seed=1)
    spec = ModelSpec(**SPEC)
    results = []
    dtypes = ("float32", "bfloat16") if a.tp == 1 else ("float32",)
    for name, kw in (CASES if a.tp == 1 else TP2_CASES).items():
        for dtype in dtypes if name == "none" else ("float32",):
            model = build_gpt_model(spec, tp=a.tp, pp=1, params_dtype=getattr(torch, dtype),
                                    memory=ActivationMemory(**kw))
            for rows, seq, resp in SHAPES:
                peak, left = measure(model, rows, seq, resp)
                results.append({"case": name, "memory": kw, "dtype": dtype, "rows": rows, "seq": seq,
                                "response": resp, "peak": peak, "left": left,
                                "sequence_parallel": bool(model.config.sequence_parallel)})
    if a.rank == 0:
        Path(a.out).write_text(json.dumps({"spec": SPEC, "tp": a.tp, "results": results}))
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

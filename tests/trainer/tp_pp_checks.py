"""One rank of a TP 2 x PP 2 trainer group (4 processes) for test_tp_pp_short.py: log-probs of the rows of
rank_checks.py, then one GRPO update from the HF weights, then a checkpoint. Rank 0 writes `{work}/results.pt`
(log-probs, the update's metrics); the checkpoint is `{work}/ckpt`.

Usage: python tests/trainer/tp_pp_checks.py --rank R --port P --hf DIR --work DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPERATURE, KL_COEF, LR = 0.7, 0.05, 2e-4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=4)  # always 4 (TP 2 x PP 2); given by trainer_helpers.run_ranks
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from rank_checks import broadcast, make_experience, make_rows

    from services.trainer import parallel
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    parallel.init_distributed(rank=a.rank, world_size=4, master_port=a.port)
    parallel.init_model_parallel(2, 2, seed=1)
    worker = TrainerWorker(WorkerOptions(
        role="actor", hf_dir=a.hf, finetune=True, forward_micro_batch_size=3,
        update=UpdateOptions(micro_batch_size=2, mini_batch_rows=0), optimizer=OptimizerOptions(lr=LR)))
    rows = make_rows(worker.spec.vocab_size, 1)
    log_probs, _ = worker.compute_log_probs(rows, temperature=TEMPERATURE)
    log_probs = broadcast(log_probs, rows.num_response_tokens)  # rank 0 holds them; every rank trains on them
    metrics = worker.update(make_experience(rows, log_probs, seed=7), temperature=TEMPERATURE, kl_coef=KL_COEF,
                            step=1)
    worker.save(Path(a.work) / "ckpt", iteration=1)
    if a.rank == 0:
        torch.save({"log_probs": log_probs, "metrics": metrics}, Path(a.work) / "results.pt")
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

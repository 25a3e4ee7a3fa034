"""One rank of a trainer group that runs the activation-memory checks (launched by tests as a subprocess).

Usage: python tests/trainer/activation_checks.py --rank R --world W --port P --tp T --hf DIR --out FILE
       --case NAME [--case NAME ...]
Every rank builds a TrainerWorker per case (TP = T, DP = W / T) with that case's `ActivationMemory` and the
same HF weights; rank 0 writes `{out}` with, per case: temperature-scaled log-probs, the gradients of one
backward over the batch (mapped to HF names, norm weights summed over TP as the optimizer does), the bytes
of activations the forward left for backward, and the metrics of two GRPO updates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CASES: dict[str, dict] = {
    "none": {},
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    "activation": dict(recompute_activation_function=True),
    "full_and_activation": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
                                recompute_activation_function=True),
    "sp": dict(sequence_parallel=True),
    "sp_full": dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1),
}


def saved_activation_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes of the tensors a training forward of `model` keeps for backward (parameters not counted).

    Counted once per storage, after the forward: what recompute frees in forward (CheckpointWithoutOutput
    resizes it to nothing) counts as what is left.
    """
    from services.trainer.model import model_forward

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = model_forward(model, input_ids)
    storages = {}
    for t in saved:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
    logits.float().sum().backward()  # frees the graph
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def run_case(name: str, hf: str, tp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from rank_checks import broadcast, make_experience, make_rows

    from services.trainer import grpo_loss
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.convert import mcore_to_hf
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.step import gather_response_logits, make_micro_batch, run_micro_batches
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions, gather_objects

    opts = WorkerOptions(hf_dir=hf, forward_micro_batch_size=1, activation_memory=ActivationMemory(**CASES[name]),
                         update=UpdateOptions(micro_batch_size=2, mini_batch_rows=4, seed=3),
                         optimizer=OptimizerOptions(lr=2e-4, clip_grad=1.0))
    w = TrainerWorker(opts)
    out: dict = {"sequence_parallel": w.model.config.sequence_parallel}
    rows = make_rows(w.spec.vocab_size, 1)
    logp, _ = w.compute_log_probs(rows, temperature=0.7)
    out["log_probs"] = logp

    # One backward over the batch (micro-batches of 2 rows), as the update runs it.
    def loss_fn(logits, mb):
        logits = gather_response_logits(logits, mb)
        lp, _ = grpo_loss.compute_log_probs(logits, mb["resp_tokens"], 0.7)
        mask = mb["response_mask"]
        return -(lp * mask).sum() / mask.sum(), {}

    w.model.train()
    w.optimizer.zero_grad()
    run_micro_batches(w.model, [make_micro_batch(rows, [i, i + 1]) for i in range(0, len(rows), 2)], loss_fn,
                      forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in w.model.named_parameters()}
    if ps.get_tensor_model_parallel_world_size() > 1 and w.model.config.sequence_parallel:
        # The optimizer's TP sum of sequence-parallel norm weights (services/trainer/optimizer.py).
        for n, p in w.model.named_parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(grads[n], group=ps.get_tensor_model_parallel_group())
    out["tagged"] = sorted(n for n, p in w.model.named_parameters() if getattr(p, "sequence_parallel", False))
    shards = gather_objects(((ps.get_tensor_model_parallel_rank(), 0), grads))
    if dist.get_rank() == 0:
        out["grads"] = mcore_to_hf(dict(shards), w.spec, tp, 1)

    # Activations a training forward leaves for backward: 4 rows of 96 tokens.
    ids = torch.randint(0, w.spec.vocab_size, (4, 96), generator=torch.Generator().manual_seed(5))
    out["saved_bytes"] = saved_activation_bytes(w.model, ids)

    # Two updates through the optimizer (its TP sum of the norm weights included).
    logp = broadcast(logp, rows.num_response_tokens)
    out["metrics"] = [w.update(make_experience(rows, logp, seed=100 + s), temperature=0.7, kl_coef=0.05, step=s)
                      for s in (1, 2)]
    out["log_probs_after"] = w.compute_log_probs(rows, temperature=0.7)[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    for k in ("rank", "world", "port", "tp"):
        ap.add_argument(f"--{k}", type=int, required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", required=True, choices=sorted(CASES))
    a = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    parallel.init_model_parallel(a.tp, 1, seed=1)
    results = {case: run_case(case, a.hf, a.tp) for case in a.case}
    if a.rank == 0:
        torch.save(results, a.out)
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

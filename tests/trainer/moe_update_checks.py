"""One rank of a two-rank MoE trainer group for test_moe_update.py: full trainer steps through TrainerWorker (HF weights
loaded, log-probs, two Update calls) for each case in turn (same processes, Megatron's groups rebuilt in between).

Rows: 7 at data parallel 2 with micro-batches of 3 rows, so DP rank 0 runs two micro-batches and rank 1 one; at EP 2
rank 1 runs a padding micro-batch as well (every MoE forward is a collective of the EP group). Rank 0 writes
`{work}/moe_update_{case}.pt`: the log-probs, both updates' metrics, and every rank's updated parameters and (plain
optimizer) main gradients after the last step, HF-named for experts (moe_checks.hf_grad_name).

Usage: python tests/trainer/moe_update_checks.py --rank R --world W --port P --hf DIR --work DIR
       --case EP:DISPATCHER:OPTIMIZER ...   (OPTIMIZER: plain | dist)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPERATURE, AUX_COEFF, ROWS, MICRO_BATCH = 0.7, 0.01, 7, 3


def run(a, ep: int, dispatcher: str, distributed: bool) -> dict:
    from megatron.core import parallel_state as ps
    from moe_checks import hf_grad_name
    from rank_checks import broadcast, make_experience, make_rows

    from services.trainer.moe import MoeOptions
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    w = TrainerWorker(WorkerOptions(
        role="actor", hf_dir=a.hf, finetune=True, forward_micro_batch_size=MICRO_BATCH,
        update=UpdateOptions(micro_batch_size=MICRO_BATCH),
        # clip_grad below the norm: clipping (and so the norm over both kinds of weights) shapes the step.
        optimizer=OptimizerOptions(lr=1e-4, clip_grad=0.05, weight_decay=0.01, use_distributed_optimizer=distributed),
        moe=MoeOptions(moe_aux_loss_coeff=AUX_COEFF, moe_token_dispatcher_type=dispatcher)))
    assert (w.layout.ep, w.layout.dp) == (ep, 2), w.layout
    rows = make_rows(w.spec.vocab_size, 1, n=ROWS)
    logp, _ = w.compute_log_probs(rows, temperature=TEMPERATURE)
    logp_all = broadcast(None if logp is None else logp.float(), rows.num_response_tokens)
    metrics = [w.update(make_experience(rows, logp_all, seed=100 + s), temperature=TEMPERATURE, kl_coef=0.05, step=s)
               for s in (1, 2)]
    ep_rank, per = ps.get_expert_model_parallel_rank(), w.spec.moe.num_experts // ep
    params = {hf_grad_name(n, ep_rank, per): p.detach().clone() for n, p in w.model.named_parameters()}
    grads = {} if distributed else {hf_grad_name(n, ep_rank, per): p.main_grad.detach().clone()
                                    for n, p in w.model.named_parameters()}
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((params, grads), parts, dst=0)
    if dist.get_rank() != 0:
        return {}
    merged: dict[str, dict[str, torch.Tensor]] = {"params": {}, "grads": {}}
    for part in parts:
        for kind, values in zip(("params", "grads"), part, strict=True):
            for k, v in values.items():
                if k in merged[kind]:  # a replicated weight: every rank holds the same
                    assert torch.equal(merged[kind][k], v), (kind, k)
                merged[kind][k] = v
    return {"log_probs": logp, "metrics": metrics, **merged}


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--case", action="append", required=True, help="EP:DISPATCHER:plain|dist, repeatable")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for case in a.case:
        ep, dispatcher, optimizer = case.split(":")
        parallel.init_model_parallel(1, 1, seed=1, ep=int(ep))
        results = run(a, int(ep), dispatcher, optimizer == "dist")
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"moe_update_{case.replace(':', '_')}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

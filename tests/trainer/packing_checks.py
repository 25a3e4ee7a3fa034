"""One rank of a trainer group that compares packed / token-budget micro-batches with padded ones (a subprocess).

Usage: python tests/trainer/packing_checks.py --rank R --world W --port P --layout TxP [--layout TxP ...] --hf DIR
       --work DIR
For each layout (data parallel = W / (T * P)) rank 0 writes `{work}/packing_w{W}_tp{T}_pp{P}.pt`: the log-probs
and entropy of every micro-batch formation, and for the update the largest relative gradient difference between
packed and padded micro-batches (same grouping), over all ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Token budget of the dynamic formations: the 12 rows below (212 tokens) fall into groups of 3, 3, 4 and 2 rows,
# so the groups differ from fixed chunks and their loss weights differ from each other.
BUDGET, MOST_ROWS = 60, 4


def make_rows(vocab: int, n: int = 12):
    from services.trainer.step import SequenceRows

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 12, (n,), generator=g)
    resp = torch.randint(1, 40, (n,), generator=g)
    tokens = torch.randint(0, vocab, (int((prompt + resp).sum()),), generator=g)
    return SequenceRows(tokens, prompt, resp)


def formations():
    from services.trainer.packing import Packing

    return {
        "padded": Packing(),
        "packed": Packing(remove_padding=True),
        "dynamic": Packing(max_tokens=BUDGET, max_rows=MOST_ROWS),
        "dynamic_packed": Packing(remove_padding=True, max_tokens=BUDGET, max_rows=MOST_ROWS),
    }


class GradRecorder:
    """Stands in for the optimizer: keeps this rank's gradients of each step (before any data-parallel reduce,
    so ranks compare their own micro-batches); parameters stay put."""

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_groups = [{"lr": 0.0}]
        self.grads: list[torch.Tensor] = []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, *_clip) -> float:
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]
        return 0.0


class NoSchedule:
    def step(self, increment: int) -> None:
        pass


def experience(rows, logp: torch.Tensor):
    from services.trainer.update import Experience

    g = torch.Generator().manual_seed(11)
    adv = torch.randn(len(rows), generator=g)
    return Experience(rows, adv, logp + 0.2 * torch.randn(logp.shape, generator=g),
                      logp + 0.2 * torch.randn(logp.shape, generator=g))


def update_grads(model, exp, opts) -> tuple[list[torch.Tensor], dict]:
    from services.trainer.update import grpo_update

    rec = GradRecorder(model)
    metrics = grpo_update(model, rec, NoSchedule(), exp, opts, temperature=0.7, kl_coef=0.05, clip_grad=0.0, step=1)
    return rec.grads, metrics


def max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| / max|a| over the tensors, across all ranks."""
    import torch.distributed as dist

    worst = max(((x - y).abs().max() / x.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b, strict=True))
    t = torch.tensor([worst])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def hand_weighted_grads(model, exp, opts, groups, *, by_rows: bool = True) -> list[torch.Tensor]:
    """sum_m (rows_m / rows) * grad(token mean of micro-batch m), one plain micro-batch at a time (world 1).

    by_rows=False weighs the micro-batches equally instead (what fixed micro-batches do).
    """
    from services.trainer.step import make_micro_batch, run_micro_batches
    from services.trainer.update import micro_batch_loss

    loss_fn = micro_batch_loss(exp, opts, 0.7, 0.05)
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    rows = sum(len(g) for g in groups)
    model.train()
    for g in groups:
        for p in params:
            p.grad = None
        run_micro_batches(model, [make_micro_batch(exp.rows, g)], loss_fn, forward_only=False)
        for t, p in zip(total, params, strict=True):
            t.add_(p.grad, alpha=len(g) / rows if by_rows else 1 / len(groups))
    return total


def run_checks(a: argparse.Namespace, tp: int, pp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from services.trainer import packing
    from services.trainer.logprobs import compute_log_probs_rows
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    w = TrainerWorker(WorkerOptions(role="reference", hf_dir=a.hf))
    rows = make_rows(w.spec.vocab_size)
    results: dict = {"log_probs": {}, "entropy": {}, "grad_rel": {}, "metrics": {}}
    for name, pk in formations().items():
        logp, ent = compute_log_probs_rows(w.model, rows, temperature=0.7, micro_batch_size=3, with_entropy=True,
                                           packing_opts=pk)
        results["log_probs"][name], results["entropy"][name] = logp, ent
    logp = results["log_probs"]["padded"] if dist.get_rank() == 0 else torch.zeros(rows.num_response_tokens)
    dist.broadcast(logp, src=0)
    exp = experience(rows, logp)

    f = formations()
    base = UpdateOptions(micro_batch_size=2, mini_batch_rows=6, shuffle_mini_batch=True, seed=3)
    cases = {
        # same grouping (fixed chunks of 2 rows), padded vs packed
        "fixed": (base, dataclasses.replace(base, packing=f["packed"])),
        # per-row loss aggregation and an entropy bonus go through the packed -> per-row unpacking with gradient
        "seq_mean_entropy": (dataclasses.replace(base, token_level_loss=False, entropy_coeff=0.01),
                             dataclasses.replace(base, token_level_loss=False, entropy_coeff=0.01,
                                                 packing=f["packed"])),
        # the same token-budget groups, padded vs packed (one mini-batch of all rows: groups of unequal size)
        "dynamic": (dataclasses.replace(base, mini_batch_rows=0, packing=f["dynamic"]),
                    dataclasses.replace(base, mini_batch_rows=0, packing=f["dynamic_packed"])),
    }
    for name, (padded_opts, packed_opts) in cases.items():
        g_pad, m_pad = update_grads(w.model, exp, padded_opts)
        g_pack, m_pack = update_grads(w.model, exp, packed_opts)
        results["grad_rel"][name] = max_rel(g_pad, g_pack)
        results["metrics"][name] = (m_pad, m_pack)
        if name == "dynamic" and a.world == 1:
            dyn = cases["dynamic"][0]
            groups = packing.dp_groups(rows, range(len(rows)), 2, dyn.packing, dp=1, dp_rank=0)
            results["dynamic_groups"] = groups
            results["grad_rel"]["dynamic_vs_hand"] = max_rel(hand_weighted_grads(w.model, exp, dyn, groups), g_pad)
            equal = hand_weighted_grads(w.model, exp, dyn, groups, by_rows=False)
            results["grad_rel"]["dynamic_vs_equal_weights"] = max_rel(equal, g_pad)
    results["layout"] = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                         ps.get_data_parallel_world_size())
    results["thd"] = packing.thd_available()
    groups = packing.group_rows(rows, range(len(rows)), 3, f["packed"])
    results["packed_shapes"] = [tuple(mb["input_ids"].shape)
                                for mb in packing.build_micro_batches(rows, groups, f["packed"], pp=pp, tp=tp)]
    return results


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--layout", action="append", required=True, help="TPxPP, repeatable")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for layout in a.layout:
        tp, pp = (int(n) for n in layout.split("x"))
        parallel.init_model_parallel(tp, pp, seed=1)
        results = run_checks(a, tp, pp)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"packing_w{a.world}_tp{tp}_pp{pp}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

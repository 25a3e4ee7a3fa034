"""One rank of a trainer group that runs the equivalence checks (launched by tests as a subprocess).

Usage: python tests/trainer/rank_checks.py --rank R --world W --port P --layout TxP [--layout TxP ...] --hf DIR
       --work DIR
For each layout (TP x PP; data parallel = W / (T * P)) in turn, in the same processes (Megatron's groups are
rebuilt between layouts, so the slow part, starting and importing, is paid once), rank 0 writes
`{work}/results_w{W}_tp{T}_pp{P}.pt` with logits, log-probs, update metrics and weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from trainer_helpers import rank_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def make_rows(vocab: int, seed: int, n: int = 8):
    from services.trainer.step import SequenceRows

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 9, (n,), generator=g)
    resp = torch.randint(1, 7, (n,), generator=g)
    tokens = torch.randint(0, vocab, (int((prompt + resp).sum()),), generator=g)
    return SequenceRows(tokens, prompt, resp)


def make_experience(rows, logp: torch.Tensor, seed: int):
    from services.trainer.update import Experience

    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(len(rows), generator=g)
    old = logp + 0.3 * torch.randn(logp.shape, generator=g)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=g)
    return Experience(rows, adv, old, ref)


def broadcast(t: torch.Tensor | None, shape_like: torch.Tensor | int) -> torch.Tensor:
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return t
    n = shape_like if isinstance(shape_like, int) else shape_like.numel()
    buf = t if dist.get_rank() == 0 else torch.zeros(n)
    dist.broadcast(buf, src=0)
    return buf


def main() -> int:
    ap = rank_arguments()
    ap.add_argument("--layout", action="append", required=True, help="TPxPP, repeatable")
    ap.add_argument("--load", default=None, help="converted Megatron checkpoint to start from (first layout only)")
    ap.add_argument("--lr", type=float, default=2e-4)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from megatron.core import parallel_state as ps

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    for i, layout in enumerate(a.layout):
        tp, pp = (int(n) for n in layout.split("x"))
        parallel.init_model_parallel(tp, pp, seed=1)
        results = run_checks(a, tp, pp, load=a.load if i == 0 else None)
        if a.rank == 0:
            torch.save(results, Path(a.work) / f"results_w{a.world}_tp{tp}_pp{pp}.pt")
        ps.destroy_model_parallel()
    parallel.shutdown()
    return 0


def run_checks(a: argparse.Namespace, tp: int, pp: int, load: str | None) -> dict:
    """Every check of one layout, on every rank; the results rank 0 saves."""
    from services.trainer.model import model_forward
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    work = Path(a.work)
    results: dict = {}

    upd = UpdateOptions(micro_batch_size=2, mini_batch_rows=4, epochs=1, shuffle_mini_batch=True, seed=3)
    # Constant LR: the test compares layouts, not the schedule (the default decays linearly).
    optim = OptimizerOptions(lr=a.lr, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.01)
    wopts = WorkerOptions(role="actor", hf_dir=a.hf, load=load, finetune=True, forward_micro_batch_size=3,
                          update=upd, optimizer=optim)

    # 1. logits of random ids (PP 1 only: every TP rank holds the full logits).
    w = TrainerWorker(wopts)
    vocab = w.spec.vocab_size
    if pp == 1:
        ids = torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(0))
        ids = ids.to(next(w.model.parameters()).device)  # the GPU's, on a device machine (bench/device_check.py)
        with torch.no_grad():
            results["logits"] = model_forward(w.model.eval(), ids)[..., :vocab].clone()

    # 1b. this rank's weight shards as the weight sync sees them, from every rank.
    from services.trainer.weights_export import iter_shards
    from services.trainer.worker import gather_objects

    metas = [(s.meta, tuple(s.tensor.shape)) for s in iter_shards(w.model, w.spec)]
    results["shards"] = [m for part in (gather_objects(metas) or []) for m in part]

    # 2. log-probs with temperature, 3. five updates (shuffled mini-batches, KL, clipping).
    rows = make_rows(vocab, 1)
    logp, ent = w.compute_log_probs(rows, temperature=0.7, with_entropy=True)
    results["log_probs"], results["entropy"] = logp, ent
    logp = broadcast(logp, rows.num_response_tokens)
    metrics = []
    for step in range(1, 6):
        exp = make_experience(rows, logp, seed=100 + step)
        metrics.append(w.update(exp, temperature=0.7, kl_coef=0.05, step=step))
    results["metrics"] = metrics

    # 3b. One update from the initial weights, returned in HF names (compared with a plain-torch step).
    if tp == 1 and pp == 1 and a.world == 1:
        from services.trainer.convert import mcore_to_hf

        one = TrainerWorker(dataclasses.replace(
            wopts, update=UpdateOptions(micro_batch_size=2, mini_batch_rows=0), optimizer=OptimizerOptions(lr=a.lr)))
        results["one_update_metrics"] = one.update(make_experience(rows, logp, seed=7), temperature=0.7, kl_coef=0.05,
                                                   step=1)
        results["one_update_hf"] = mcore_to_hf({(0, 0): one.model.state_dict()}, one.spec, 1, 1)

    # 4. 4 steps straight == 2 steps + save + resume + 2 steps.
    def fresh():
        return TrainerWorker(wopts)

    def train(worker, steps):
        for step in steps:
            exp = make_experience(rows, logp, seed=200 + step)
            worker.update(exp, temperature=1.0, kl_coef=0.01, step=step)
            torch.manual_seed(1000 + step)  # RNG consumed between steps must resume too

    straight = fresh()
    train(straight, range(1, 5))
    ckdir = work / f"ckpt_w{a.world}_tp{tp}_pp{pp}"
    first = fresh()
    train(first, range(1, 3))
    first.save(ckdir, iteration=2)
    # Resume as MindSpeed-RL does: finetune false, optimizer and RNG loaded.
    resumed = TrainerWorker(dataclasses.replace(wopts, load=str(ckdir), finetune=False))
    results["resumed_iteration"] = resumed.iteration
    train(resumed, range(3, 5))
    diffs = [
        (a_ - b_).abs().max().item()
        for a_, b_ in zip(straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True)
        if isinstance(a_, torch.Tensor) and a_.is_floating_point()
    ]
    import torch.distributed as dist

    d = torch.tensor([max(diffs)], device=next(resumed.model.parameters()).device)  # NCCL reduces device tensors
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    results["resume_max_abs_diff"] = d.item()
    return results


if __name__ == "__main__":
    sys.exit(main())

"""One rank of the optimizer checks (mixed precision, distributed optimizer), launched by tests as a subprocess.

Usage: python tests/trainer/optimizer_checks.py --rank R --world W --port P --hf DIR --work DIR
World 1 runs the precision checks, world 2 (data parallel 2) the distributed-optimizer checks and then, on
rank 0 alone in a new one-rank group, loads the DP-2 checkpoint at DP 1. Rank 0 saves what it measured to
`{work}/optimizer_w{W}.pt` for the tests to assert on. `run(world, hf, work)` launches the ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 5  # update calls; each is two optimizer steps (8 rows, mini-batches of 4)


def run(world: int, hf: Path, work: Path, timeout_s: float = 300) -> dict:
    """Launch the ranks, wait, return rank 0's results."""
    from trainer_helpers import run_ranks

    run_ranks(Path(__file__).name, world, ["--hf", str(hf), "--work", str(work)], timeout_s=timeout_s)
    return torch.load(work / f"optimizer_w{world}.pt", weights_only=False)


def main() -> int:
    from trainer_helpers import rank_arguments

    ap = rank_arguments()
    a = ap.parse_args()
    torch.set_num_threads(1)

    from services.trainer import parallel

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    parallel.init_model_parallel(1, 1, seed=1)
    results = precision_checks(a) if a.world == 1 else distributed_checks(a)
    parallel.shutdown()
    if a.world > 1 and a.rank == 0:
        # The DP-2 checkpoint read back by a one-rank group (data parallel 1): the optimizer reshards.
        from services.common.net import free_port

        parallel.init_distributed(rank=0, world_size=1, master_port=free_port())
        parallel.init_model_parallel(1, 1, seed=1)
        results |= reshard_checks(a, results.pop("reshard_ckpt"))
        parallel.shutdown()
    if a.rank == 0:
        torch.save(results, Path(a.work) / f"optimizer_w{a.world}.pt")
    return 0


# ---- shared pieces ---------------------------------------------------------------------------------
def worker(a, *, dtype: str = "float32", distributed: bool = False, master_weights: bool = True, lr: float = 2e-4,
           clip: float = 1.0, load: str | None = None, reuse: bool = False, no_load_optim: bool = False):
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    return TrainerWorker(WorkerOptions(
        role="actor", hf_dir=a.hf, load=load, finetune=load is None, no_load_optim=no_load_optim,
        forward_micro_batch_size=4,
        update=UpdateOptions(micro_batch_size=2, mini_batch_rows=4, shuffle_mini_batch=True, seed=3),
        optimizer=OptimizerOptions(lr=lr, clip_grad=clip, weight_decay=0.01, use_distributed_optimizer=distributed,
                                   master_weights=master_weights, reuse_fp32_param=reuse),
        params_dtype=dtype))


def batch(w):
    """Rows and their log-probs under the initial weights (the same on every rank and every worker)."""
    from rank_checks import broadcast, make_rows

    rows = make_rows(w.spec.vocab_size, 1)
    logp, _ = w.compute_log_probs(rows, temperature=1.0)
    return rows, broadcast(None if logp is None else logp.float(), rows.num_response_tokens)  # rank 0 has them


def train(w, rows, logp, steps) -> list[dict]:
    from rank_checks import make_experience

    return [w.update(make_experience(rows, logp, seed=100 + s), temperature=1.0, kl_coef=0.05, step=s) for s in steps]


def weights(w) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def masters(w) -> dict[str, torch.Tensor]:
    """The whole fp32 master weights (gathered when sharded; collective), by parameter name."""
    state = w.optimizer.state_dict()
    return {} if state is None else {n: e["main_param"].clone() for n, e in state["params"].items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def mean_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    total = sum((a[k].double() - b[k].double()).abs().sum().item() for k in a)
    return total / sum(a[k].numel() for k in a)


def all_max(x: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def dtypes(w) -> dict[str, list[str]]:
    opt = w.optimizer
    return {
        "params": sorted({str(p.dtype) for p in w.model.parameters()}),
        "main_grad": sorted({str(p.main_grad.dtype) for p in w.model.parameters()}),
        "master": sorted({str(pc.main.dtype) for pc in opt.pieces if pc.own_master}),
        "adam": sorted({str(v.dtype) for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"}),
    }


# ---- world 1: mixed precision ------------------------------------------------------------------------
def precision_checks(a) -> dict:
    out: dict = {}
    lr = 1e-5  # below half a bf16 ulp of most weights: pure bf16 loses most of these updates, fp32 masters keep them
    ref = worker(a, lr=lr)
    rows, logp = batch(ref)
    init = weights(ref)
    train(ref, rows, logp, range(1, STEPS + 1))
    mixed = worker(a, dtype="bfloat16", lr=lr)
    out["mixed_initial_master"] = masters(mixed)
    mixed_metrics = train(mixed, rows, logp, range(1, STEPS + 1))
    pure = worker(a, dtype="bfloat16", master_weights=False, lr=lr)
    pure_init = weights(pure)
    train(pure, rows, logp, range(1, STEPS + 1))
    out |= {"fp32_init": init, "fp32_final": weights(ref), "mixed_master": masters(mixed),
            "mixed_params": weights(mixed), "pure_init": pure_init, "pure_final": weights(pure),
            "mixed_dtypes": dtypes(mixed), "pure_dtypes": dtypes(pure), "mixed_metrics": mixed_metrics,
            "mixed_memory": mixed.optimizer.memory_bytes(), "fp32_memory": ref.optimizer.memory_bytes()}

    # Resume in bf16: 4 updates straight == 2 + save + resume + 2, masters and Adam state included.
    straight = worker(a, dtype="bfloat16")
    train(straight, rows, logp, range(1, 5))
    first = worker(a, dtype="bfloat16")
    train(first, rows, logp, range(1, 3))
    ckpt = Path(a.work) / "ckpt_bf16"
    first.save(ckpt, iteration=2)
    resumed = worker(a, dtype="bfloat16", load=str(ckpt))
    out["resumed_iteration"] = resumed.iteration
    train(resumed, rows, logp, range(3, 5))
    out["resume_param_diff"] = max_diff(weights(straight), weights(resumed))
    out["resume_master_diff"] = max_diff(masters(straight), masters(resumed))
    payload = torch.load(ckpt / "iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=False)
    out["ckpt_optimizer"] = {k: v for k, v in payload["optimizer"].items() if k != "params"}
    out["ckpt_master_dtypes"] = sorted({str(e["main_param"].dtype) for e in payload["optimizer"]["params"].values()})

    # Offload everything after 2 updates, onload, 2 more: the same as never offloading.
    moved = worker(a, dtype="bfloat16")
    train(moved, rows, logp, range(1, 3))
    out["offloaded_bytes"] = moved.offload(params=True, grads=True, optimizer=True)
    out["offloaded_memory"] = moved.optimizer.memory_bytes()
    out["onloaded_bytes"] = moved.onload(params=True, grads=True, optimizer=True)
    train(moved, rows, logp, range(3, 5))
    out["offload_param_diff"] = max_diff(weights(straight), weights(moved))
    out["offload_master_diff"] = max_diff(masters(straight), masters(moved))
    out |= legacy_state_checks(a)
    out |= second_optimizer_checks(a, rows, logp)
    out |= reuse_checks(a, rows, logp, lr)
    return out


def second_optimizer_checks(a, rows, logp) -> dict:
    """An optimizer built later on the same model owns its gradients (the worker's hooks step aside): with lr 0
    it leaves the weights as they are and its main grads hold the update's averaged gradients."""
    from rank_checks import make_experience

    from services.trainer.optimizer import OptimizerOptions, build_optimizer
    from services.trainer.update import grpo_update

    w = worker(a)
    before = weights(w)
    opt, sched = build_optimizer(w.model, OptimizerOptions(lr=0.0, clip_grad=0.0))
    grpo_update(w.model, opt, sched, make_experience(rows, logp, seed=9), w.opts.update, temperature=1.0,
                kl_coef=0.05, clip_grad=0.0, step=1)
    return {"second_grad_sq": sum(float(p.main_grad.double().pow(2).sum()) for p in w.model.parameters()),
            "second_worker_grad_sq": float(w.optimizer.grad_buffer.double().pow(2).sum()),
            "second_moved": max_diff(before, weights(w))}


def reuse_checks(a, rows, logp, lr: float) -> dict:
    """reuse_fp32_param against separate fp32 masters, and its resume."""
    reuse = worker(a, dtype="bfloat16", lr=lr, reuse=True)
    train(reuse, rows, logp, range(1, STEPS + 1))
    out = {"reuse_master": masters(reuse), "reuse_params": weights(reuse), "reuse_memory": reuse.optimizer.memory_bytes()}
    straight = worker(a, dtype="bfloat16", reuse=True)
    train(straight, rows, logp, range(1, 5))
    first = worker(a, dtype="bfloat16", reuse=True)
    train(first, rows, logp, range(1, 3))
    ckpt = Path(a.work) / "ckpt_reuse"
    first.save(ckpt, iteration=2)
    resumed = worker(a, dtype="bfloat16", reuse=True, load=str(ckpt))
    train(resumed, rows, logp, range(3, 5))
    out["reuse_resume_param_diff"] = max_diff(weights(straight), weights(resumed))
    out["reuse_resume_master_diff"] = max_diff(masters(straight), masters(resumed))
    return out


def legacy_state_checks(a) -> dict:
    """A torch AdamW state dict (what checkpoints held before optimizer.py) loads, parameter by parameter."""
    from services.trainer.optimizer import param_groups

    old = worker(a)
    adam = torch.optim.AdamW(param_groups(old.model), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    for p in old.model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    adam.step()
    new = worker(a)
    new.optimizer.load_state_dict(adam.state_dict())
    by_name = dict(old.model.named_parameters())
    diffs = [(new.optimizer.optimizer.state[pc.main][k] - adam.state[by_name[pc.slot.name]][k]).abs().max().item()
             for pc in new.optimizer.pieces for k in ("exp_avg", "exp_avg_sq")]
    steps = {float(st["step"]) for st in new.optimizer.optimizer.state.values()}
    return {"legacy_state_diff": max(diffs), "legacy_pieces": len(diffs) // 2, "legacy_steps": steps}


# ---- world 2: the distributed optimizer ------------------------------------------------------------------
def distributed_checks(a) -> dict:
    out: dict = {}
    plain, sharded = worker(a), worker(a, distributed=True)
    rows, logp = batch(plain)
    init = weights(plain)
    m_plain = train(plain, rows, logp, range(1, STEPS + 1))
    m_sharded = train(sharded, rows, logp, range(1, STEPS + 1))
    out["fp32_param_diff"] = all_max(max_diff(weights(plain), weights(sharded)))
    out["fp32_grad_norms"] = ([m["grad_norm"] for m in m_plain], [m["grad_norm"] for m in m_sharded])
    out["fp32_moved"] = max_diff(weights(plain), init)

    # bf16 without clipping: with it, the norm's other summation order (about 1e-6 relative) moves a few fp32
    # masters across a bf16 rounding boundary, and the bf16 forward of later steps amplifies that.
    plain16, sharded16 = worker(a, dtype="bfloat16", clip=0.0), worker(a, dtype="bfloat16", clip=0.0, distributed=True)
    train(plain16, rows, logp, range(1, STEPS + 1))
    train(sharded16, rows, logp, range(1, STEPS + 1))
    plain_masters, sharded_masters = masters(plain16), masters(sharded16)  # the sharded gather is collective
    out["bf16_master_diff"] = max_diff(plain_masters, sharded_masters) if a.rank == 0 else None
    out["bf16_param_diff"] = all_max(max_diff(weights(plain16), weights(sharded16)))
    plain_r, sharded_r = (worker(a, dtype="bfloat16", clip=0.0, reuse=True),
                          worker(a, dtype="bfloat16", clip=0.0, reuse=True, distributed=True))
    train(plain_r, rows, logp, range(1, STEPS + 1))
    train(sharded_r, rows, logp, range(1, STEPS + 1))
    plain_masters, sharded_masters = masters(plain_r), masters(sharded_r)
    out["reuse_master_diff"] = max_diff(plain_masters, sharded_masters) if a.rank == 0 else None
    out["reuse_param_diff"] = all_max(max_diff(weights(plain_r), weights(sharded_r)))
    out["memory_reuse"] = {"plain": plain_r.optimizer.memory_bytes(), "sharded": sharded_r.optimizer.memory_bytes()}
    out["memory"] = {"plain": plain16.optimizer.memory_bytes(), "sharded": sharded16.optimizer.memory_bytes()}
    out["memory_fp32"] = {"plain": plain.optimizer.memory_bytes(), "sharded": sharded.optimizer.memory_bytes()}

    # Resume: 4 updates straight == 2 + save + resume + 2, sharded at DP 2.
    straight = worker(a, dtype="bfloat16", distributed=True)
    train(straight, rows, logp, range(1, 5))
    first = worker(a, dtype="bfloat16", distributed=True)
    train(first, rows, logp, range(1, 3))
    ckpt = Path(a.work) / "ckpt_dist"
    first.save(ckpt, iteration=2)
    resumed = worker(a, dtype="bfloat16", distributed=True, load=str(ckpt))
    train(resumed, rows, logp, range(3, 5))
    out["resume_param_diff"] = all_max(max_diff(weights(straight), weights(resumed)))
    straight_masters, resumed_masters = masters(straight), masters(resumed)
    out["resume_master_diff"] = max_diff(straight_masters, resumed_masters) if a.rank == 0 else None
    # The same checkpoint resumed by the plain optimizer (every rank takes the whole state).
    unsharded = worker(a, dtype="bfloat16", load=str(ckpt))
    train(unsharded, rows, logp, range(3, 5))
    unsharded_masters = masters(unsharded)
    out["resume_unsharded_master_diff"] = max_diff(straight_masters, unsharded_masters) if a.rank == 0 else None
    out["resume_unsharded_master_mean_diff"] = mean_diff(straight_masters, unsharded_masters) if a.rank == 0 else None
    # A plain resume that lost the Adam state (a fresh optimizer on the checkpoint's weights): what a broken load
    # looks like, for scale.
    fresh = worker(a, dtype="bfloat16", load=str(ckpt), no_load_optim=True)
    train(fresh, rows, logp, range(3, 5))
    out["resume_fresh_adam_master_mean_diff"] = mean_diff(straight_masters, masters(fresh)) if a.rank == 0 else None
    out["reshard_ckpt"] = str(ckpt)
    return out


def reshard_checks(a, ckpt: str) -> dict:
    """Rank 0 alone (DP 1): the DP-2 sharded checkpoint loads whole, sharded or not."""
    payload = torch.load(Path(ckpt) / "iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=False)
    saved = payload["optimizer"]
    out = {"saved_dp": saved["data_parallel_size"], "saved_distributed": saved["distributed"]}
    diffs = []
    for distributed in (True, False):
        w = worker(a, dtype="bfloat16", distributed=distributed, load=ckpt)
        state = w.optimizer.state_dict()
        assert state["step"] == saved["step"] and state["data_parallel_size"] == 1
        diffs.append(max(
            (state["params"][n][k] - e[k]).abs().max().item() for n, e in saved["params"].items() for k in e))
    out["reshard_state_diffs"] = diffs
    out["reshard_step"] = saved["step"]
    return out


if __name__ == "__main__":
    sys.exit(main())

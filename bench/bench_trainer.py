"""GRPO update throughput (tokens/s) of the Megatron trainer at TP 1 and TP 2 vs a plain-HF step.

One batch of B sequences (prompt P + response R tokens, tiny Qwen2 model, fp32) is trained on with
the same GRPO loss (`services/trainer/grpo_loss.py`), micro-batch M rows, one AdamW step per update:
- `megatron TP=1`: the trainer's `grpo_update` in one process (gloo, world 1);
- `megatron TP=2`: the same in two processes (gloo), one thread each;
- `plain HF`: transformers' Qwen2ForCausalLM, the same loss and micro-batching, torch AdamW.
Tokens/s counts every token of the batch (prompt + response) per update wall time. All settings run in
one invocation, alternating per repeat so machine noise hits them alike; median (min-max) of the
repeats after one warm-up update.

    .venv/bin/python bench/bench_trainer.py [--repeats 5] [--batch 16] [--prompt 128] [--response 128]

`--cost` measures instead the trainer's two per-iteration calls (ComputeLogProbs and Update) at the
workloads' shapes, each in a fresh one-rank process: `W2` (64 rows = 8 prompts x 8 samples, 6 + 8 tokens,
vocabulary 512, Update micro-batch 64, forward micro-batch 16: configs/grpo_demo_cpu.yaml) and W1 at 64 and
128 response tokens (64 rows, 12-token prompts, vocabulary 4096, micro-batches 16: configs/grpo_tiny_cpu.yaml).
With `--before DIR` (a checkout of older code, e.g. a `git worktree` of main) every case also runs on that
code in the same invocation, alternating, so the load hits both alike. Wall and CPU seconds per call,
median (min-max); the CPU figure (the rank's own process time) moves less with the load of other jobs.

    .venv/bin/python bench/bench_trainer.py --cost [--before /path/to/old/checkout] [--repeats 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_info

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rows(b: int, p: int, r: int, vocab: int):
    import torch

    from services.trainer.step import SequenceRows

    g = torch.Generator().manual_seed(0)
    return SequenceRows(torch.randint(0, vocab, (b * (p + r),), generator=g), torch.full((b,), p), torch.full((b,), r))


def _experience(rows, seed: int):
    import torch

    from services.trainer.update import Experience

    g = torch.Generator().manual_seed(seed)
    t = rows.num_response_tokens
    old = -8.3 + 0.1 * torch.randn(t, generator=g)
    return Experience(rows, torch.randn(len(rows), generator=g), old, old + 0.05 * torch.randn(t, generator=g))


def _loss_kwargs() -> dict:
    return dict(clip_ratio=0.2, kl_penalty="low_var_kl", kl_coef=0.001, entropy_coeff=0.0, token_level_loss=True)


# --cost cases: name -> (rows, prompt, response, vocabulary, update micro-batch, forward micro-batch).
COST_CASES = {
    "W2": (64, 6, 8, 512, 64, 16),
    "W1, 64 tokens": (64, 12, 64, 4096, 16, 16),
    "W1, 128 tokens": (64, 12, 128, 4096, 16, 16),
}


def cost_rank_main(a: argparse.Namespace) -> int:
    """One one-rank trainer process of a --cost case: prints the wall and CPU seconds of each call."""
    if a.code:  # the --before checkout's services/ instead of this one's
        sys.path.insert(0, a.code)
    import torch

    torch.set_num_threads(1)
    from services.trainer import parallel
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    b, p, r, _, micro, fmicro = COST_CASES[a.case]
    parallel.init_distributed(rank=0, world_size=1, master_port=a.port)
    parallel.init_model_parallel(1, 1)
    w = TrainerWorker(WorkerOptions(hf_dir=a.model, forward_micro_batch_size=fmicro,
                                    update=UpdateOptions(micro_batch_size=micro), optimizer=OptimizerOptions(lr=1e-5)))
    rows = _rows(b, p, r, w.spec.vocab_size)
    out: dict[str, list[tuple[float, float]]] = {"logprobs": [], "update": []}
    # On a worker thread, as the server's GroupExecutor runs every operation.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    for step in range(a.repeats + 1):
        exp = _experience(rows, step)
        for name, call in (("logprobs", lambda: w.compute_log_probs(rows, 1.0)),
                           ("update", lambda e=exp, s=step + 1: w.update(e, temperature=1.0, kl_coef=0.001, step=s))):
            t0, c0 = time.perf_counter(), time.process_time()
            pool.submit(call).result()
            out[name].append((time.perf_counter() - t0, time.process_time() - c0))
    for name, ts in out.items():
        print("COST", name, " ".join(f"{wall:.6f},{cpu:.6f}" for wall, cpu in ts[1:]), flush=True)
    parallel.shutdown()
    return 0


def rank_main(a: argparse.Namespace) -> int:
    """One Megatron rank: `repeats + 1` updates; rank 0 prints the timings (seconds) on one line."""
    if a.case:
        return cost_rank_main(a)
    import torch

    torch.set_num_threads(1)
    from services.trainer import parallel
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    parallel.init_distributed(rank=a.rank, world_size=a.world, master_port=a.port)
    parallel.init_model_parallel(a.world, 1)
    w = TrainerWorker(WorkerOptions(hf_dir=a.model, update=UpdateOptions(micro_batch_size=a.micro),
                                    optimizer=OptimizerOptions(lr=1e-5)))
    rows = _rows(a.batch, a.prompt, a.response, w.spec.vocab_size)
    times = []
    for step in range(a.repeats + 1):
        exp = _experience(rows, step)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        w.update(exp, temperature=1.0, kl_coef=0.001, step=step + 1)
        times.append(time.perf_counter() - t0)
    if a.rank == 0:
        print("TIMES", " ".join(f"{t:.6f}" for t in times[1:]), flush=True)
    parallel.shutdown()
    return 0


def hf_times(model_dir: Path, a: argparse.Namespace) -> list[float]:
    import torch
    import transformers

    from services.trainer import grpo_loss

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01)
    rows = _rows(a.batch, a.prompt, a.response, model.config.vocab_size)
    ids = rows.token_ids.reshape(a.batch, a.prompt + a.response)
    times = []
    for step in range(a.repeats + 1):
        exp = _experience(rows, step)
        old = exp.old_log_probs.reshape(a.batch, a.response)
        ref = exp.ref_log_probs.reshape(a.batch, a.response)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        n_micro = a.batch // a.micro
        for m in range(n_micro):
            sl = slice(m * a.micro, (m + 1) * a.micro)
            logits = model(ids[sl]).logits[:, a.prompt - 1 : -1]
            logp, _ = grpo_loss.compute_log_probs(logits, ids[sl, a.prompt :], 1.0)
            loss, _ = grpo_loss.grpo_loss(logp, old[sl], ref[sl], exp.advantages[sl], torch.ones_like(logp),
                                          **_loss_kwargs())
            (loss / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def megatron_times(model_dir: Path, world: int, a: argparse.Namespace) -> list[float]:
    from services.common.net import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = ["--model", str(model_dir), "--world", str(world), "--port", str(port), "--repeats", str(a.repeats),
            "--batch", str(a.batch), "--prompt", str(a.prompt), "--response", str(a.response), "--micro", str(a.micro)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(world)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("TIMES"))
    return [float(x) for x in line.split()[1:]]


def cost_times(model_dir: Path, case: str, code: str | None, repeats: int) -> dict[str, list[tuple[float, float]]]:
    from services.common.net import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = [sys.executable, __file__, "--rank", "0", "--case", case, "--model", str(model_dir), "--port",
            str(free_port()), "--repeats", str(repeats)] + (["--code", code] if code else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("COST ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{case} ({code or 'this checkout'}) failed: {proc.stderr[-2000:]}")
    return {ln[1]: [tuple(float(x) for x in v.split(",")) for v in ln[2:]] for ln in lines}


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def cost_main(a: argparse.Namespace, tmp: Path) -> int:
    from services.common.tiny_model import write_tiny_model

    models = {512: write_tiny_model(tmp / "v512", vocab_size=512, digits="single"),
              4096: write_tiny_model(tmp / "v4096", vocab_size=4096)}
    codes = {"after": None} if not a.before else {"before": a.before, "after": None}
    res: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    machine = _machine()
    rounds = 2
    per = max(1, a.repeats // rounds)
    for _ in range(rounds):  # alternate code versions and cases so drifting load hits all of them
        for case, (*_, vocab, _m, _f) in COST_CASES.items():
            for label, code in codes.items():
                got = cost_times(models[vocab], case, code, per)
                for k, v in got.items():
                    res.setdefault((case, label), {}).setdefault(k, []).extend(v)
    print(f"Machine: {machine}; {os.getloadavg()[0]:.2f} at the end\n")
    print(f"One-rank trainer (TP 1, fp32, 1 thread), {len(next(iter(res.values()))['update'])} timed calls per "
          "setting after a warm-up call; cases: " + "; ".join(
              f"{c}: {b} rows x ({p} + {r}) tokens, vocabulary {v}, micro-batch {m} (update) / {f} (log-probs)"
              for c, (b, p, r, v, m, f) in COST_CASES.items()) + "\n")
    print("| case | code | ComputeLogProbs wall s | CPU s | Update wall s | CPU s | Update CPU ms per 1k tokens |")
    print("|---|---|---|---|---|---|---|")
    for (case, label), d in res.items():
        b, p, r, *_ = COST_CASES[case]
        lw, lc = [x for x, _ in d["logprobs"]], [y for _, y in d["logprobs"]]
        uw, uc = [x for x, _ in d["update"]], [y for _, y in d["update"]]
        per_k = 1000 * statistics.median(uc) / (b * (p + r)) * 1000
        print(f"| {case} | {label} | {_med(lw)} | {_med(lc)} | {_med(uw)} | {_med(uc)} | {per_k:.3f} |")
    return 0


def _machine() -> str:
    return machine_info("torch", "megatron-core", "transformers")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--model", default=None, help="HF model dir (default: a fresh tiny model)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cost", action="store_true", help="time ComputeLogProbs and Update at the W1/W2 shapes")
    ap.add_argument("--before", default=None, help="with --cost: also run every case on this older checkout")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        return rank_main(a)
    if a.cost:
        with tempfile.TemporaryDirectory() as tmp:
            return cost_main(a, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        if a.model:
            model_dir = Path(a.model)
        else:
            from services.common.tiny_model import write_tiny_model

            model_dir = write_tiny_model(Path(tmp) / "tiny")
        results: dict[str, list[float]] = {"plain HF (1 process)": [], "megatron TP=1 (1 process)": [],
                                           "megatron TP=2 (2 processes)": []}
        # Alternate settings in rounds so drift in machine load hits all of them.
        rounds = 2
        per = max(1, a.repeats // rounds)
        for _ in range(rounds):
            sub = argparse.Namespace(**{**vars(a), "repeats": per})
            results["plain HF (1 process)"] += hf_times(model_dir, sub)
            results["megatron TP=1 (1 process)"] += megatron_times(model_dir, 1, sub)
            results["megatron TP=2 (2 processes)"] += megatron_times(model_dir, 2, sub)
    tokens = a.batch * (a.prompt + a.response)
    print(f"Machine: {_machine()}\n")
    print(f"Batch: {a.batch} sequences x ({a.prompt} prompt + {a.response} response) tokens = {tokens} tokens, "
          f"micro-batch {a.micro}, fp32, tiny Qwen2 (hidden 128, 2 layers, vocab 4096), 1 thread per process; "
          f"{len(next(iter(results.values())))} timed updates per setting after a warm-up.\n")
    print("| setting | update s, median (min-max) | tokens/s, median (min-max) | vs plain HF |")
    print("|---|---|---|---|")
    base = statistics.median(results["plain HF (1 process)"])
    for name, ts in results.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {tokens / med:,.0f} "
              f"({tokens / max(ts):,.0f}-{tokens / min(ts):,.0f}) | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

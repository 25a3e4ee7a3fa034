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
"""

from __future__ import annotations

import argparse
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


def rank_main(a: argparse.Namespace) -> int:
    """One Megatron rank: `repeats + 1` updates; rank 0 prints the timings (seconds) on one line."""
    import torch

    torch.set_num_threads(1)
    from services.trainer import parallel
    from services.trainer.update import OptimizerOptions, UpdateOptions
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
    a = ap.parse_args()
    if a.rank is not None:
        return rank_main(a)
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

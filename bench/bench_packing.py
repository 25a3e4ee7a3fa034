"""GRPO update throughput with packed, token-budget micro-batches vs padded ones (use_remove_padding + use_dynamic_bsz).

One batch of B rows, prompt P tokens, response lengths spread evenly over [R_MIN, R_MAX] (shuffled), on a
random Qwen2 (hidden H, L layers, fp32, vocabulary 4096), trained with the trainer's own `Update` (one rank,
gloo, one AdamW step per update):
- `padded`: micro-batches of M rows, each right-padded to its longest row (rlfabric's default);
- `packed T`: `use_remove_padding` + `use_dynamic_bsz`, micro-batches of at most T tokens
  (`update_max_packing_token_size`), packed (CPU: rows of the micro-batch's longest sequence, block-diagonal
  causal masks; services/trainer/packing.py).
Tokens/s counts the batch's real tokens (prompt + response) per update, by wall time and by the process's CPU
time (which moves less with other jobs on the machine). The settings alternate per repeat so machine noise
hits them alike; median (min-max) after one warm-up update each.

    .venv/bin/python bench/bench_packing.py [--repeats 2] [--batch 64] [--micro 4] [--budgets 2048,4096]

About 5 minutes on 2 idle cores at the defaults (a 16M-parameter model, 18,944 tokens per update).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_info, write_scaling_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rows(a: argparse.Namespace, vocab: int):
    import torch

    from services.trainer.step import SequenceRows

    g = torch.Generator().manual_seed(0)
    resp = torch.linspace(a.r_min, a.r_max, a.batch).round().long()[torch.randperm(a.batch, generator=g)]
    prompt = torch.full((a.batch,), a.prompt)
    return SequenceRows(torch.randint(0, vocab, (int((prompt + resp).sum()),), generator=g), prompt, resp)


def _experience(rows, seed: int):
    import torch

    from services.trainer.update import Experience

    g = torch.Generator().manual_seed(seed)
    t = rows.num_response_tokens
    old = -8.3 + 0.1 * torch.randn(t, generator=g)
    return Experience(rows, torch.randn(len(rows), generator=g), old, old + 0.05 * torch.randn(t, generator=g))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--r-min", type=int, default=16)
    ap.add_argument("--r-max", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4, help="padded micro-batch rows (micro_batch_size)")
    ap.add_argument("--budgets", default="2048,4096", help="update_max_packing_token_size values, comma-separated")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from services.trainer import parallel
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.packing import Packing
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        model_dir = write_scaling_model(Path(tmp) / "model", a.hidden, a.layers)
        parallel.init_distributed(rank=0, world_size=1)
        parallel.init_model_parallel(1, 1)
        w = TrainerWorker(WorkerOptions(hf_dir=str(model_dir), optimizer=OptimizerOptions(lr=1e-6)))
    params = sum(p.numel() for p in w.model.parameters())
    rows = _rows(a, w.spec.vocab_size)
    tokens = int((rows.prompt_lengths + rows.response_lengths).sum())

    base = UpdateOptions(micro_batch_size=a.micro)
    settings = {"padded": base}
    for t in (int(x) for x in a.budgets.split(",")):
        settings[f"packed {t}"] = dataclasses.replace(
            base, packing=Packing(remove_padding=True, max_tokens=t, key_prefix="update"))
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    step = 0
    for rep in range(a.repeats + 1):
        for name, opts in settings.items():
            step += 1
            w.opts = dataclasses.replace(w.opts, update=opts)
            t0, c0 = time.perf_counter(), time.process_time()
            w.update(_experience(rows, step), temperature=1.0, kl_coef=0.001, step=step)
            if rep:
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))

    print(machine_info("torch", "megatron-core"))
    print(f"random Qwen2: hidden {a.hidden}, {a.layers} layers, {params / 1e6:.1f}M parameters, fp32, "
          f"{a.threads} thread(s); batch {a.batch} rows, prompt {a.prompt}, responses {a.r_min}-{a.r_max} "
          f"({tokens} tokens); padded micro-batches of {a.micro} rows; {a.repeats} repeats")
    print(f"{'setting':<12} {'wall s, median (min-max)':<26} {'tokens/s':>8} {'vs padded':>9}   "
          f"{'CPU s, median (min-max)':<25} {'tokens/s':>8} {'vs padded':>9}")
    pad = [statistics.median(t[i] for t in times["padded"]) for i in (0, 1)]
    for name, ts in times.items():
        cells = []
        for i in (0, 1):
            xs = [t[i] for t in ts]
            med = statistics.median(xs)
            cells.append(f"{med:7.2f} ({min(xs):6.2f}-{max(xs):6.2f}){'':<3} {tokens / med:8.0f} {pad[i] / med:8.2f}x")
        print(f"{name:<12} " + "   ".join(cells))
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

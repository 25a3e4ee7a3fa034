"""Launching trainer rank processes from tests (real processes, gloo, loopback)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from services.common.net import free_port

REPO = Path(__file__).resolve().parents[2]


def rank_env() -> dict[str, str]:
    # The repo first, then whatever the caller's PYTHONPATH holds (a GPU machine's packages installed beside the
    # system's, as bench/device_check.py's runs use).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path)


def rank_arguments() -> argparse.ArgumentParser:
    """The flags every rank script takes: `run_ranks`'s --rank/--world/--port, and the --hf model and --work folder
    (add a script's own flags to the parser it returns)."""
    ap = argparse.ArgumentParser()
    for k in ("rank", "world", "port"):
        ap.add_argument(f"--{k}", type=int, required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--work", required=True)
    return ap


def run_ranks(script: str, world: int, args: list[str], *, timeout_s: float = 300) -> None:
    """Run `tests/trainer/SCRIPT --rank R --world W --port P ARGS...` as `world` rank processes (gloo, loopback)
    and wait for them; AssertionError with every rank's output tail if any exits non-zero or runs past
    `timeout_s`."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "trainer" / script), "--rank", str(r), "--world",
                               str(world), "--port", str(port), *args],
                              env=rank_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{script} ranks exited {codes}:\n" + "\n".join(o[-3000:] for o in outputs))


def run_rank_checks(world: int, layouts: list[tuple[int, int]], hf: Path, work: Path, *, load: Path | None = None,
                    timeout_s: float = 300) -> list[Path]:
    """Run tests/trainer/rank_checks.py on `world` ranks for each (tp, pp) layout in turn (one set of processes);
    return rank 0's results file of each layout. `load` applies to the first layout."""
    extra = ["--load", str(load)] if load else []
    for tp, pp in layouts:
        extra += ["--layout", f"{tp}x{pp}"]
    run_ranks("rank_checks.py", world, ["--hf", str(hf), "--work", str(work), *extra], timeout_s=timeout_s)
    return [work / f"results_w{world}_tp{tp}_pp{pp}.pt" for tp, pp in layouts]

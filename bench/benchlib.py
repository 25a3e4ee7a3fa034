"""What the benchmarks share: the machine line their numbers are quoted with, the RESULTS.md section each owns, and
the random Qwen2 the trainer benches grow."""

from __future__ import annotations

import argparse
import os
import platform
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(*packages: str) -> str:
    """One line: CPU, cores, load average now, Python, and the versions of `packages` (distribution names)."""
    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    pkgs = ", ".join(f"{p} {ver(p)}" for p in packages)
    return (f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
            f"Python {platform.python_version()}" + (f", {pkgs}" if pkgs else ""))



RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_results_section(title: str, text: str) -> None:
    """Replaces the `## {title}` section of bench/RESULTS.md with `text` (appended when there is none)."""
    body = RESULTS.read_text()
    section = f"## {title}\n\n{text.rstrip()}\n"
    pattern = rf"## {re.escape(title)}\n.*?(?=\n## |\Z)"
    body = re.sub(pattern, lambda _: section, body, flags=re.S) if re.search(pattern, body, flags=re.S) \
        else body.rstrip() + "\n\n" + section
    RESULTS.write_text(body)


def write_scaling_model(out: Path, hidden: int, layers: int, **extra) -> Path:
    """A random Qwen2 of `hidden` (heads of 64, 2 KV heads), `layers`, SwiGLU 3 x hidden, untied embeddings."""
    from services.common.tiny_model import write_tiny_model

    return write_tiny_model(out, hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=2, intermediate_size=3 * hidden, tie_word_embeddings=False, **extra)


def add_phase_arguments(ap: argparse.ArgumentParser, phases) -> None:
    """The hidden flags of a bench's child process: which phase it runs, its rank and rendezvous port, the model
    folder and the file it writes its result to."""
    ap.add_argument("--phase", choices=sorted(phases), help=argparse.SUPPRESS)
    for k in ("rank", "port"):
        ap.add_argument(f"--{k}", type=int, default=0, help=argparse.SUPPRESS)
    for k in ("hf", "out"):
        ap.add_argument(f"--{k}", help=argparse.SUPPRESS)

"""What every benchmark prints: the machine and the package versions its numbers were measured with."""

from __future__ import annotations

import os
import platform
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


"""A child command whose console output a test follows line by line (`rlfabric up`, `rlfabric train`)."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest


class ConsoleProcess:
    """Starts `args` in `repo_root` with stdout and stderr merged, collecting the lines on a reader thread."""

    def __init__(self, name: str, args: Sequence[str], repo_root: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(list(args), cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONPATH": str(repo_root)})
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of `pattern` in the output; fails the test if the child exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output)
            if match:
                return match
            assert self.proc.poll() is None, \
                f"{self.name} exited ({self.proc.returncode}) before {pattern!r}:\n{self.output[-4000:]}"
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} after {timeout_s}s:\n{self.output[-4000:]}")

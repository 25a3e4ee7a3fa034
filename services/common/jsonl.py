"""Reading JSON Lines files written by people or other tools: one home for "which line is broken".

Readers of run output that must survive a line cut short by a crash (services/coordinator/sinks.py) and the
dataset readers, which number rows rather than lines (services/data/readers.py), keep their own loops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.errors import DataError


def json_lines(path: str | Path, what: str = "") -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of `path`, in order.

    Raises:
        DataError: a line that is not JSON, naming `what` (e.g. "corpus"), the file and the line.
    """
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{label}:{number}: not JSON ({e.msg})") from e

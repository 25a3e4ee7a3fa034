"""docs/reliability.md names a test on every row, and every test it names exists (pytest collects it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

FAULTS = ["SIGKILL", "SIGSTOP"]
SERVICES = ["reward worker", "rollout replica", "trainer rank", "coordinator"]


def named_tests(doc: str) -> list[str]:
    return re.findall(r"`(tests/[\w/]+\.py::[^`]+)`", doc)


def test_every_row_names_a_test_and_every_named_test_exists(repo_root: Path) -> None:
    doc = (repo_root / "docs" / "reliability.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| fault")]
    assert rows and all(named_tests(row) for row in rows), [r for r in rows if not named_tests(r)]
    for fault in FAULTS:  # the matrix the reliability work promises: every signal x every service
        for service in SERVICES:
            assert any(row.startswith(f"| {fault} | {service}") for row in rows), f"no row for {fault} x {service}"
    assert any("Redis" in row and "restart" in row for row in rows)
    assert any(row.startswith("| SIGKILL | `rlfabric up`") for row in rows)

    names = named_tests(doc)
    files = sorted({n.split("::")[0] for n in names})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow or not slow",
                          "-p", "no:randomly", *files], cwd=repo_root, capture_output=True, text=True, timeout=300)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert collected, out.stdout[-2000:] + out.stderr[-2000:]
    missing = [n for n in names if n not in collected and not any(c.startswith(n + "[") for c in collected)]
    assert missing == [], missing

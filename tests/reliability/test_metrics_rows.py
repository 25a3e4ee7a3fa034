"""metrics.jsonl holds each iteration once, also when a resumed run recomputes iterations past its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from services.coordinator.sinks import JsonlSink


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_replaces_the_rows_of_iterations_it_recomputes(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "r" / "metrics.jsonl"
    first = JsonlSink(path)
    for i in (1, 2, 3):  # checkpoint at 2, then killed after iteration 3
        first.write(i, {"reward": float(i), "iteration": float(i)})  # as RunDriver writes them
    first.close()
    with path.open("a") as f:
        f.write('{"iteration": 4, "rew')  # the crash cut a row short
    resumed = JsonlSink(path)  # resumes from the checkpoint: iteration 3 again
    resumed.write(3, {"reward": 30.0})
    resumed.write(4, {"reward": 40.0})
    resumed.close()
    assert rows(path) == [{"iteration": 1.0, "reward": 1.0}, {"iteration": 2.0, "reward": 2.0},
                          {"iteration": 3, "reward": 30.0}, {"iteration": 4, "reward": 40.0}]


def test_a_run_that_goes_on_only_appends(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write(1, {"a": 1.0})
    sink.close()
    sink = JsonlSink(path)
    sink.write(2, {"a": 2.0})
    sink.close()
    assert [r["iteration"] for r in rows(path)] == [1, 2]
    assert not path.with_name("metrics.jsonl.tmp").exists()

"""Offline scoring of a JSONL file (`rlfabric reward score`), for evaluation without any server.

Each input record must hold `response` and `ground_truth`; it is written back unchanged, in input order,
with `score` added (and `error` where the verification failed). Verifications run in the same process
pool as the service, so hangs and crashes cost one record each.
"""

import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from services.reward.pool import SampleClock, VerifierPool


@dataclass(frozen=True)
class ScoreSummary:
    """What `score_jsonl` did."""

    count: int
    mean_score: float
    errors: int
    seconds: float

    @property
    def scores_per_s(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"scored {self.count} records: mean score {self.mean_score:.4f}, errors {self.errors}, "
                f"{self.scores_per_s:.1f} scores/s ({self.seconds:.1f} s)")


def _read_records(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
            for key in ("response", "ground_truth"):
                if not isinstance(record.get(key), str):
                    raise ValueError(f"{path}:{line_no}: field {key!r} must be a string; every record needs "
                                     "'response' and 'ground_truth'")
            records.append(record)
    return records


def score_jsonl(in_path: Path, out_path: Path, verifier: str, *, pool: VerifierPool, deadline_s: float = 10.0,
                window: int = 256, progress: Callable[[int, int], None] | None = None) -> ScoreSummary:
    """Scores every record of `in_path` with `verifier` and writes them to `out_path` in input order."""
    if verifier not in pool.names:
        raise ValueError(f"unknown verifier {verifier!r}; available: {', '.join(pool.names)}")
    records = _read_records(in_path)
    started = time.monotonic()
    total, errors, done = 0.0, 0, 0
    in_flight: deque = deque()
    with out_path.open("w", encoding="utf-8") as out:
        submitted = 0
        # A bounded window keeps memory flat and output ordered while the pool stays busy.
        while done < len(records):
            while submitted < len(records) and len(in_flight) < window:
                record = records[submitted]
                in_flight.append((record, pool.submit(verifier, record["response"], record["ground_truth"],
                                                      SampleClock(deadline_s))))
                submitted += 1
            record, future = in_flight.popleft()
            outcome = future.result()
            record = dict(record, score=outcome.score)
            if outcome.reason:
                record["error"] = outcome.error
                errors += 1
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            total += outcome.score
            done += 1
            if progress is not None:
                progress(done, len(records))
    return ScoreSummary(count=done, mean_score=total / done if done else 0.0, errors=errors,
                        seconds=time.monotonic() - started)


def print_progress(stream: TextIO = sys.stderr) -> Callable[[int, int], None]:
    """A progress callback that rewrites one status line about ten times per second."""
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] > 0.1:
            last[0] = now
            stream.write(f"\r{done}/{total} scored")
            if done == total:
                stream.write("\n")
            stream.flush()

    return show

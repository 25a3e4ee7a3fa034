"""Offline scoring of a JSONL file (`rlfabric reward score`), for evaluation without any server.

Each input record must hold `response` and `ground_truth`; it is written back unchanged, in input order,
with `score` added (and `error` where the verification failed). Built-in and plugin rules run in the
same process pool as the service, so hangs and crashes cost one record each; a registered remote
verifier is called as a worker calls it (`remote.py`). The output appears only when every record is
scored (written beside it, then renamed).
"""

import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import redis

from services.common.errors import DataError
from services.common.jsonl import json_lines
from services.common.redis_store import Registry, connect
from services.reward.endpoints import EndpointPolicy, member_hosts
from services.reward.outcome import Outcome
from services.reward.pool import SampleClock, VerifierPool
from services.reward.remote import RemoteVerifiers
from services.reward.verifier_store import VerifierStore
from services.reward.verifiers.registry import VERIFIERS

# Starts one verification: (record index, response, ground truth, the record's clock) -> its outcome.
Submit = Callable[[int, str, str, SampleClock], "Future[Outcome]"]


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
    for line_no, record in json_lines(path):
        for key in ("response", "ground_truth"):
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"{path}:{line_no}: field {key!r} must be a string; every record needs "
                                "'response' and 'ground_truth'")
        records.append(record)
    return records


def score_jsonl(in_path: Path, out_path: Path, submit: Submit, *, deadline_s: float = 10.0, window: int = 256,
                progress: Callable[[int, int], None] | None = None) -> ScoreSummary:
    """Scores every record of `in_path` with `submit` and writes them to `out_path` in input order."""
    records = _read_records(in_path)
    started = time.monotonic()
    total, errors, done = 0.0, 0, 0
    in_flight: deque = deque()
    partial = out_path.with_name(out_path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            submitted = 0
            # A bounded window keeps memory flat and output ordered while the pool stays busy.
            while done < len(records):
                while submitted < len(records) and len(in_flight) < window:
                    record = records[submitted]
                    in_flight.append((record, submit(submitted, record["response"], record["ground_truth"],
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
    except BaseException:
        partial.unlink(missing_ok=True)  # never a half-written output
        raise
    partial.replace(out_path)
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


@contextmanager
def open_verifier(name: str, *, plugins: dict[str, str], processes: int, redis_url: str | None,
                  verifier_allow: str) -> Iterator[Submit]:
    """`Submit` for the verifier `name`: a built-in or plugin in a process pool, else a verifier
    registered in the Redis at `redis_url` (its endpoint checked against `verifier_allow`).

    Raises ValueError saying how to make `name` available when it is none of these.
    """
    if name in VERIFIERS or name in plugins:
        with VerifierPool(processes, plugins=plugins) as pool:
            yield lambda index, response, ground_truth, clock: pool.submit(name, response, ground_truth, clock)
        return
    if redis_url is None:
        raise ValueError(f"unknown verifier {name!r}; built-in verifiers are {', '.join(VERIFIERS)}. For a "
                         f"registered remote verifier pass --redis-url (the Redis the reward workers use); for a "
                         f"local Python rule pass --verifier-plugin {name}=package.module:function")
    client = connect(redis_url)
    store = VerifierStore(client)
    try:
        store.revision()
    except redis.RedisError as e:
        raise ValueError(f"cannot reach Redis at {redis_url} (--redis-url): {e}") from e
    registry = Registry(client)
    remote = RemoteVerifiers(store, endpoints=EndpointPolicy.parse(verifier_allow, lambda: member_hosts(registry)),
                             local_names=frozenset(VERIFIERS), poll=False)
    try:
        verifier = remote.get(name)
        if verifier is None:
            registered = ", ".join(entry.name for entry in remote.entries()) or "none"
            raise ValueError(f"no usable verifier {name!r} is registered in Redis at {redis_url} (usable: "
                             f"{registered}); register it with `rlfabric reward register`, or allow its endpoint "
                             f"with --verifier-allow (the log says why an entry was skipped)")
        yield lambda index, response, ground_truth, clock: verifier.submit(f"row-{index}", response, ground_truth,
                                                                           "", clock)
    finally:
        remote.close()

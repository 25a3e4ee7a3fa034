"""Preprocessing: raw rows -> templated prompt token ids and answer labels -> Megatron indexed datasets.

For each kept row, in input order, one sequence (and one document) is written to every field:
`input_ids` (the templated prompt, ending with the assistant header), `attention_mask` (ones of the same
length) and each of `dataset_additional_keys` (`labels` = the ground-truth answer tokenised without special
tokens). Files are `{output_prefix}_packed_{field}_document.{bin,idx}`, int32, written by megatron-core's
own `IndexedDatasetBuilder`, so `IndexedDataset` reads them.

Choices:
- Tokenisation runs in `workers` processes (fork on Linux, each loads the tokenizer once); the parent reads
  and maps rows and writes, keeping a bounded window of batches in flight so memory stays flat.
- Atomic output (`indexed_output.py`): a failed, interrupted or killed run leaves no `.bin`/`.idx` at the
  prefix, and an earlier complete output stays untouched.
- Rows are dropped, counted by reason, for an empty prompt or answer (see `handlers`) and, when
  `seq_length` is set, for any field of `seq_length` tokens or more (upstream's rule).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import DataError
from services.common.model_paths import check_local_path
from services.data.dataset_config import DatasetConfig
from services.data.handlers import (
    DROP_REASONS,
    DROP_TOO_LONG,
    LABELS_KEY,
    Dropped,
    InstructionHandler,
    RowTexts,
    get_handler,
)
from services.data.indexed_output import AtomicOutput
from services.data.readers import RowSource, open_rows
from services.data.templates import Template, get_template

logger = logging.getLogger(__name__)

_BATCH_ROWS = 64
_LISTED_DROPS = 20  # dropped row indices kept per reason for the summary


def output_fields(config: DatasetConfig) -> list[str]:
    return ["input_ids", "attention_mask", *config.dataset_additional_keys]


@dataclass
class PreprocessSummary:
    """What a run did: counts, drops by reason, speed and the files it wrote."""

    input: str
    input_kind: str
    rows_read: int = 0
    rows_written: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    dropped_rows: dict[str, list[int]] = field(default_factory=dict)  # the first few row indices per reason
    seconds: float = 0.0  # the whole run, tokenizer loading and imports included
    process_seconds: float = 0.0  # from the first row read to the files renamed into place
    workers: int = 1
    outputs: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, row_index: int) -> None:
        self.dropped[reason] += 1
        listed = self.dropped_rows.setdefault(reason, [])
        if len(listed) < _LISTED_DROPS:
            listed.append(row_index)

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def rows_per_s(self) -> float:
        return self.rows_read / self.seconds if self.seconds > 0 else 0.0

    @property
    def process_rows_per_s(self) -> float:
        return self.rows_read / self.process_seconds if self.process_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "input_kind": self.input_kind, "rows_read": self.rows_read,
                "rows_written": self.rows_written, "rows_dropped": self.rows_dropped,
                "dropped": dict(self.dropped), "dropped_rows": dict(self.dropped_rows),
                "seconds": self.seconds, "rows_per_s": self.rows_per_s,
                "process_seconds": self.process_seconds, "process_rows_per_s": self.process_rows_per_s,
                "workers": self.workers, "outputs": dict(self.outputs)}

    def format(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in self.dropped.items())
        lines = [
            f"input: {self.input} ({self.input_kind})",
            f"rows read: {self.rows_read}",
            f"rows written: {self.rows_written}",
            f"rows dropped: {self.rows_dropped} ({reasons})",
        ]
        more = {r: "..." if self.dropped[r] > len(rows) else "" for r, rows in self.dropped_rows.items()}
        lines += [f"  {reason} rows: {', '.join(map(str, rows))}{more[reason]}"
                  for reason, rows in self.dropped_rows.items()]
        lines += [
            f"time: {self.seconds:.2f} s, {self.rows_per_s:.0f} rows/s overall, "
            f"{self.process_rows_per_s:.0f} rows/s after startup (workers {self.workers})",
            "outputs:",
        ]
        lines += [f"  {path}  {size} bytes" for path, size in self.outputs.items()]
        return "\n".join(lines)


def load_tokenizer(name_or_path: str) -> Any:
    """A Hugging Face tokenizer from a folder (or hub name); failures become a `DataError` naming the path."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are processes; no Rayon after fork
    source = check_local_path(name_or_path, "tokenizer_name_or_path")  # a missing folder never reaches the hub
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for unusable folders
        raise DataError(f"cannot load a tokenizer from tokenizer_name_or_path {name_or_path!r}: "
                        f"{type(exc).__name__}: {exc}") from exc


# ---- tokenisation (runs in worker processes, or inline for workers == 1) -------------------------------

class _BackendEncoder:
    """A fast tokenizer's Rust backend called directly.

    The ids equal `tokenizer.encode(text, add_special_tokens=False)` (tests check it on the real data), and
    skipping transformers' per-call Python wrapping makes tokenisation about twice as fast.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._backend = tokenizer.backend_tokenizer
        self.bos_token, self.eos_token = tokenizer.bos_token, tokenizer.eos_token
        self.bos_token_id, self.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.convert_tokens_to_ids = tokenizer.convert_tokens_to_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids


def make_encoder(tokenizer: Any) -> Any:
    """The fastest exact encoder for `tokenizer`: its Rust backend when it has one, else itself."""
    return _BackendEncoder(tokenizer) if getattr(tokenizer, "backend_tokenizer", None) is not None else tokenizer


_STATE: dict[str, Any] = {}


def _set_parent_death_signal() -> None:
    # A SIGKILLed parent cannot stop its pool; ask Linux to kill the worker too rather than leave orphans.
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _init_tokenizer_state(tokenizer_path: str, template: Template, extra_fields: Sequence[str],
                          in_worker: bool) -> None:
    if in_worker:
        import signal

        _set_parent_death_signal()
        # A forked worker inherits the CLI's SIGTERM handler; restore the default so `Pool.terminate` ends it
        # at once, and leave Ctrl-C to the parent, which stops the pool.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STATE["tokenizer"] = make_encoder(load_tokenizer(tokenizer_path))
    _STATE["template"] = template
    _STATE["extra_fields"] = tuple(extra_fields)


def _tokenize_batch(rows: Sequence[RowTexts]) -> list[tuple[int, dict[str, np.ndarray]]]:
    tok, template, extra_fields = _STATE["tokenizer"], _STATE["template"], _STATE["extra_fields"]
    out = []
    for r in rows:
        ids = np.asarray(template.encode_prompt(tok, r.prompt, r.system), dtype=np.int32)
        fields = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        for key in extra_fields:
            text = r.response if key == LABELS_KEY else r.extras[key]
            fields[key] = np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int32)
        out.append((r.index, fields))
    return out


# ---- the run ------------------------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int | None, interval: int, label: str) -> None:
        self.total, self.interval, self.label = total, interval, label
        self.start = time.monotonic()
        self.next_at = interval

    def update(self, done: int) -> None:
        if done < self.next_at:
            return
        self.next_at = (done // self.interval + 1) * self.interval
        elapsed = time.monotonic() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        if self.total:
            eta = (self.total - done) / rate if rate > 0 else float("inf")
            logger.info("preprocess %s: %d/%d rows (%.1f%%), %.0f rows/s, ETA %.1f s",
                        self.label, done, self.total, 100.0 * done / self.total, rate, eta)
        else:
            logger.info("preprocess %s: %d rows, %.0f rows/s", self.label, done, rate)


def _tokenizer_pool(config: DatasetConfig, template: Template, extra_fields: list[str]) -> Any:
    """A process pool of `config.workers` tokenizers, or None for one worker (tokenise in this process)."""
    if config.workers <= 1:
        return None
    import multiprocessing as mp

    # Fork before megatron/torch load: the fewer libraries (and their threads and locks) a fork copies,
    # the safer it is. The tokenizer loaded by the caller already proved the path works.
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    return ctx.Pool(config.workers, initializer=_init_tokenizer_state,
                    initargs=(config.tokenizer_name_or_path, template, extra_fields, True))


def _feed(source: RowSource, handler: InstructionHandler, summary: PreprocessSummary,
          submit: Callable[[list[RowTexts]], None], idle: Callable[[], object]) -> None:
    """Reads every row, counts drops, and submits the kept rows' texts in batches of `_BATCH_ROWS`.

    `idle()` runs after a dropped row while nothing is buffered, so progress still moves on a run of drops.
    """
    batch: list[RowTexts] = []
    for row in source:
        summary.rows_read += 1
        texts = handler.extract(row)
        if isinstance(texts, Dropped):
            summary.drop(texts.reason, texts.index)
            if not batch:
                idle()
            continue
        batch.append(texts)
        if len(batch) >= _BATCH_ROWS:
            submit(batch)
            batch = []
    if batch:
        submit(batch)


def preprocess(config: DatasetConfig) -> PreprocessSummary:
    """Runs one dataset's preprocessing end to end; raises `DataError` for bad input or configuration."""
    started = time.monotonic()
    template = get_template(config.prompt_type, config.prompt_type_path)
    handler = get_handler(config.handler_name, config.map_keys, config.dataset_additional_keys)
    source = open_rows(config.input)
    extra_fields = list(config.dataset_additional_keys)
    fields = output_fields(config)
    _init_tokenizer_state(config.tokenizer_name_or_path, template, extra_fields, in_worker=False)
    summary = PreprocessSummary(input=str(config.input), input_kind=source.kind, workers=config.workers)
    logger.info("preprocess %s: %s rows (%s), handler %s, template %s, %d worker(s) -> %s",
                config.input, source.total if source.total is not None else "?", source.kind,
                config.handler_name, template.name, config.workers, config.output_prefix)

    pool = _tokenizer_pool(config, template, extra_fields)
    output = None
    try:
        output = AtomicOutput(config.output_prefix, fields)
        process_started = time.monotonic()
        progress = _Progress(source.total, config.log_interval, Path(config.input).name)

        def write(results: list[tuple[int, dict[str, np.ndarray]]]) -> None:
            for row_index, arrays in results:
                if config.seq_length is not None and any(len(a) >= config.seq_length for a in arrays.values()):
                    summary.drop(DROP_TOO_LONG, row_index)
                else:
                    output.add(arrays)
                    summary.rows_written += 1
            progress.update(summary.rows_written + summary.rows_dropped)

        in_flight: collections.deque = collections.deque()
        window = 4 * config.workers

        def submit(batch: list[RowTexts]) -> None:
            if pool is None:
                write(_tokenize_batch(batch))
                return
            in_flight.append(pool.apply_async(_tokenize_batch, (batch,)))
            while len(in_flight) >= window:
                write(in_flight.popleft().get())

        _feed(source, handler, summary, submit,
              lambda: not in_flight and progress.update(summary.rows_written + summary.rows_dropped))
        while in_flight:
            write(in_flight.popleft().get())
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        summary.outputs = output.commit()
        summary.process_seconds = time.monotonic() - process_started
    except BaseException:
        if output is not None:
            output.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    summary.seconds = time.monotonic() - started
    logger.info("preprocess %s: done, %d rows read, %d written, %d dropped %s, %.2f s",
                config.input, summary.rows_read, summary.rows_written, summary.rows_dropped,
                summary.dropped, summary.seconds)
    return summary

"""Writing Megatron indexed datasets atomically: all fields appear at the prefix together, or none do.

Everything is written inside a hidden temporary folder beside the prefix (`.{name}.rlfabric-tmp-{pid}`) by
megatron-core's own `IndexedDatasetBuilder`, and renamed into place only after every field is finalised and
synced. A failed, interrupted or killed run leaves no `.bin`/`.idx` at the prefix (an earlier complete
output stays untouched); leftover temporary folders of dead runs are removed by the next run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

_TMP_MARK = ".rlfabric-tmp-"


def output_path(output_prefix: str | Path, field_name: str, suffix: str) -> Path:
    """`{output_prefix}_packed_{field}_document{suffix}`, the file name MindSpeed-RL's loader expects."""
    return Path(f"{output_prefix}_packed_{field_name}_document{suffix}")



def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp_dirs(out_dir: Path, base: str) -> None:
    pattern = re.compile(re.escape(f".{base}{_TMP_MARK}") + r"(\d+)$")
    for p in out_dir.glob(f".{base}{_TMP_MARK}*"):
        m = pattern.match(p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            logger.info("removing temporary output %s of a run that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)


class AtomicOutput:
    """Megatron builders writing under a temporary folder; `commit` renames the files to the prefix."""

    def __init__(self, output_prefix: str, fields: Sequence[str]) -> None:
        with warnings.catch_warnings():
            # megatron.core's package import warns about optional GPU extensions we do not use here.
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix = Path(output_prefix)
        self.out_dir = prefix.parent
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(self.out_dir, prefix.name)
        self.tmp_dir = self.out_dir / f".{prefix.name}{_TMP_MARK}{os.getpid()}"
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir()
        self.prefix = prefix
        self.fields = list(fields)
        tmp_prefix = self.tmp_dir / prefix.name
        self.builders = {f: IndexedDatasetBuilder(str(output_path(tmp_prefix, f, ".bin")), dtype=np.int32)
                         for f in self.fields}

    def add(self, fields: dict[str, np.ndarray]) -> None:
        import torch

        for name in self.fields:
            self.builders[name].add_item(torch.from_numpy(fields[name]))
            self.builders[name].end_document()

    def commit(self) -> dict[str, int]:
        tmp_prefix = self.tmp_dir / self.prefix.name
        for name, builder in self.builders.items():
            builder.finalize(str(output_path(tmp_prefix, name, ".idx")))
        moves = [(output_path(tmp_prefix, f, s), output_path(self.prefix, f, s))
                 for s in (".bin", ".idx") for f in self.fields]
        for src, _ in moves:
            with open(src, "rb") as fh:
                os.fsync(fh.fileno())
        # Old outputs go first (indexes before data), then data files, then indexes: a reader that checks
        # for the .idx never pairs a new index with old data.
        for _, dst in reversed(moves):
            dst.unlink(missing_ok=True)
        for src, dst in moves:
            os.replace(src, dst)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return {str(dst): dst.stat().st_size for _, dst in moves}

    def abort(self) -> None:
        for builder in self.builders.values():
            try:
                builder.data_file.close()
            except OSError:
                pass
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

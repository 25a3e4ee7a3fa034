"""Checkpoint layout, atomic commits, and the reference-weights rule (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer import ckpt_layout


def _write_iteration(root: Path, iteration: int, payload: bytes, *, tp: int = 2, pp: int = 1) -> Path:
    tmp = ckpt_layout.tmp_iter_dir(root, iteration)
    for t in range(tp):
        for p in range(pp):
            path = ckpt_layout.shard_path(tmp, t, p, pp)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(payload)
    return ckpt_layout.commit_iter_dir(root, iteration)


def test_megatron_names():
    assert ckpt_layout.iter_dirname(7) == "iter_0000007"
    assert ckpt_layout.rank_dirname(1, 0, pp=1) == "mp_rank_01"
    assert ckpt_layout.rank_dirname(1, 2, pp=4) == "mp_rank_01_002"


def test_commit_updates_tracker_after_rename(tmp_path: Path):
    final = _write_iteration(tmp_path, 3, b"a", tp=2, pp=2)
    assert final == tmp_path / "iter_0000003"
    assert ckpt_layout.read_tracker(tmp_path) == 3
    assert ckpt_layout.detect_tp_pp(final) == (2, 2)
    assert not list(tmp_path.glob(".tmp_*"))


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path: Path):
    _write_iteration(tmp_path, 2, b"good")
    # A save of iteration 4 that died before its commit: shards half written in the temp dir.
    tmp = ckpt_layout.tmp_iter_dir(tmp_path, 4)
    (tmp / "mp_rank_00").mkdir(parents=True)
    (tmp / "mp_rank_00" / ckpt_layout.FILENAME).write_bytes(b"partial")
    path, it = ckpt_layout.resolve_iter_dir(tmp_path)
    assert it == 2 and (path / "mp_rank_01" / ckpt_layout.FILENAME).read_bytes() == b"good"
    # Saving the same iteration again replaces it whole.
    _write_iteration(tmp_path, 2, b"newer")
    assert (tmp_path / "iter_0000002" / "mp_rank_00" / ckpt_layout.FILENAME).read_bytes() == b"newer"


def test_missing_tracker_is_explained(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration.txt"):
        ckpt_layout.read_tracker(tmp_path)
    (tmp_path / ckpt_layout.TRACKER).write_text("banana")
    with pytest.raises(ValueError, match="'banana'"):
        ckpt_layout.read_tracker(tmp_path)

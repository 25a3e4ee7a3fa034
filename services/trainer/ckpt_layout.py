"""Megatron's on-disk checkpoint layout and atomic writes (no model or optimizer logic).

Layout (as Megatron's legacy `torch` format):
    {root}/latest_checkpointed_iteration.txt          "123" or "release"
    {root}/iter_0000123/mp_rank_{tp:02d}/model_optim_rng.pt           (PP == 1)
    {root}/iter_0000123/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt  (PP > 1)
    {root}/iter_0000123/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/...       (EP > 1: Megatron appends the expert
                                                       rank; every EP rank's file holds the non-expert weights too)
    {root}/release/...                                 (converted weights, iteration 0)
    {root}/hf_assets/                                  rlfabric: the HF config + tokenizer files, so
                                                       mcore2hf can write a complete HF folder.

Atomicity: an iteration is written into `{root}/.tmp_iter_XXXXXXX/`, every file fsynced, then the
directory is renamed to `iter_XXXXXXX` and only then is the tracker replaced (write temp, fsync,
rename). A crash at any point leaves the previous tracker pointing at a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
HF_ASSETS = "hf_assets"
FILENAME = "model_optim_rng.pt"
# Files of an HF folder that are not weights (copied verbatim by conversion).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def iter_dirname(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def rank_dirname(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's per-rank folder name (megatron/training/checkpointing.py `get_checkpoint_name`)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


def shard_path(iter_dir: Path, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> Path:
    return iter_dir / rank_dirname(tp_rank, pp_rank, pp, ep_rank, ep) / FILENAME


def read_tracker(root: str | Path) -> int | str:
    """The iteration the tracker names (int) or "release"; raise if there is no checkpoint."""
    path = Path(root) / TRACKER
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint tracker; is `load` a Megatron checkpoint directory?")
    text = path.read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text!r}") from None


def resolve_iter_dir(root: str | Path, iteration: int | str | None = None) -> tuple[Path, int | str]:
    """Directory of `iteration` (None/0 = the tracker's)."""
    it = read_tracker(root) if not iteration else iteration
    path = Path(root) / iter_dirname(it)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory missing (tracker or iteration {it!r} is stale)")
    return path, it


def _rank_numbers(iter_dir: Path) -> list[list[str]]:
    names = sorted(p.name for p in iter_dir.iterdir() if p.name.startswith("mp_rank_"))
    if not names:
        raise FileNotFoundError(f"{iter_dir}: no mp_rank_* folders")
    parts = [n.split("_")[2:] for n in names]
    if len({len(p) for p in parts}) != 1:
        raise ValueError(f"{iter_dir}: mp_rank_* folders of different layouts ({names[0]}, {names[-1]})")
    return parts


def detect_tp_pp(iter_dir: Path) -> tuple[int, int]:
    """TP and PP sizes from the mp_rank_* folder names alone, reading mp_rank_TT_NNN as TP_PP.

    Without expert parallelism only; `detect_tp_pp_ep` also tells mp_rank_TT_EEE (EP) apart.
    """
    parts = _rank_numbers(iter_dir)
    tp = len({p[0] for p in parts})
    pp = len({p[1] for p in parts}) if len(parts[0]) > 1 else 1
    return tp, pp


def detect_tp_pp_ep(iter_dir: Path) -> tuple[int, int, int]:
    """TP, PP and EP sizes from the mp_rank_* folders.

    Megatron names a rank mp_rank_TT_NNN both with PP > 1 (NNN the stage) and with EP > 1 at PP 1 (NNN the
    expert rank). The model file of mp_rank_00_001 settles it: with EP every rank holds the word embedding, with
    PP only stage 0 does.
    """
    import torch

    parts = _rank_numbers(iter_dir)
    sizes = [len({p[i] for p in parts}) for i in range(len(parts[0]))]
    if len(sizes) == 1:
        return sizes[0], 1, 1
    if len(sizes) == 3:
        return sizes[0], sizes[1], sizes[2]
    if sizes[1] == 1:
        return sizes[0], 1, 1
    path = shard_path(iter_dir, 0, 1, pp=2)
    payload = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, dict):
        raise ValueError(f"{path}: no 'model' state dict; is this a Megatron checkpoint?")
    if "embedding.word_embeddings.weight" in model:
        return sizes[0], 1, sizes[1]
    return sizes[0], sizes[1], 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path`."""
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def tmp_iter_dir(root: Path, iteration: int | str) -> Path:
    return root / f".tmp_{iter_dirname(iteration)}"


def commit_iter_dir(root: Path, iteration: int | str) -> Path:
    """Rename the fsynced temp dir into place (replacing an older copy), then update the tracker."""
    tmp = tmp_iter_dir(root, iteration)
    fsync_tree(tmp)
    final = root / iter_dirname(iteration)
    if final.exists():
        # Same iteration saved again: move the old one aside first so the rename below is atomic.
        trash = root / f".old_{iter_dirname(iteration)}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    return final


def write_tracker(root: Path, iteration: int | str) -> None:
    tmp = root / f".{TRACKER}.tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    fsync_dir(root)


def copy_hf_assets(hf_dir: Path, dest: Path) -> list[str]:
    """Copy the non-weight files (config, tokenizer, generation config) of an HF folder to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(Path(hf_dir).iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.endswith(".index.json"):
            shutil.copy2(p, dest / p.name)
            copied.append(p.name)
    return copied

"""Model and tokenizer folders named on a command line, checked before transformers or vLLM sees them.

Handed a path that is not there, transformers and vLLM take it for a Hugging Face hub id and spend up to a
minute in network retries before failing with a traceback about the hub. rlfabric reads its models from
folders, so every command that takes one (eval, sft, rollout serve, trainer serve, convert, preprocess's
tokenizer) asks here first and a missing folder is "not found" at once, naming the flag and the directory a
relative path was resolved from.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common.errors import DataError

HF_FOLDER = "a Hugging Face model folder (config.json, weights, tokenizer)"


def _not_found(path: str | Path, what: str) -> str:
    where = "" if Path(path).expanduser().is_absolute() else f" (relative paths are resolved from {Path.cwd()})"
    return f"{what} {str(path)!r} not found{where}"


def looks_local(name_or_path: str | Path) -> bool:
    """Whether `name_or_path` is written as a path rather than a bare hub id such as `gpt2`.

    `org/name` is both a path and a hub id; rlfabric treats it as a path, so a missing one never reaches the hub.
    """
    text = str(name_or_path)
    return text.startswith((".", "/", "~")) or os.sep in text.strip(os.sep)


def check_local_path(name_or_path: str | Path, what: str) -> str:
    """`name_or_path` with `~` expanded when it is written as a path; a hub id is returned as is.

    Raises:
        DataError: a path (see `looks_local`) that does not exist.
    """
    if not looks_local(name_or_path):
        return str(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise DataError(_not_found(name_or_path, what))
    return str(path)


def require_model_dir(path: str | Path, what: str, *, needs: tuple[str, ...] = ("config.json",),
                      kind: str = HF_FOLDER) -> Path:
    """The folder `path`, checked to exist and to hold the files in `needs`.

    Args:
        what: how the user named it, e.g. "--model" or "model" (used in messages).
        kind: what the folder should be, for the message's "pass ..." (default: a Hugging Face model folder).

    Raises:
        DataError: naming the path and what is missing.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise DataError(f"{_not_found(path, what)}; pass {kind}")
    if not folder.is_dir():
        raise DataError(f"{what} {str(path)!r} is a file; pass {kind}")
    absent = [name for name in needs if not (folder / name).is_file()]
    if absent:
        raise DataError(f"{what} {str(path)!r} has no {', '.join(absent)}; pass {kind}")
    return folder

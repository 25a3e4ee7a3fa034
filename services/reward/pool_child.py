"""Code that runs inside a reward pool process: the verifier table and the request loop.

Imported by the forkserver before it forks (see `pool.py`), so math-verify, sympy and mathruler are loaded
and warmed once and every replacement process starts in milliseconds. Nothing here knows about deadlines:
the parent kills a process that runs past one.
"""

import importlib
import importlib.util
import math
import signal
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path

from services.reward.verifiers.registry import VERIFIERS, Verifier

PING = "__ping__"


def load_plugin(spec: str) -> Verifier:
    """Imports a verifier given as `package.module:function` or `/path/to/file.py:function`.

    Raises ValueError naming the spec when it cannot be imported or is not callable.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"verifier plugin {spec!r}: expected 'package.module:function' or '/path/file.py:function'")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            module_name = f"rlfabric_plugin_{abs(hash(str(path)))}"
            module = sys.modules.get(module_name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(module_name, path)
                if loader_spec is None or loader_spec.loader is None:
                    raise ImportError(f"cannot load {path}")
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[module_name] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, OSError, SyntaxError) as e:
        raise ValueError(f"verifier plugin {spec!r} could not be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"verifier plugin {spec!r} is not callable")
    return fn


def warm_up() -> None:
    # The first math-verify / sympy call pays for regex compilation and lazy imports (about a second).
    for entry in VERIFIERS.values():
        try:
            entry.fn("<think>x</think> <answer>\\boxed{\\frac{1}{2}}</answer>", "x^2+1")
        except Exception:  # noqa: BLE001 (warm-up only; real failures surface per sample)
            pass


def child_main(conn: Connection, plugins: Mapping[str, str]) -> None:
    """Serves batches of (name, response, ground_truth) until the pipe closes or None arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    table: dict[str, Verifier] = {name: entry.fn for name, entry in VERIFIERS.items()}
    for name, spec in plugins.items():
        table[name] = load_plugin(spec)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message == PING:
            conn.send((PING, "ok", 0.0))
            continue
        # A batch of (task id, name, response, ground_truth); one (task id, kind, value) reply per item,
        # sent as soon as it is known, so the parent can tell which item ran past its deadline.
        for task_id, name, response, ground_truth in message:
            conn.send((task_id, *_run_one(table, name, response, ground_truth)))


def _run_one(table: Mapping[str, Verifier], name: str, response: str, ground_truth: str) -> tuple[str, object]:
    try:
        score = float(table[name](response, ground_truth))
    except Exception as e:  # noqa: BLE001 (any verifier failure costs this sample only)
        return "exception", f"{type(e).__name__}: {e}"[:500]
    if math.isfinite(score):
        return "ok", score
    return "non_finite", f"verifier returned {score!r}"

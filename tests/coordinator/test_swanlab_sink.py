"""rl_config.use_swanlab: the coordinator's SwanLab sink, as MindSpeed-RL's SwanLabLogger records a run.

The recording test runs the real `swanlab` in offline mode and reads the run's record back with SwanLab's own
reader; it skips where swanlab is not installed (requirements/swanlab.txt says how). The error paths run
everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.config.rl import RLConfig
from services.coordinator.app import build_sinks
from services.coordinator.sinks import SWANLAB_INSTALL, FanOut, SwanLabSink


def _cfg(**rl: object) -> SimpleNamespace:
    return SimpleNamespace(rl_config=RLConfig(**rl), actor_config=SimpleNamespace())


def _scalars(run_dir: Path) -> tuple[dict[str, str], dict[tuple[str, int], float]]:
    """(start record's project/name, {(key, step): value}) of the one SwanLab run under `run_dir`."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    [path] = run_dir.glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    start: dict[str, str] = {}
    values: dict[tuple[str, int], float] = {}
    while (raw := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("start"):
            start = {"project": record.start.project, "name": record.start.name}
        elif record.HasField("scalar"):
            values[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
    return start, values


def test_use_swanlab_records_every_iteration_offline(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason=f"swanlab is not installed: {SWANLAB_INSTALL}")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))  # never the user's ~/.swanlab
    cfg = _cfg(use_swanlab=True, swanlab_project="rlfabric-test", swanlab_exp_name="tiny", swanlab_mode="offline")
    sinks = build_sinks(cfg, tmp_path / "run")
    assert isinstance(sinks, FanOut) and [type(s).__name__ for s in sinks.sinks] == ["JsonlSink", "SwanLabSink"]
    sinks.write(1, {"grpo/score/mean": 0.25, "timing/all": 1.5})
    sinks.write(2, {"grpo/score/mean": 0.5, "timing/all": 1.25})
    sinks.close()

    # The default directory is the run's (upstream: ./swanlab); metric names are MindSpeed-RL's, unprefixed.
    start, values = _scalars(tmp_path / "run" / "swanlab")
    assert start == {"project": "rlfabric-test", "name": "tiny"}
    assert values == {("grpo/score/mean", 1): 0.25, ("timing/all", 1): 1.5,
                      ("grpo/score/mean", 2): 0.5, ("timing/all", 2): 1.25}


def test_use_swanlab_without_the_package_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "swanlab", None)  # `import swanlab` raises ImportError
    with pytest.raises(RuntimeError) as e:
        SwanLabSink("p", "e", tmp_path, "offline")
    assert str(e.value) == ("rl_config.use_swanlab is true but the `swanlab` package is not installed: "
                            f"`{SWANLAB_INSTALL}`, or set use_swanlab: false")


@pytest.mark.parametrize(("project", "name", "key"), [("", "e", "swanlab_project"), ("p", "", "swanlab_exp_name")])
def test_use_swanlab_without_project_or_name_names_the_key(tmp_path, project, name, key):
    with pytest.raises(RuntimeError, match=f"use_swanlab is true but {key} is empty"):
        build_sinks(_cfg(use_swanlab=True, swanlab_project=project, swanlab_exp_name=name), tmp_path)

"""Soak (bench/bench_soak.py): RSS and open fds of every service of a long tiny `rlfabric up` run grow by less
than 10% between iteration 20 and 200. The smoke runs the same sampling over a few iterations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_soak

pytestmark = pytest.mark.slow
EXPECTED = {name for name, _ in bench_soak.SERVICES}


def test_soak_smoke_samples_every_service(tmp_path: Path) -> None:
    samples = bench_soak.soak(4, tmp_path)
    assert sorted(samples) == [1, 2, 3, 4]
    for it in samples.values():
        assert set(it) == EXPECTED, it
        assert all(v["rss_mib"] > 1 and v["fds"] > 0 for v in it.values()), it
    assert set(bench_soak.growth(samples, 2, 4)) == EXPECTED


def test_200_iterations_grow_rss_and_fds_by_less_than_10_percent(tmp_path: Path) -> None:
    samples = bench_soak.soak(200, tmp_path)
    print("\n" + bench_soak.table(samples, 20, 200))
    growth = bench_soak.growth(samples, 20, 200)
    assert set(growth) == EXPECTED
    over = {(name, q): v for name, g in growth.items() for q, v in g.items() if v >= 0.10}
    assert over == {}, over

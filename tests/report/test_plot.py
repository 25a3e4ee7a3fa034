"""`rlfabric plot`: the run's metrics file is found, the timeline is drawn from logged spans or rebuilt from
timing/* by the parity rules, and the four PNGs are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.report.run_metrics import find_metrics, phase_spans, read_metrics, rolling_mean


def test_timeline_rebuilt_from_timings() -> None:
    # Rollout 0..1.0 s; the reward ends 0.2 s after it and took 0.8 s; the reference ends 0.1 s after it and
    # took 0.3 s; advantages end 0.25 s after the rollout; update 0.4 s; weight sync 0.05 s.
    m = {"timing/rollout": 1.0, "timing/old_log_p": 0.0, "timing/rule_reward": 0.8,
         "timing/non_overlap_rule_reward": 0.2, "timing/reference_model": 0.3,
         "timing/non_overlap_reference_model": 0.1, "timing/adv": 0.01, "timing/non_overlap_adv": 0.25,
         "timing/update": 0.4, "timing/resharding_to_infer": 0.05, "timing/all": 1.7}
    spans, logged = phase_spans(m)
    assert not logged
    assert spans["rollout"] == (0.0, 1.0)
    assert spans["rule_reward"] == pytest.approx((0.4, 1.2))
    assert spans["reference_model"] == pytest.approx((0.8, 1.1))
    assert spans["adv"] == pytest.approx((1.24, 1.25))
    assert spans["update"] == pytest.approx((1.25, 1.65))
    assert spans["resharding_to_infer"] == pytest.approx((1.65, 1.70))


def test_logged_timeline_wins() -> None:
    m = {"timing/rollout": 9.0, "timeline/rollout/start": 0.0, "timeline/rollout/end": 0.5,
         "timeline/update/start": 0.6, "timeline/update/end": 0.9}
    spans, logged = phase_spans(m)
    assert logged and spans == {"rollout": (0.0, 0.5), "update": (0.6, 0.9)}


def test_rolling_mean() -> None:
    import numpy as np

    assert rolling_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [1.0, 2.0, 4.0, 6.0]


def write_run(run_dir: Path, iterations: int = 12) -> Path:
    path = run_dir / "runs" / "run-x" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    rows = []
    for i in range(1, iterations + 1):
        rows.append({"iteration": i, "grpo/score/mean": 0.2 + 0.02 * i, "response_length/mean": 4.0,
                     "response_length/min": 3.0, "response_length/max": 5.0, "actor/kl_loss": 0.001 * i,
                     "actor/entropy": 0.5, "grad_norm": 1.0, "timing/all": 0.3, "timing/rollout": 0.1,
                     "timing/update": 0.05, **({"val/pass@1": 0.5 + 0.01 * i} if i % 4 == 0 else {})})
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"iteration": 0, "val/pass@1": 0.5}, *rows]))
    return path


def test_find_and_read(tmp_path: Path) -> None:
    path = write_run(tmp_path)
    assert find_metrics(tmp_path) == path and find_metrics(path.parent) == path
    metrics = read_metrics(path)
    assert [m["iteration"] for m in metrics] == list(range(13))
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        find_metrics(tmp_path / "nothing")


def test_cli_writes_the_four_pngs(tmp_path: Path, repo_root: Path) -> None:
    write_run(tmp_path)
    out = tmp_path / "charts"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "plot", str(tmp_path), "--out", str(out)],
                          cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["kl_entropy_grad_norm.png", "response_length.png", "reward.png", "timeline.png"]
    assert all((out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / n).stat().st_size > 10_000
               for n in names)
    bad = subprocess.run([sys.executable, "-m", "services.cli", "plot", str(tmp_path / "none")], cwd=repo_root,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr

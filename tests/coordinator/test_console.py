"""The console line of an iteration: short by default (what a person reads), every metric on request."""

from __future__ import annotations

import io

from services.coordinator.sinks import ConsoleSink, short_line

METRICS = {"grpo/score/mean": 0.453125, "response_length/mean": 3.21875, "actor/kl_loss": 0.00123,
           "e2e_tps": 2150.4, "timing/all": 0.3214, "actor/pg_loss": 0.01, "grad_norm": 1.5}


def test_short_line() -> None:
    assert short_line(3, METRICS, 10) == ("iteration 3/10 | reward 0.453 | len 3.2 | kl 1.23e-03 | tok/s 2150 | "
                                          "s 0.32")
    assert short_line(3, {**METRICS, "val/pass@1": 0.71}) == (
        "iteration 3 | reward 0.453 | val 0.710 | len 3.2 | kl 1.23e-03 | tok/s 2150 | s 0.32")
    assert short_line(1, {}) == "iteration 1"


def test_full_line_keeps_every_metric() -> None:
    out = io.StringIO()
    ConsoleSink(out, total=10, full=True).write(3, METRICS)
    line = out.getvalue()
    assert line.startswith("iteration 3/10 | timing/all: 0.3214 | grpo/score/mean: 0.453125")
    assert all(f"{k}: " in line for k in METRICS)

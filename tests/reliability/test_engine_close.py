"""Closing the rollout's vLLM engine is bounded, and vLLM is shut down on the engine's own thread.

After the rollout fuzzing, closing the session's engine at teardown hung in two of five runs (docs/reliability.md):
`close()` waited up to 30 s for the engine thread, then ran vLLM's shutdown on the caller's thread, whatever the
engine thread was still doing. Here the engine thread is held inside a sample callback (callbacks run on it) of
a sleeping engine, the state the fuzzing leaves most often, while `close` is called. One real engine of its own.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest


@pytest.fixture()
def engine(tiny_model_dir: Path, tmp_path: Path):
    pytest.importorskip("vllm")
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    engine = RolloutEngine(EngineOptions(
        model=str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_seqs=8, num_threads=1,
        cpu_kv_cache_gib=1, gpu_memory_utilization=0.2, cache_root=str(tmp_path / "vllm_cache"),
    ))
    yield engine
    engine.close(timeout_s=120)


def test_close_is_bounded_while_the_engine_thread_is_busy_and_shuts_vllm_down_on_that_thread(engine) -> None:
    from services.rollout.engine import EngineUnavailableError
    from services.rollout.options import SamplingOptions
    from services.rollout.samples import FINISH_ERROR, SampleRequest

    engine.sleep(1)
    entered, release = threading.Event(), threading.Event()
    results = []

    def held(result) -> None:  # a consumer that does not return (callbacks run on the engine thread)
        entered.set()
        release.wait()
        results.append(result)

    engine.submit(SampleRequest("held/0", [5, 6, 7], SamplingOptions(max_tokens=4)), held)
    assert entered.wait(120)
    assert engine.close(timeout_s=2) is False  # the thread is busy: close returns at its bound, saying so
    with pytest.raises(EngineUnavailableError):  # nothing is queued behind the close
        engine.wake()
    engine.abort(["held/0"])  # a cancelled stream's abort after close is a no-op, not an error
    release.set()
    assert engine.close(timeout_s=120) is True  # the thread finished: it shut vLLM down and ended
    assert [(r.request_id, r.finish_reason) for r in results] == [("held/0", FINISH_ERROR)]  # asleep: refused
    assert "asleep" in results[0].error

"""The engine-close scenario of test_engine_close.py, in a process of its own: vLLM's shutdown tears down
process-global state (its model-parallel groups), which the session's shared engine needs.

    python engine_close_script.py MODEL_DIR CACHE_DIR   # prints the outcomes as one JSON line
"""

from __future__ import annotations

import json
import sys
import threading

from services.rollout.engine import RolloutEngine
from services.rollout.engine_thread import EngineUnavailableError
from services.rollout.options import EngineOptions, SamplingOptions
from services.rollout.samples import SampleRequest


def main(model: str, cache: str) -> int:
    engine = RolloutEngine(EngineOptions(model=model, dtype="float32", tensor_parallel_size=1, max_model_len=256,
                                         max_num_seqs=8, num_threads=1, cpu_kv_cache_gib=1, gpu_memory_utilization=0.2,
                                         cache_root=cache))
    engine.sleep(1)  # the state the fuzzing leaves most often
    entered, release = threading.Event(), threading.Event()
    results = []

    def held(result) -> None:  # a consumer that does not return (callbacks run on the engine thread)
        entered.set()
        release.wait()
        results.append(result)

    engine.submit(SampleRequest("held/0", [5, 6, 7], SamplingOptions(max_tokens=4)), held)
    out: dict = {"entered": entered.wait(120)}
    out["first_close"] = engine.close(timeout_s=2)  # the thread is busy: close returns at its bound
    try:
        engine.wake()
        out["call_after_close"] = "ran"
    except EngineUnavailableError as e:
        out["call_after_close"] = f"refused: {e}"
    engine.abort(["held/0"])  # a cancelled stream's abort after close: a no-op, not an error
    release.set()
    out["second_close"] = engine.close(timeout_s=120)  # the thread shut vLLM down and ended
    out["results"] = [(r.request_id, r.finish_reason, r.error) for r in results]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

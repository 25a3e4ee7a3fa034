"""A LocalStack as `rlfabric up` runs it (reaper, supervisor), with light children only: a private Redis with
its append-only file and WORKERS reward workers (default 1) whose verifier pools have two processes each
(grandchildren of this script).

    python stack_script.py RUN_DIR sleep [WORKERS]  # print the pids as JSON, then wait to be killed
    python stack_script.py RUN_DIR watch [WORKERS]  # print the pids, then wait under the Supervisor; a fatal
                                                    # death exits 3
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from services.common.processes import Reaper, ServiceStartError
from services.launcher.stack import LocalStack
from services.launcher.supervision import Supervisor


def main(run_dir: Path, mode: str, workers: int) -> int:
    stack = LocalStack(run_dir, startup_timeout_s=120)
    reaper = Reaper.install()
    try:
        stack.redis_args()  # starts the private Redis
        assert stack.redis is not None
        reaper.add_pid(stack.redis.process.pid)
        stack.spawn_reward_workers(workers, 2)
        stack.wait_ready()
        print(json.dumps({"children": {p.name: p.pid for p in stack.processes}, "redis_pid": stack.redis.process.pid,
                          "redis_url": stack.redis_url}), flush=True)
        if mode == "sleep":
            time.sleep(600)
            return 0
        try:
            with Supervisor(stack):
                time.sleep(600)
        except ServiceStartError as e:
            print(f"error: {e}", flush=True)
            return 3
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1))

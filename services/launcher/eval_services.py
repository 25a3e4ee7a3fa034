"""The services `rlfabric eval` runs on: started for it (like `rlfabric up`), or found in a running Redis.

Started: a private Redis, one reward worker, one vLLM rollout replica serving the model, the custom
verifiers; all stopped at the end. Found (`--redis-url`): every rollout replica and reward worker registered
there; custom verifiers are registered with those workers (with the token of `--auth-token-file`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.client import make_channel
from services.common.deadlines import INFO_DEADLINE_S
from services.common.redis_store import Registry, connect
from services.common.service_kind import ServiceKind
from services.coordinator.reward_pool import RewardClientPool
from services.coordinator.weight_sync import Replica
from services.launcher.stack import Expected, LocalStack, ServiceStartError

# Sequences the eval's own replica batches at once (the value a replica without a config had before it took the
# schema's generate_config defaults).
EVAL_MAX_NUM_SEQS = 64


class EvalServices:
    """The rollout replicas and reward workers of one `rlfabric eval` (see module docstring)."""

    def __init__(self, run_dir: Path, *, redis_url: str | None, verifiers: Sequence[Any],
                 startup_timeout_s: float, auth_token: str | None = None) -> None:
        self.attach = redis_url is not None
        self.stack = LocalStack(run_dir, redis_url=redis_url, startup_timeout_s=startup_timeout_s,
                                verifiers=verifiers, auth_token=auth_token)
        self._channels: list[Any] = []
        self._pool: Any = None

    def _infos(self) -> list[Any]:
        infos = []
        for address in self.stack.endpoints(ServiceKind.ROLLOUT):
            with make_channel(address) as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                infos.append(stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=INFO_DEADLINE_S))
        if not infos:
            raise ServiceStartError(f"no rollout replica is registered in {self.stack.redis_url}")
        return infos

    def attached_model(self) -> str:
        """The model the found replicas serve (their tokenizer builds the prompts)."""
        return self._infos()[0].model

    def attached_max_model_len(self) -> int | None:
        """The shortest engine length of the found replicas; None when the replica is started here."""
        return min(int(i.max_model_len) for i in self._infos()) if self.attach else None

    def start(self, model: str | None, *, dtype: str, max_model_len: int) -> None:
        stack = self.stack
        url = stack.start_redis()
        if self.attach:
            stack.spawn_verifiers()
            stack.register_verifiers(stack.auth_token)
        else:
            print(f"starting services (logs in {stack.logs_dir})", file=stack.out, flush=True)
            stack.spawn_reward_workers(1, 1)
            stack.spawn_verifiers()
            # One engine on this machine, batching the eval's prompts (a replica without a config would take the
            # training config schema's defaults: tensor parallel 8, one sequence at a time).
            stack.spawn("rollout-0", ["rollout", "serve", "--model", str(model), "--address", "127.0.0.1:0",
                                      *stack.redis_args(), "--dtype", dtype, "--max-model-len", str(max_model_len),
                                      "--tensor-parallel-size", "1", "--max-num-seqs", str(EVAL_MAX_NUM_SEQS)],
                        Expected("rollout-0 (vLLM)", ServiceKind.ROLLOUT))
            stack.wait_ready()
        self._pool = RewardClientPool(Registry(connect(url)))

    def replicas(self) -> list[Any]:
        out = []
        for address in self.stack.endpoints(ServiceKind.ROLLOUT):
            channel = make_channel(address)
            self._channels.append(channel)
            out.append(Replica(address, rollout_pb2_grpc.RolloutStub(channel)))
        return out

    def score(self, requests: Iterator[Any]) -> Iterator[Any]:
        return self._pool.score(requests)

    def stop(self) -> None:
        for c in self._channels:
            c.close()
        self.stack.stop()

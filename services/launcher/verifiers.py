"""Custom verifiers for a local run: launch their servers, register them with the run's reward workers.

A custom verifier is a server of the public `rlfabric.v1.Verifier` service (see examples/verifiers/). `rlfabric
up` and `rlfabric eval` take it two ways:
- `--verifier NAME=HOST:PORT`: a server that already runs;
- `--verifier-command 'NAME=COMMAND ... {port} ...'`: a command the launcher starts (and stops with the run),
  `{port}` replaced by a free loopback port; its output goes to `logs/verifier-NAME.log`.
Registration goes through the reward workers' public `RegisterVerifier` RPC with the token the launcher gave
the workers it started, then waits until every worker lists the name (`ListVerifiers`), so the first
iteration never meets a worker that does not know it yet.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.processes import ServiceProcess, ServiceStartError, tail

PORT_PLACEHOLDER = "{port}"


@dataclass(frozen=True)
class CustomVerifier:
    """A verifier to register under `name`: at `endpoint`, or served by `command` (argv with `{port}`)."""

    name: str
    endpoint: str = ""
    command: tuple[str, ...] = ()


def parse_endpoint(value: str) -> CustomVerifier:
    """`NAME=HOST:PORT` -> CustomVerifier; ValueError naming the problem."""
    name, sep, endpoint = value.partition("=")
    host, colon, port = endpoint.rpartition(":")
    if not sep or not name or not colon or not host or not port.isdigit():
        raise ValueError(f"--verifier {value!r}: expected NAME=HOST:PORT, e.g. my_rule=127.0.0.1:50070")
    return CustomVerifier(name=name, endpoint=endpoint)


def parse_command(value: str) -> CustomVerifier:
    """`NAME=COMMAND` (COMMAND holding `{port}`) -> CustomVerifier; ValueError naming the problem."""
    name, sep, command = value.partition("=")
    argv = tuple(shlex.split(command)) if sep else ()
    if not name or not argv:
        raise ValueError(f"--verifier-command {value!r}: expected NAME=COMMAND, e.g. "
                         "'my_rule=python my_verifier.py --port {port}'")
    if not any(PORT_PLACEHOLDER in a for a in argv):
        raise ValueError(f"--verifier-command {value!r}: the command must contain {PORT_PLACEHOLDER}, where the "
                         "launcher puts the free port the server must listen on")
    return CustomVerifier(name=name, command=argv)


def launch(verifier: CustomVerifier, logs_dir: Path) -> tuple[ServiceProcess | None, CustomVerifier]:
    """Starts a command verifier on a free port; returns its process and the verifier with its endpoint."""
    if not verifier.command:
        return None, verifier
    from services.common.net import free_port

    port = free_port()
    argv = [a.replace(PORT_PLACEHOLDER, str(port)) for a in verifier.command]
    proc = ServiceProcess(f"verifier-{verifier.name}", [], logs_dir / f"verifier-{verifier.name}.log",
                          command=argv).start()
    return proc, CustomVerifier(verifier.name, endpoint=f"127.0.0.1:{port}", command=verifier.command)


def wait_serving(verifier: CustomVerifier, proc: ServiceProcess | None, timeout_s: float) -> None:
    """Blocks until a gRPC channel to the verifier is ready; raises ServiceStartError with its log otherwise."""
    import grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(verifier.endpoint) as channel:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=1.0)
                return
            except grpc.FutureTimeoutError:
                pass
            if proc is not None:
                proc.check()
            if time.monotonic() > deadline:
                log = f"; last lines of {proc.log_path}:\n{tail(proc.log_path)}" if proc else ""
                raise ServiceStartError(f"verifier {verifier.name!r} at {verifier.endpoint} not serving after "
                                        f"{timeout_s:.0f}s{log}")


def register(verifiers: Sequence[CustomVerifier], workers: Sequence[str], token: str | None,
             timeout_s: float = 60.0) -> None:
    """Registers each verifier through the first worker, then waits until every worker lists them all."""
    import grpc

    from rlfabric.v1 import reward_pb2, reward_pb2_grpc
    from services.common.client import make_channel
    from services.common.deadlines import DEFAULT_DEADLINE_S

    if not verifiers:
        return
    if not workers:
        raise ServiceStartError("no reward worker to register the custom verifiers with")
    channels = [make_channel(w, token=token) for w in workers]
    try:
        stubs = [reward_pb2_grpc.RewardStub(c) for c in channels]
        for v in verifiers:
            try:
                stubs[0].RegisterVerifier(reward_pb2.RegisterVerifierRequest(
                    name=v.name, version="1", endpoint=v.endpoint,
                    description=" ".join(v.command) if v.command else f"given as {v.endpoint}"),
                    timeout=DEFAULT_DEADLINE_S)
            except grpc.RpcError as e:
                raise ServiceStartError(f"registering verifier {v.name!r} at {v.endpoint} with reward worker "
                                        f"{workers[0]}: {e.code().name}: {e.details()}") from e
        wanted = {v.name for v in verifiers}
        deadline = time.monotonic() + timeout_s
        for worker, stub in zip(workers, stubs, strict=True):
            while not wanted <= {i.name for i in stub.ListVerifiers(reward_pb2.ListVerifiersRequest(),
                                                                   timeout=DEFAULT_DEADLINE_S).verifiers}:
                if time.monotonic() > deadline:
                    raise ServiceStartError(f"reward worker {worker} does not list {sorted(wanted)} after "
                                            f"{timeout_s:.0f}s")
                time.sleep(0.2)
    finally:
        for c in channels:
            c.close()

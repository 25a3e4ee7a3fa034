"""A tool server: host + servicer + gRPC server + Redis registration, started and stopped as one.

Each server registers itself as `rlfabric:members:tools:{instance_id}` (a leased `Registry` key, kept alive by
heartbeats) with metadata {"tools": [names], "metrics_port": port}; callers route a tool's calls to the members
listing it, so more servers (`rlfabric tools serve` again, anywhere) means more capacity, and a dead one drops
out within its lease. The same Redis holds the `rate_limit` slots the servers share (limits.py).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass

from rlfabric.v1 import tool_pb2_grpc
from services.common.config.tools import ToolConfigFile
from services.common.net import advertised_address
from services.common.redis_store import Registration, Registry, connect
from services.common.server import ServiceServer, ServiceSpec, create_server
from services.common.service_kind import ServiceKind
from services.common.stop_signal import wait_for_stop_signal
from services.tools.host import DEFAULT_MAX_RESULT_CHARS, ToolHost
from services.tools.limits import limiter_client
from services.tools.server import AUTH_METHODS, SERVICE_NAME, ToolServicer

logger = logging.getLogger(__name__)


@dataclass
class ToolWorkerOptions:
    """How to run one tool server (the flags of `rlfabric tools serve`)."""

    address: str = "127.0.0.1:0"
    redis_url: str | None = None
    auth_token: str | None = None
    insecure: bool = False  # without auth_token: Call open to every caller
    instance_id: str = ""
    lease_s: float = 10.0
    metrics_port: int | None = 0
    advertise_address: str | None = None
    advertise_interface: str | None = None
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS


class ToolWorker:
    """A running tool server; `stop()` deregisters, drains calls and withdraws queued ones."""

    def __init__(self, config: ToolConfigFile, options: ToolWorkerOptions) -> None:
        self.options = options
        self.instance_id = options.instance_id or f"tools-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if options.lease_s <= 0:
            raise ValueError(f"--lease-s must be > 0, got {options.lease_s}")
        self._redis = connect(options.redis_url) if options.redis_url else None
        limiter = limiter_client(options.redis_url) if options.redis_url else None
        self.host = ToolHost(config, limiter=limiter, server_id=self.instance_id,
                             max_result_chars=options.max_result_chars)
        # Handler threads: every call holds one while it waits for a worker, so room for each tool's workers
        # and as many waiting calls (those time out on their deadlines instead of queueing unseen in gRPC).
        handlers = min(4096, 2 * sum(t.max_concurrency for t in self.host.tools.values()) + 8)
        self.server: ServiceServer = create_server(
            [ServiceSpec(tool_pb2_grpc.add_ToolServicer_to_server, ToolServicer(self.host), SERVICE_NAME)],
            options.address, component="tools", metrics_port=options.metrics_port,
            # Without a token, Call still needs one (a random one nobody knows) unless insecure.
            auth_token=options.auth_token or (None if options.insecure else uuid.uuid4().hex),
            auth_methods=AUTH_METHODS, max_workers=handlers,
        )
        self.registration: Registration | None = None
        self._stopped = False

    @property
    def endpoint(self) -> str:
        return advertised_address(self.options, self.server.port)

    def start(self) -> ToolWorker:
        self.server.start()
        if self._redis is not None:
            self.registration = Registry(self._redis).register(
                ServiceKind.TOOLS, self.instance_id, self.endpoint, lease_s=self.options.lease_s,
                metadata={"tools": list(self.host.tools), "metrics_port": self.server.metrics_port},
            )
        else:
            logger.warning("tool server %s runs without --redis-url: no caller can find it in the registry, and "
                           "each tool's rate_limit holds within this server only", self.instance_id)
        logger.info("tool server %s serving %s on %s", self.instance_id, ", ".join(self.host.tools), self.endpoint)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Deregisters (callers stop routing here), lets calls finish for `grace_s`, withdraws queued ones."""
        if self._stopped:
            return
        self._stopped = True
        if self.registration is not None:
            self.registration.close()
        self.server.stop(grace_s)
        self.host.close()

    def serve_until_signal(self, drain_s: float) -> None:
        received = wait_for_stop_signal()
        logger.info("tool server %s received %s: draining (up to %.0f s)", self.instance_id, received.name, drain_s)
        self.stop(drain_s)

    def __enter__(self) -> ToolWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

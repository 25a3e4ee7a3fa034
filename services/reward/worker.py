"""A reward worker: pool + servicer + gRPC server + Redis registration, started and stopped as one.

Workers are independent: each registers itself as `ServiceKind.REWARD` in the Redis `Registry` with a
lease kept alive by heartbeats, and reads the remote-verifier registry from the same Redis. Start as
many as there are cores to spare (`rlfabric reward serve`); clients find them through Redis.
"""

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from services.common.net import advertised_address
from services.common.redis_store import Registration, Registry, connect
from services.common.server import ServiceServer, ServiceSpec, create_server
from services.common.service_kind import ServiceKind
from services.common.stop_signal import wait_for_stop_signal
from services.reward.endpoints import DEFAULT_ALLOW, EndpointPolicy, member_hosts
from services.reward.metrics import SCORES
from services.reward.pool import VerifierPool
from services.reward.remote import RemoteVerifiers
from services.reward.scoring import MAX_DEADLINE_S
from services.reward.server import AUTH_METHODS, SERVICE_NAME, RewardServicer, add_to_server
from services.reward.verifier_store import VerifierStore

logger = logging.getLogger(__name__)


@dataclass
class RewardWorkerOptions:
    """How to run one reward worker (the flags of `rlfabric reward serve`)."""

    address: str = "127.0.0.1:0"
    processes: int = 1
    redis_url: str | None = None
    auth_token: str | None = None
    insecure: bool = False  # without auth_token: RegisterVerifier/UnregisterVerifier open to every caller
    worker_id: str = ""
    deadline_s: float = 10.0
    verifier_allow: str = DEFAULT_ALLOW
    plugins: dict[str, str] = field(default_factory=dict)
    lease_s: float = 10.0
    metrics_port: int | None = 0
    advertise_address: str | None = None  # HOST[:PORT] registered instead of the bound address
    advertise_interface: str | None = None
    registry_poll_s: float = 1.0
    max_workers: int = 32


class RewardWorker:
    """A running reward worker; `stop()` deregisters, drains streams and ends the pool."""

    def __init__(self, options: RewardWorkerOptions) -> None:
        self.options = options
        self.worker_id = options.worker_id or f"reward-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if not 0 < options.deadline_s <= MAX_DEADLINE_S:
            raise ValueError(f"--deadline-s must be in (0, {MAX_DEADLINE_S:g}] seconds, got {options.deadline_s}")
        redis_client = connect(options.redis_url) if options.redis_url else None
        registry = Registry(redis_client) if redis_client is not None else None
        endpoints = EndpointPolicy.parse(options.verifier_allow, lambda: member_hosts(registry))
        self.pool = VerifierPool(options.processes, plugins=options.plugins)
        self.store = VerifierStore(redis_client) if redis_client is not None else None
        self.remote = RemoteVerifiers(self.store, endpoints=endpoints, local_names=frozenset(self.pool.names),
                                      poll_s=options.registry_poll_s)
        self.servicer = RewardServicer(
            self.pool, worker_id=self.worker_id, remote=self.remote, store=self.store, endpoints=endpoints,
            default_deadline_s=options.deadline_s,
        )
        self.server: ServiceServer = create_server(
            [ServiceSpec(add_to_server, self.servicer, SERVICE_NAME)],
            options.address, component="reward", metrics_port=options.metrics_port,
            # Without a token the privileged methods still need one (a random one nobody knows) unless insecure;
            # `reward serve` logs which (security.announce_auth).
            auth_token=options.auth_token or (None if options.insecure else uuid.uuid4().hex),
            auth_methods=AUTH_METHODS,
            max_workers=options.max_workers,
        )
        self.registration: Registration | None = None
        self._redis = redis_client
        self._stopped = False

    @property
    def endpoint(self) -> str:
        return advertised_address(self.options, self.server.port)

    def start(self) -> "RewardWorker":
        self.server.start()
        if self._redis is not None:
            self.registration = Registry(self._redis).register(
                ServiceKind.REWARD, self.worker_id, self.endpoint, lease_s=self.options.lease_s,
                metadata={"processes": self.pool.size, "metrics_port": self.server.metrics_port},
            )
        logger.info("reward worker %s serving on %s with %d pool processes", self.worker_id, self.endpoint,
                    self.pool.size)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Drains: deregisters (the coordinator's pool then sends nothing new and half-closes its stream),
        refuses new calls, lets open streams finish for up to `grace_s` (cancelled after: the pool re-sends
        what they held), then ends the verifier pool. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.registration is not None:
            self.registration.close()  # clients stop routing here first
        self.server.stop(grace_s)
        self.remote.close()
        self.pool.close()

    def serve_until_signal(self, drain_s: float) -> None:
        """Serves until SIGTERM/SIGINT, then `stop(drain_s)`: a worker removed at run time loses no sample."""
        received = wait_for_stop_signal()
        logger.info("reward worker %s received %s: draining (up to %.0f s)", self.worker_id, received.name, drain_s)
        started = time.monotonic()
        self.stop(drain_s)
        # One parseable line: what this worker scored in its life (a removed worker's /metrics goes with it).
        scored = sum(sample.value for metric in SCORES.collect() for sample in metric.samples
                     if sample.name.endswith("_total"))
        logger.warning("reward worker %s drained in %.1f s and deregistered; scored %d verifications",
                       self.worker_id, time.monotonic() - started, scored)

    def __enter__(self) -> "RewardWorker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

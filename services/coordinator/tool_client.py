"""Coordinator-side client of the tool servers: discovery in Redis, least-loaded routing, failover.

`ToolClient.call(name, arguments_json, deadline_s)` always returns a `ToolResult`, never raises: whatever goes
wrong (no server hosts the tool, a server is killed mid-call, the deadline passes) is a result with a status
and a text the model sees, so a failing tool costs its sample a tool error and never the run.
- Servers are the Redis `Registry` members of `ServiceKind.TOOLS` (`rlfabric:members:tools:{id}`, metadata
  {"tools": [names]}), re-read every `refresh_s`; `tools()` lists the hosted tools with their schemas (each
  server's `ListTools`, asked once), in the order of the first server's configuration.
- A call goes to the server hosting the tool with the fewest calls in flight from this client. A call that ends
  UNAVAILABLE (the server died or is stopping) goes to the next server while its deadline allows (tools are
  safe to run twice: tool.proto), and that server gets no calls for `quarantine_s`; any other failure is the
  call's result.
- Two servers that describe one tool differently: the first one's schema is the tool's (by instance id), and the
  other is not sent that tool's calls (logged once).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis

from rlfabric.v1 import tool_pb2, tool_pb2_grpc
from services.common.client import INHERIT, make_channel
from services.common.deadlines import LIST_TOOLS_DEADLINE_S
from services.common.redis_store import Member, Registry
from services.common.service_kind import ServiceKind

logger = logging.getLogger(__name__)

# Deadline of a call whose tool lists none (a server that did not answer ListTools yet).
FALLBACK_DEADLINE_S = 60.0
# Seconds past a call's own deadline the rpc may take (the server answers TIMEOUT at the call's deadline).
_RPC_SLACK_S = 2.0

STATUS_NAMES = {
    tool_pb2.TOOL_CALL_STATUS_OK: "OK",
    tool_pb2.TOOL_CALL_STATUS_TOOL_ERROR: "TOOL_ERROR",
    tool_pb2.TOOL_CALL_STATUS_TIMEOUT: "TIMEOUT",
    tool_pb2.TOOL_CALL_STATUS_INVALID_ARGUMENTS: "INVALID_ARGUMENTS",
}


@dataclass(frozen=True)
class ToolSpec:
    """A tool some server hosts: what the chat template needs (`schema`) and how long a call may take."""

    name: str
    description: str
    schema: dict[str, Any]  # the OpenAI function-tool object, for the chat template's `tools`
    schema_json: str
    default_deadline_s: float


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call. `status`: OK, TOOL_ERROR, TIMEOUT or INVALID_ARGUMENTS; `text` is for the model,
    `error` for logs and metrics (empty when OK); `server_id` is empty when no server answered."""

    name: str
    status: str
    text: str
    error: str = ""
    latency_s: float = 0.0
    server_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"


@dataclass
class _Server:
    instance_id: str
    endpoint: str
    tools: tuple[str, ...]
    stub: tool_pb2_grpc.ToolStub
    channel: grpc.Channel
    infos: dict[str, tool_pb2.ToolInfo] | None = None
    in_flight: int = 0
    quarantined_until: float = 0.0
    refused: set[str] = field(default_factory=set)  # tools it describes unlike the first server


class ToolClient:
    """Routes tool calls to the tool servers registered in `registry`.

    Args:
        registry: the run's membership registry.
        refresh_s: how often the member list is re-read.
        quarantine_s: how long a server that answered UNAVAILABLE gets no calls.
        token: the token sent to the servers (default: this process's, services/common/credentials.py).
    """

    def __init__(self, registry: Registry, *, refresh_s: float = 2.0, quarantine_s: float = 5.0,
                 token: str | None = INHERIT) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._quarantine_s = quarantine_s
        self._token = token
        self._servers: dict[str, _Server] = {}
        self._specs: dict[str, ToolSpec] = {}
        self._lock = threading.Lock()
        self._refreshed_at = -float("inf")

    def tools(self) -> list[ToolSpec]:
        """Every tool some live server hosts, with its schema."""
        self._refresh()
        return list(self._specs.values())

    def call(self, name: str, arguments_json: str, *, deadline_s: float = 0.0, call_id: str = "") -> ToolResult:
        """Runs one call on some server hosting `name`; never raises (see the module doc)."""
        started = time.monotonic()
        self._refresh()
        spec = self._specs.get(name)
        budget = deadline_s or (spec.default_deadline_s if spec else FALLBACK_DEADLINE_S)
        ends = started + budget
        tried: set[str] = set()
        last_error = ""
        while True:
            server = self._pick(name, tried)
            if server is None:
                break
            tried.add(server.instance_id)
            left = ends - time.monotonic()
            if left <= 0:
                return ToolResult(name, "TIMEOUT", f"Error: the tool {name} did not answer within {budget:g} s",
                                  "deadline passed before a server answered", time.monotonic() - started)
            request = tool_pb2.ToolCallRequest(call_id=call_id, name=name, arguments_json=arguments_json,
                                               deadline_s=left)
            with self._lock:
                server.in_flight += 1
            try:
                reply = server.stub.Call(request, timeout=left + _RPC_SLACK_S)
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                last_error = f"{server.instance_id}: {code.name}: {details}"
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                    logger.warning("tool call %s %s: server %s %s (%s); trying another", call_id or "-", name,
                                   server.instance_id, code.name, details)
                    with self._lock:
                        server.quarantined_until = time.monotonic() + self._quarantine_s
                    continue
                status = "TIMEOUT" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "TOOL_ERROR"
                return ToolResult(name, status, f"Error: the tool {name} failed", last_error,
                                  time.monotonic() - started, server.instance_id)
            finally:
                with self._lock:
                    server.in_flight -= 1
            return ToolResult(name, STATUS_NAMES.get(reply.status, "TOOL_ERROR"), reply.text, reply.error,
                              time.monotonic() - started, reply.server_id)
        if spec is None and not last_error:
            known = ", ".join(self._specs) or "none"
            return ToolResult(name, "TOOL_ERROR", f"Error: there is no tool named {name!r}; the tools are: {known}",
                              "unknown tool", time.monotonic() - started)
        return ToolResult(name, "TOOL_ERROR", f"Error: the tool {name} is unavailable right now",
                          last_error or "no live server hosts it", time.monotonic() - started)

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.channel.close()

    def _pick(self, name: str, tried: set[str]) -> _Server | None:
        now = time.monotonic()
        with self._lock:
            hosts = [s for s in self._servers.values()
                     if name in s.tools and name not in s.refused and s.instance_id not in tried]
            live = [s for s in hosts if s.quarantined_until <= now] or hosts  # all quarantined: try them anyway
            if not live:
                return None
            least = min(s.in_flight for s in live)
            return random.choice([s for s in live if s.in_flight == least])

    def _refresh(self) -> None:
        if time.monotonic() - self._refreshed_at < self._refresh_s:
            return
        self._refreshed_at = time.monotonic()
        try:
            members = self._registry.members(ServiceKind.TOOLS)
        except redis.RedisError as e:  # Redis down: keep routing to the servers last seen
            logger.warning("tool servers: cannot read the registry (%s); using the %d last seen", e,
                           len(self._servers))
            return
        current = {m.instance_id: m for m in members}
        with self._lock:
            for gone in set(self._servers) - set(current):
                self._servers.pop(gone).channel.close()
            for member in current.values():
                known = self._servers.get(member.instance_id)
                if known is None or known.endpoint != member.endpoint:
                    if known is not None:
                        known.channel.close()
                    self._servers[member.instance_id] = self._connect(member)
        self._describe()

    def _connect(self, member: Member) -> _Server:
        names = member.metadata.get("tools")
        tools = tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()
        channel = make_channel(member.endpoint, token=self._token)
        return _Server(member.instance_id, member.endpoint, tools, tool_pb2_grpc.ToolStub(channel), channel)

    def _describe(self) -> None:
        """Asks new servers for their tools' schemas and rebuilds the tool list."""
        with self._lock:
            servers = sorted(self._servers.values(), key=lambda s: s.instance_id)
        for server in servers:
            if server.infos is None:
                try:
                    reply = server.stub.ListTools(tool_pb2.ListToolsRequest(), timeout=LIST_TOOLS_DEADLINE_S)
                    server.infos = {info.name: info for info in reply.tools}
                except grpc.RpcError as e:
                    logger.warning("tool server %s at %s: ListTools failed: %s", server.instance_id, server.endpoint,
                                   e.code().name)
        specs: dict[str, ToolSpec] = {}
        for server in servers:
            for info in (server.infos or {}).values():
                if info.name not in server.tools:
                    continue
                first = specs.get(info.name)
                if first is None:
                    specs[info.name] = ToolSpec(info.name, info.description, json.loads(info.schema_json),
                                                info.schema_json, info.default_deadline_s)
                elif first.schema_json != info.schema_json and info.name not in server.refused:
                    server.refused.add(info.name)
                    logger.warning("tool server %s describes tool %s unlike another server; it gets none of its "
                                   "calls", server.instance_id, info.name)
        self._specs = specs

"""The tools of one server and how a call runs: arguments checked, a worker taken, a deadline kept. No gRPC here.

A call goes: parse `arguments_json` and check it against the tool's schema (INVALID_ARGUMENTS for the model
otherwise) -> wait for one of the tool's `num_workers` threads -> take a `rate_limit` slot (limits.py) -> run
(code_interpreter.py, search.py) -> cap the text. The caller waits at most the call's deadline, whatever the
tool does: past it the answer is TIMEOUT, and a call still queued is withdrawn. A tool that raises answers
TOOL_ERROR; nothing a tool or its backend does ends the server.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError
from dataclasses import dataclass

import redis

from services.common.config.tools import ToolConfigFile, ToolEntry
from services.tools import metrics
from services.tools.arguments import ArgumentsError, check_arguments, parse_arguments
from services.tools.code_interpreter import CodeInterpreter
from services.tools.limits import SlotLimit
from services.tools.outcome import Deadline, Outcome, Status
from services.tools.search import Search

logger = logging.getLogger(__name__)

MAX_DEADLINE_S = 3600.0
DEFAULT_MAX_RESULT_CHARS = 65_536


class UnknownToolError(KeyError):
    """No tool of that name is hosted here; the message lists the hosted ones."""


@dataclass(frozen=True)
class CallResult:
    """A finished call: its outcome and wall seconds (waiting for a worker included)."""

    status: Status
    text: str
    error: str
    latency_s: float


class HostedTool:
    """One tool of the YAML with its runner, its workers and its cross-server slot limit."""

    def __init__(self, entry: ToolEntry, limiter: redis.Redis | None) -> None:
        self.entry = entry
        config = entry.config
        if entry.tool_class.kind == "code_interpreter":
            self.runner: CodeInterpreter | Search = CodeInterpreter(config, retool=entry.tool_class.retool_code)
        else:
            self.runner = Search(config)
        self.workers = ThreadPoolExecutor(max_workers=config.num_workers, thread_name_prefix=f"tool-{entry.name}")
        self.limit = SlotLimit(entry.name, config.rate_limit, limiter) if config.enable_global_rate_limit else None
        self.schema_json = json.dumps(entry.schema, ensure_ascii=False)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def max_concurrency(self) -> int:
        return self.entry.config.num_workers

    @property
    def default_deadline_s(self) -> float:
        return self.runner.default_deadline_s


class ToolHost:
    """The tools of one tool YAML, callable by name from any thread.

    Args:
        config: the loaded tool YAML.
        limiter: Redis for the `rate_limit` shared across servers (limits.limiter_client); None: per process.
        server_id: this server's id (part of each call's slot holder name, for debugging Redis).
        max_result_chars: longest text answered; longer output is cut, saying so.
    """

    def __init__(self, config: ToolConfigFile, *, limiter: redis.Redis | None = None, server_id: str = "",
                 max_result_chars: int = DEFAULT_MAX_RESULT_CHARS) -> None:
        if max_result_chars < 1:
            raise ValueError(f"--max-result-chars must be >= 1, got {max_result_chars}")
        self.tools = {entry.name: HostedTool(entry, limiter) for entry in config.tools}
        self.server_id = server_id or uuid.uuid4().hex[:8]
        self.max_result_chars = max_result_chars

    def call(self, name: str, arguments_json: str, deadline_s: float = 0.0, call_id: str = "") -> CallResult:
        """Runs one call; answers within its deadline (`deadline_s`, 0: the tool's default).

        Raises:
            UnknownToolError: `name` is not hosted here.
        """
        started = time.monotonic()
        tool = self.tools.get(name)
        if tool is None:
            raise UnknownToolError(f"no tool named {name!r} here; hosted: {', '.join(self.tools) or 'none'}")
        deadline = Deadline(min(deadline_s or tool.default_deadline_s, MAX_DEADLINE_S))
        metrics.IN_FLIGHT.labels(name).inc()
        try:
            outcome = self._call(tool, arguments_json, deadline, call_id)
        finally:
            metrics.IN_FLIGHT.labels(name).dec()
        text = outcome.text
        if len(text) > self.max_result_chars:
            text = (f"{text[:self.max_result_chars]}\n...(output cut at {self.max_result_chars} characters of "
                    f"{len(outcome.text)})")
        latency = time.monotonic() - started
        metrics.record_call(name, outcome.status.value, latency)
        if outcome.status is not Status.OK:
            logger.info("tool call %s %s: %s (%s) after %.2f s", call_id or "-", name, outcome.status.value,
                        outcome.error, latency)
        return CallResult(outcome.status, text, outcome.error, latency)

    def _call(self, tool: HostedTool, arguments_json: str, deadline: Deadline, call_id: str) -> Outcome:
        try:
            arguments = parse_arguments(arguments_json)
            check_arguments(arguments, tool.entry.parameters)
        except ArgumentsError as e:
            return Outcome(Status.INVALID_ARGUMENTS, f"Error: {e}", str(e))
        holder = f"{self.server_id}:{call_id}:{uuid.uuid4().hex[:8]}"
        future = tool.workers.submit(self._run, tool, arguments, deadline, holder)
        try:
            return future.result(timeout=deadline.remaining())
        except FuturesTimeoutError:
            if future.cancel():
                return Outcome(Status.TIMEOUT, f"Error: the tool was busy; no worker was free within "
                                               f"{deadline.seconds:g} s", "no free worker before the deadline")
            return Outcome(Status.TIMEOUT, f"Error: the tool did not finish within {deadline.seconds:g} s",
                           "deadline passed while running")

    @staticmethod
    def _run(tool: HostedTool, arguments: dict, deadline: Deadline, holder: str) -> Outcome:
        metrics.RUNNING.labels(tool.name).inc()
        try:
            if tool.limit is not None and not tool.limit.acquire(holder, deadline):
                return Outcome(Status.TIMEOUT, "Error: the tool was busy; no slot was free before the deadline",
                               f"rate_limit {tool.limit.limit} reached until the deadline")
            try:
                return tool.runner.run(arguments, deadline)
            finally:
                if tool.limit is not None:
                    tool.limit.release(holder)
        except Exception as e:  # any failure of a tool is that call's answer, never the server's end
            logger.exception("tool %s failed", tool.name)
            return Outcome(Status.TOOL_ERROR, "Error: the tool failed", f"internal error: {type(e).__name__}: {e}")
        finally:
            metrics.RUNNING.labels(tool.name).dec()

    def close(self) -> None:
        """Withdraws queued calls; running ones end on their own deadlines."""
        for tool in self.tools.values():
            tool.workers.shutdown(wait=False, cancel_futures=True)

"""The coordinator's tool client against real tool servers found in real Redis: discovery, schemas, routing,
and a server killed mid-run costing its calls a tool error (or nothing, when another server hosts the tool)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from services.common.config.tools import load_tool_config
from services.common.redis_store import Registry, connect
from services.coordinator.tool_client import ToolClient
from services.tools.worker import ToolWorker, ToolWorkerOptions
from tests.tools.conftest import write_tool_yaml


@pytest.fixture
def prefix_registry(redis_url):
    """A registry of its own (a key prefix per test), so other tests' servers are not seen."""
    registry = Registry(connect(redis_url), prefix=f"t{time.monotonic_ns()}")
    return registry


def _start(path, registry, instance_id):
    worker = ToolWorker(load_tool_config(path), ToolWorkerOptions(insecure=True, metrics_port=None,
                                                                  instance_id=instance_id))
    worker.start()
    # Registered as ToolWorker does with --redis-url, under this test's prefix.
    worker.registration = registry.register("tools", instance_id, worker.endpoint, lease_s=5,
                                            metadata={"tools": list(worker.host.tools)})
    return worker


def test_discovery_schemas_and_calls(tmp_path, sandbox, retrieval, redis_url, prefix_registry):
    code = write_tool_yaml(tmp_path / "code.yaml", sandbox_url=sandbox.url)
    search = write_tool_yaml(tmp_path / "search.yaml", retrieval_url=retrieval.url)
    a = _start(code, prefix_registry, "a")
    b = _start(search, prefix_registry, "b")
    client = ToolClient(prefix_registry, token=None)
    try:
        specs = client.tools()
        assert [s.name for s in specs] == ["code_interpreter", "search"]
        assert specs[0].schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
        assert specs[0].default_deadline_s == 70.0
        result = client.call("code_interpreter", json.dumps({"code": "print(6 * 7)"}), call_id="s0/0")
        assert (result.status, result.text, result.server_id, result.ok) == ("OK", "42\n", "a", True)
        result = client.call("search", json.dumps({"query_list": ["Berlin"]}))
        assert result.ok and result.server_id == "b" and "Berlin is the capital" in result.text
        result = client.call("calculator", "{}")
        assert (result.status, result.error) == ("TOOL_ERROR", "unknown tool")
        assert result.text == "Error: there is no tool named 'calculator'; the tools are: code_interpreter, search"
        result = client.call("code_interpreter", '{"code": 1}')
        assert result.status == "INVALID_ARGUMENTS" and result.server_id == "a"
    finally:
        client.close()
        a.stop(0.2)
        b.stop(0.2)


def test_a_killed_server_costs_a_tool_error_and_the_other_takes_over(tmp_path, sandbox, redis_url, prefix_registry):
    path = write_tool_yaml(tmp_path / "code.yaml", sandbox_url=sandbox.url)
    a = _start(path, prefix_registry, "a")
    b = _start(path, prefix_registry, "b")
    client = ToolClient(prefix_registry, token=None, refresh_s=60)  # the client must not learn of it from Redis
    try:
        assert [s.name for s in client.tools()] == ["code_interpreter"]
        results = []
        slow = threading.Thread(target=lambda: results.append(client.call(
            "code_interpreter", json.dumps({"code": "import time; time.sleep(1); print('late')"}), deadline_s=10)))
        slow.start()
        time.sleep(0.3)  # the slow call is in flight on one server; kill that one mid-call
        busy_id = next(i for i, s in client._servers.items() if s.in_flight)
        busy = a if busy_id == "a" else b
        busy.server.server.stop(0)  # the process's gRPC server gone: what a SIGKILL does to its calls
        slow.join()
        (lost,) = results
        # UNAVAILABLE: re-sent to the other server, which answers
        assert lost.status == "OK" and lost.text == "late\n" and lost.server_id != busy.instance_id
        # later calls avoid the dead server (quarantined), and all get an answer
        for _ in range(4):
            result = client.call("code_interpreter", json.dumps({"code": "print(1)"}), deadline_s=5)
            assert result.ok and result.server_id != busy.instance_id
        (b if busy is a else a).server.server.stop(0)
        result = client.call("code_interpreter", json.dumps({"code": "print(1)"}), deadline_s=2)
        assert result.status == "TOOL_ERROR" and result.text == "Error: the tool code_interpreter is unavailable right now"
        assert "UNAVAILABLE" in result.error
    finally:
        client.close()
        a.stop(0.2)
        b.stop(0.2)

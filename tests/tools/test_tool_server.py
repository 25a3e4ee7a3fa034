"""The tool server over real gRPC on a free port: upstream's tools against a SandboxFusion stand-in and the real
BM25 retrieval server; every failure is an answer with a status, and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.v1 import tool_pb2, tool_pb2_grpc
from services.common.client import auth_metadata
from services.common.config.tools import load_tool_config
from services.common.redis_store import Registry, connect
from services.tools.worker import ToolWorker, ToolWorkerOptions
from tests.tools.conftest import write_tool_yaml

OK, TOOL_ERROR = tool_pb2.TOOL_CALL_STATUS_OK, tool_pb2.TOOL_CALL_STATUS_TOOL_ERROR
TIMEOUT, INVALID = tool_pb2.TOOL_CALL_STATUS_TIMEOUT, tool_pb2.TOOL_CALL_STATUS_INVALID_ARGUMENTS


@contextmanager
def serving(yaml_path: Path, **options):
    options.setdefault("insecure", True)
    options.setdefault("metrics_port", None)  # the Prometheus endpoint takes 0.5 s to stop; one test checks it
    worker = ToolWorker(load_tool_config(yaml_path), ToolWorkerOptions(**options)).start()
    channel = grpc.insecure_channel(worker.endpoint)
    try:
        yield worker, tool_pb2_grpc.ToolStub(channel)
    finally:
        channel.close()
        worker.stop(grace_s=0.5)


def call(stub, name: str, arguments, deadline_s: float = 0.0, **kw) -> tool_pb2.ToolCallResponse:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return stub.Call(tool_pb2.ToolCallRequest(call_id="t", name=name, arguments_json=text, deadline_s=deadline_s),
                     timeout=deadline_s + 5 if deadline_s else 100, **kw)


@pytest.fixture
def both(tmp_path, sandbox, retrieval):
    with serving(write_tool_yaml(tmp_path / "tools.yaml", sandbox_url=sandbox.url, retrieval_url=retrieval.url,
                                 search={"topk": 1})) as served:
        yield served


def test_list_tools_shows_upstream_schemas(both):
    worker, stub = both
    reply = stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5)
    assert reply.server_id == worker.instance_id
    code, search = reply.tools
    assert (code.name, code.implementation, code.max_concurrency, code.default_deadline_s) == (
        "code_interpreter", "mindspeed_rl.tools.retool.ReTool", 128, 70.0)  # 2 x default_timeout 30 + 10
    assert json.loads(code.schema_json)["function"]["parameters"]["required"] == ["code"]
    assert (search.name, search.max_concurrency, search.default_deadline_s) == ("search", 120, 40.0)
    assert "item" not in json.loads(search.schema_json)["function"]["parameters"]["properties"]["query_list"]


def test_code_runs_in_the_sandbox_with_upstreams_request(both, sandbox):
    _, stub = both
    reply = call(stub, "code_interpreter", {"code": "```python\nx = 6\nx * 7\n```"})
    assert (reply.status, reply.text, reply.error, reply.call_id) == (OK, "42\n", "", "t")  # ReTool prints the last line
    assert reply.latency_s > 0
    (request,) = sandbox.requests
    assert request["code"] == "x = 6\nprint(x * 7)"
    assert (request["language"], request["memory_limit_MB"], request["stdin"], request["files"],
            request["fetch_files"]) == ("python", 1024, None, {}, [])
    assert request["run_timeout"] == request["compile_timeout"] == 30  # default_timeout, within the 70 s deadline


def test_code_that_raises_is_an_answer(both):
    _, stub = both
    reply = call(stub, "code_interpreter", {"code": "print('before')\n1 / 0"})
    assert reply.status == OK
    assert reply.text.startswith("before\n") and "ZeroDivisionError: division by zero" in reply.text


@pytest.mark.parametrize(("arguments", "text"), [
    ({"code": 5}, "Error: argument 'code' must be a string, got number"),
    ({}, "Error: missing required argument 'code'"),
    ("[1, 2]", "Error: arguments must be a JSON object, got list"),
    ("{'code': 1}", "Error: arguments are not valid JSON (Expecting property name enclosed in double quotes at "
                    "line 1 column 2)"),
    ({"code": "1", "language": "cobol"}, "Error: unsupported language 'cobol'"),
    ({"code": "1", "timeout": -2}, "Error: argument 'timeout' must be a positive number of seconds, got -2"),
])
def test_invalid_arguments_are_answered_for_the_model(both, sandbox, arguments, text):
    _, stub = both
    reply = call(stub, "code_interpreter", arguments)
    assert reply.status == INVALID
    assert reply.text.startswith(text)
    assert sandbox.requests == []  # nothing reached the sandbox


def test_request_errors_are_status_codes(both):
    _, stub = both
    with pytest.raises(grpc.RpcError) as info:
        call(stub, "calculator", {})
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "hosted: code_interpreter, search" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Call(tool_pb2.ToolCallRequest(name="search", arguments_json="{}", deadline_s=float("nan")), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deadline_s" in info.value.details()


@pytest.mark.parametrize(("mode", "error"), [
    ("garbage", "sandbox bad_response: answer is not JSON"),
    ("error", "sandbox error: runner crashed"),
])
def test_sandbox_failures_are_tool_errors_and_the_server_keeps_serving(both, sandbox, mode, error):
    _, stub = both
    sandbox.mode = mode
    reply = call(stub, "code_interpreter", {"code": "print(1)"})
    assert reply.status == TOOL_ERROR and reply.error.startswith(error), reply.error
    assert reply.text.startswith("Error: the code sandbox failed")
    sandbox.mode = "run"
    assert call(stub, "code_interpreter", {"code": "print(1)"}).text == "1\n"


def test_an_unreachable_sandbox_is_a_tool_error(tmp_path, sandbox):
    url = sandbox.url
    sandbox.close()
    with serving(write_tool_yaml(tmp_path / "t.yaml", sandbox_url=url)) as (_, stub):
        reply = call(stub, "code_interpreter", {"code": "print(1)"})
    assert reply.status == TOOL_ERROR and reply.error.startswith("sandbox unreachable"), reply.error


def test_gateway_timeouts_are_retried_within_the_deadline(both, sandbox):
    _, stub = both
    sandbox.mode = "504"
    started = time.monotonic()
    reply = call(stub, "code_interpreter", {"code": "print(1)"}, deadline_s=2.5)
    # attempt 1 -> 504, 1 s pause, attempt 2 -> 504; a third would need a 2 s pause: not within the deadline
    assert len(sandbox.requests) == 2
    assert reply.status == TOOL_ERROR and "HTTP 504" in reply.error
    assert 1.0 <= time.monotonic() - started < 2.5


def test_code_running_too_long_is_a_timeout_with_its_partial_output(both, sandbox):
    _, stub = both
    reply = call(stub, "code_interpreter",
                 {"code": "import sys, time\nprint('started', flush=True)\ntime.sleep(5)", "timeout": 0.5})
    assert reply.status == TIMEOUT
    assert reply.text == "started\nError: execution timed out after 0.5 s"
    assert sandbox.requests[0]["run_timeout"] == 0.5  # the call's `timeout` argument, as upstream


def test_a_hung_sandbox_costs_one_deadline(both, sandbox):
    _, stub = both
    sandbox.mode, sandbox.hang_s = "hang", 3.0
    started = time.monotonic()
    reply = call(stub, "code_interpreter", {"code": "print(1)"}, deadline_s=0.8)
    assert reply.status == TIMEOUT
    assert time.monotonic() - started < 1.3
    assert 0.2 < sandbox.requests[0]["run_timeout"] <= 0.3  # what the deadline left, less the exchange's margin


def test_num_workers_bounds_the_calls_in_flight(tmp_path, sandbox):
    path = write_tool_yaml(tmp_path / "t.yaml", sandbox_url=sandbox.url,
                           code={"num_workers": 1, "enable_global_rate_limit": False})
    with serving(path) as (_, stub):
        replies = []
        threads = [threading.Thread(target=lambda: replies.append(
            call(stub, "code_interpreter", {"code": "import time; time.sleep(0.3); print('done')"}, deadline_s=5)))
            for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.1)
        late = call(stub, "code_interpreter", {"code": "print(1)"}, deadline_s=0.2)  # both workers' turn first
        for t in threads:
            t.join()
    assert [r.text for r in replies] == ["done\n", "done\n"]
    assert sandbox.max_running == 1
    assert late.status == TIMEOUT and late.text.startswith("Error: the tool was busy; no worker was free")


def test_search_answers_as_upstream(both):
    _, stub = both
    reply = call(stub, "search", {"query_list": ["capital of France", "river Spree"]})
    assert reply.status == OK
    assert json.loads(reply.text) == {"result": "Doc 1 (Title: \"Paris\")\nParis is the capital and largest city "
                                                "of France.\n---\nDoc 1 (Title: \"Berlin\")\nBerlin is the capital "
                                                "of Germany, on the river Spree."}
    reply = call(stub, "search", {"query_list": []})
    assert reply.status == INVALID
    assert json.loads(reply.text) == {"result": "Error: 'query_list' is missing, empty, or not a list in parameters."}
    reply = call(stub, "search", {"query_list": ["zzz"]})
    assert json.loads(reply.text) == {"result": ""}  # a query without hits: an empty block, as upstream


def test_search_without_its_server_is_a_tool_error(tmp_path, retrieval):
    url = retrieval.url
    retrieval.stop()
    with serving(write_tool_yaml(tmp_path / "t.yaml", retrieval_url=url)) as (_, stub):
        reply = call(stub, "search", {"query_list": ["x"]}, deadline_s=0.5)
    assert reply.status == TOOL_ERROR
    assert json.loads(reply.text)["result"].startswith("Search error: cannot reach")


def test_long_output_is_cut_saying_so(tmp_path, sandbox):
    with serving(write_tool_yaml(tmp_path / "t.yaml", sandbox_url=sandbox.url), max_result_chars=100) as (_, stub):
        reply = call(stub, "code_interpreter", {"code": "print('x' * 1000)"})
    assert reply.status == OK
    assert reply.text == "x" * 100 + "\n...(output cut at 100 characters of 1001)"


def test_call_needs_the_token_list_does_not(tmp_path, sandbox):
    path = write_tool_yaml(tmp_path / "t.yaml", sandbox_url=sandbox.url)
    with serving(path, insecure=False, auth_token="s3cret", metrics_port=0) as (worker, stub):
        assert [t.name for t in stub.ListTools(tool_pb2.ListToolsRequest(), timeout=5).tools] == ["code_interpreter"]
        with pytest.raises(grpc.RpcError) as info:
            call(stub, "code_interpreter", {"code": "print(1)"})
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert call(stub, "code_interpreter", {"code": "print(1)"}, metadata=auth_metadata("s3cret")).text == "1\n"
        with grpc.insecure_channel(worker.endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="rlfabric.v1.Tool"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.server.metrics_port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    assert 'rlfabric_tool_calls_total{status="ok",tool="code_interpreter"}' in metrics


def test_servers_register_and_share_rate_limit_through_redis(tmp_path, sandbox, redis_url):
    path = write_tool_yaml(tmp_path / "t.yaml", sandbox_url=sandbox.url, code={"num_workers": 4, "rate_limit": 1})
    registry = Registry(connect(redis_url))
    with serving(path, redis_url=redis_url, instance_id="tools-a") as (a, stub_a), \
            serving(path, redis_url=redis_url, instance_id="tools-b") as (b, stub_b):
        members = {m.instance_id: m for m in registry.members("tools")}
        assert members["tools-a"].endpoint == a.endpoint and members["tools-b"].endpoint == b.endpoint
        assert members["tools-a"].metadata["tools"] == ["code_interpreter"]
        replies = []
        threads = [threading.Thread(target=lambda s=s: replies.append(
            call(s, "code_interpreter", {"code": "import time; time.sleep(0.3); print('ok')"}, deadline_s=5)))
            for s in (stub_a, stub_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.text for r in replies] == ["ok\n", "ok\n"]
        assert sandbox.max_running == 1  # one slot across both servers
        assert {r.server_id for r in replies} == {"tools-a", "tools-b"}
    assert not [m for m in registry.members("tools") if m.instance_id in ("tools-a", "tools-b")]  # deregistered

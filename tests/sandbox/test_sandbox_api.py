"""The /run_code API against a real server: SandboxFusion's fields and statuses, files, stdin, refusals."""

from __future__ import annotations

import base64
import json


def test_normal_code_returns_stdout_and_return_code(client):
    body = client.run("import sys\nprint('hello', 6 * 7)\nprint('note', file=sys.stderr)\nprint(sys.argv[0])")
    assert set(body) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert body["status"] == "Success" and body["message"] == "" and body["compile_result"] is None
    result = body["run_result"]
    assert set(result) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert result["status"] == "Finished" and result["return_code"] == 0
    assert result["stdout"] == "hello 42\n/sandbox/main.py\n" and result["stderr"] == "note\n"
    assert 0 < result["execution_time"] < 10


def test_exception_is_failed_with_traceback_on_stderr(client):
    body = client.run("def f():\n    raise ValueError('boom')\nf()")
    assert body["status"] == "Failed" and body["message"] == ""
    result = body["run_result"]
    assert result["status"] == "Finished" and result["return_code"] == 1 and result["stdout"] == ""
    assert result["stderr"].startswith("Traceback (most recent call last):")
    assert 'File "/sandbox/main.py", line 2, in f' in result["stderr"]
    assert result["stderr"].endswith("ValueError: boom\n")


def test_exit_code_and_stdin(client):
    body = client.run("import sys\ndata = sys.stdin.read()\nprint(data.upper(), end='')\nsys.exit(3)",
                      stdin="abc\ndef\n")
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 3
    assert body["run_result"]["stdout"] == "ABC\nDEF\n"


def test_files_in_and_fetch_files_out(client):
    body = client.run(
        "import json, os\nrows = json.load(open('data/in.json'))\nopen('out.txt', 'w').write(str(sum(rows)))\n"
        "os.symlink('/etc/ld.so.cache', 'link')\nprint(os.getcwd())",
        files={"data/in.json": base64.b64encode(json.dumps([1, 2, 3]).encode()).decode(), "skipped.txt": None},
        fetch_files=["out.txt", "missing.txt", "link", "data/in.json"])
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "/sandbox\n"
    # A missing file is left out, as upstream; so is a link leading out of the run's folder.
    assert set(body["files"]) == {"out.txt", "data/in.json"}
    assert base64.b64decode(body["files"]["out.txt"]) == b"6"


def test_the_runtime_has_the_venvs_packages(client):
    # importing sympy takes seconds on a loaded 2-core machine: the test server's largest run_timeout (10 s)
    body = client.run("import numpy, sympy\nprint(int(numpy.arange(5).sum()), sympy.factorint(360))", run_timeout=10)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "10 {2: 3, 3: 2, 5: 1}\n"


def test_unsupported_language_and_over_limit_requests_are_sandbox_errors(client):
    body = client.run("int main() { return 0; }", language="cpp")
    assert body["status"] == "SandboxError" and body["run_result"] is None
    assert body["message"] == "language 'cpp' is not supported by this sandbox; it runs python"
    body = client.run("print(1)", run_timeout=11)
    assert body["status"] == "SandboxError"
    assert body["message"] == "run_timeout 11 s is over this server's limit of 10 s (--max-run-timeout-s)"
    body = client.run("print(1)", memory_limit_MB=2048)
    assert body["message"] == "memory_limit_MB 2048 is over this server's limit of 1024 MB (--max-memory-mb)"


def test_malformed_requests_are_422_naming_the_field(client):
    cases = [
        # (body, the message's start)
        ({"language": "python"}, "field 'code' is required"),
        ({"code": "1", "language": "klingon"}, "field 'language': 'klingon' is not a SandboxFusion language"),
        ({"code": "1", "language": "python", "timeout": 3}, "unknown field(s) 'timeout'; /run_code takes code,"),
        ({"code": "1", "language": "python", "run_timeout": 0}, "field 'run_timeout' must be a positive number"),
        ({"code": "1", "language": "python", "memory_limit_MB": 0}, "field 'memory_limit_MB' must be a positive"),
        ({"code": "1", "language": "python", "files": {"../x": ""}}, "field 'files': '../x' must be a relative path"),
        ({"code": "1", "language": "python", "fetch_files": ["/etc/passwd"]}, "field 'fetch_files': '/etc/passwd'"),
        ({"code": "1", "language": "python", "files": {"a": "%%%"}}, "field 'files'['a'] is not valid base64"),
        (["code"], "the body must be a JSON object, got list"),
    ]
    for doc, start in cases:
        status, body = client.post(doc)
        assert status == 422 and body["detail"].startswith(start), (doc, body)
    status, body = client.post(None, raw=b"{not json")
    assert status == 422 and body["detail"].startswith("the body is not JSON")


def test_health_ping_and_metrics(client):
    status, raw = client.get("/health")
    health = json.loads(raw)
    assert status == 200 and health["status"] == "SERVING" and health["isolation"] == "bubblewrap"
    assert health["mode"] in ("privileged", "userns") and health["num_workers"] == 2
    assert health["limits"]["max_output_bytes"] == 64 << 10
    assert client.get("/v1/ping") == (200, b'"pong"')
    client.run("print(1)")
    status, raw = client.get("/metrics")
    text = raw.decode()
    assert 'rlfabric_sandbox_runs_total{outcome="success"}' in text and "rlfabric_sandbox_queue_depth 0.0" in text

"""Fixtures of the tool tests: a stand-in SandboxFusion server, a real BM25 retrieval server, tool YAMLs.

The stand-in answers `/run_code` with SandboxFusion's response shape by running the code with this Python in a
subprocess (no isolation: test code only). The real sandbox service is another room's (services/sandbox/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

CORPUS = [
    {"id": "0", "contents": "\"Paris\"\nParis is the capital and largest city of France."},
    {"id": "1", "contents": "\"Berlin\"\nBerlin is the capital of Germany, on the river Spree."},
    {"id": "2", "contents": "\"Seine\"\nThe Seine flows through Paris to the English Channel."},
    {"id": "3", "contents": "\"Lyon\"\nLyon is a city in France at the confluence of two rivers."},
]


class FakeSandbox:
    """A SandboxFusion `/run_code` stand-in; `mode` picks its behaviour, `requests` records what it got.

    Modes: "run" (run the code), "504" (Gateway Timeout), "garbage" (not JSON), "error" (SandboxError),
    "hang" (answer after `hang_s`).
    """

    def __init__(self) -> None:
        self.mode = "run"
        self.hang_s = 5.0
        self.requests: list[dict[str, Any]] = []
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/run_code"

    def _run(self, payload: dict[str, Any]) -> dict[str, Any]:
        limit = float(payload["run_timeout"])
        try:
            done = subprocess.run([sys.executable, "-c", payload["code"]], capture_output=True, text=True,
                                  timeout=limit)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"status": "Failed", "message": "", "compile_result": None,
                    "run_result": {"status": "TimeLimitExceeded", "execution_time": limit, "return_code": None,
                                   "stdout": out, "stderr": ""}}
        return {"status": "Success" if done.returncode == 0 else "Failed", "message": "", "compile_result": None,
                "run_result": {"status": "Finished", "execution_time": 0.01, "return_code": done.returncode,
                               "stdout": done.stdout, "stderr": done.stderr}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sandbox = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with sandbox._lock:
                    sandbox.requests.append(payload)
                    sandbox.running += 1
                    sandbox.max_running = max(sandbox.max_running, sandbox.running)
                try:
                    mode = sandbox.mode
                    if mode == "504":
                        self._send(504, b"gateway timeout")
                        return
                    if mode == "garbage":
                        self._send(200, b"<html>oops</html>")
                        return
                    if mode == "hang":
                        time.sleep(sandbox.hang_s)
                    if mode == "error":
                        answer = {"status": "SandboxError", "message": "runner crashed", "run_result": None}
                    else:
                        answer = sandbox._run(payload)
                    self._send(200, json.dumps(answer).encode())
                finally:
                    with sandbox._lock:
                        sandbox.running -= 1

            def _send(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the caller gave up (a timeout test)

        return Handler

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def sandbox() -> Iterator[FakeSandbox]:
    server = FakeSandbox()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def corpus_path(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return path


@pytest.fixture
def retrieval(corpus_path: Path):
    from services.tools.retrieval import RetrievalServer

    with RetrievalServer(corpus_path, topk=2) as server:
        yield server


REFERENCE_TOOLS = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "mindspeed_rl" / "asked" / "tools"


def write_tool_yaml(path: Path, *, sandbox_url: str | None = None, retrieval_url: str | None = None,
                    code: dict[str, Any] | None = None, search: dict[str, Any] | None = None) -> Path:
    """The upstream tool YAMLs, combined, pointing at the given servers; `code` / `search` update their `config`."""
    tools = []
    if sandbox_url is not None:
        entry = yaml.safe_load((REFERENCE_TOOLS / "retool_config.yaml").read_text())["tools"][0]
        entry["config"].update(sandbox_fusion_url=sandbox_url, **(code or {}))
        tools.append(entry)
    if retrieval_url is not None:
        entry = yaml.safe_load((REFERENCE_TOOLS / "search_tool_config.yaml").read_text())["tools"][0]
        entry["config"].update(retrieval_service_url=retrieval_url, **(search or {}))
        tools.append(entry)
    path.write_text(yaml.safe_dump({"tools": tools}, sort_keys=False))
    return path

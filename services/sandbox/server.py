"""The sandbox's HTTP server: SandboxFusion's `POST /run_code`, plus `/health`, `/v1/ping` and `/metrics`.

Standard library `http.server` (one thread per connection, HTTP/1.1 keep-alive): the work is in the sandboxed
processes, so threads only wait. Answers:
- 200 with a RunCodeResponse for every request that was run, or that this server will not run (an unsupported
  language, a limit over the server's: status SandboxError and a message naming the flag);
- 422 {"detail": ...} for a malformed body (not JSON, an unknown key, a wrong type), naming the field, as
  SandboxFusion's FastAPI answers a body its schema rejects;
- 429 with a SandboxError body and `Retry-After` when the queue is full or the wait ran out (admission.py);
- 413 for a body over --max-request-mb, 411 without a Content-Length, 404 for any other path.
`GET /health` reports the isolation in use and the load; `GET /v1/ping` answers "pong" as SandboxFusion does.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.sandbox import metrics, schema
from services.sandbox.admission import Admission, AdmissionRefusedError
from services.sandbox.runner import Sandbox

logger = logging.getLogger(__name__)


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True  # a connection thread never holds the process up: runs end with their deadline anyway
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], sandbox: Sandbox, admission: Admission,
                 max_request_bytes: int) -> None:
        self.sandbox, self.admission, self.max_request_bytes = sandbox, admission, max_request_bytes
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/run_code"

    def health(self) -> dict[str, Any]:
        return {"status": "SERVING", **self.sandbox.describe(), "limits": asdict(self.sandbox.limits),
                "num_workers": self.admission.num_workers, "rate_limit": self.admission.rate_limit,
                "max_queue": self.admission.max_queue, "running": self.admission.running,
                "waiting": self.admission.waiting}

    def run_code(self, doc: Any) -> tuple[int, dict[str, Any]]:
        """One /run_code body -> (HTTP status, response body)."""
        try:
            request = schema.parse_run_code_request(doc)
        except schema.RequestError as e:
            metrics.REFUSED.labels("bad_request").inc()
            return 422, {"detail": str(e)}
        refusal = self.sandbox.refusal(request)  # before admission: a refused request takes no slot or token
        if refusal:
            metrics.RUNS.labels("sandbox_error").inc()
            return 200, schema.sandbox_error(refusal)
        started = time.monotonic()
        try:
            with self.admission.slot() as lease:
                result = self.sandbox.run(request, lease.number)
                if not result.slot_clean:
                    lease.retire()
        except AdmissionRefusedError as e:
            metrics.REFUSED.labels(e.reason).inc()
            return 429, schema.sandbox_error(str(e))
        metrics.RUNS.labels(result.outcome).inc()
        metrics.RUN_SECONDS.observe(time.monotonic() - started)
        return 200, result.response


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/run_code":
            self._send_json(404, {"detail": f"no such path {self.path[:80]!r}: POST /run_code"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send_json(411, {"detail": "a Content-Length header is required"})
            return
        if int(length) > self.server.max_request_bytes:
            self._send_json(413, {"detail": f"the body is {length} bytes, over --max-request-mb "
                                            f"({self.server.max_request_bytes >> 20} MB)"}, close=True)
            return
        body = self.rfile.read(int(length))
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            metrics.REFUSED.labels("bad_request").inc()
            self._send_json(422, {"detail": f"the body is not JSON: {e}"})
            return
        status, response = self.server.run_code(doc)
        headers = {"Retry-After": "1"} if status == 429 else {}
        self._send_json(status, response, headers=headers)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._send_json(200, self.server.health())
        elif path == "/v1/ping":
            self._send_json(200, "pong")
        elif path == "/metrics":
            self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
        else:
            self._send_json(404, {"detail": f"no such path {path[:80]!r}: GET /health, /v1/ping, /metrics"})

    def _send_json(self, status: int, doc: Any, *, headers: dict[str, str] | None = None, close: bool = False) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json", headers=headers, close=close)

    def _send(self, status: int, body: bytes, content_type: str, *, headers: dict[str, str] | None = None,
              close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:  # an unread body would be parsed as the next request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


def create_server(*, host: str, port: int, sandbox: Sandbox, num_workers: int, rate_limit: float = 0.0,
                  max_queue: int = 256, queue_timeout_s: float = 60.0, max_request_mb: int = 64) -> SandboxServer:
    """Binds (port 0: a free one) a server over `sandbox`, which must have passed `check()`; call serve_forever."""
    admission = Admission(num_workers=num_workers, rate_limit=rate_limit, max_queue=max_queue,
                          queue_timeout_s=queue_timeout_s)
    server = SandboxServer((host, port), sandbox, admission, max_request_mb << 20)
    metrics.QUEUE_DEPTH.set_function(lambda: admission.waiting)
    metrics.IN_FLIGHT.set_function(lambda: admission.running)
    return server


def serve(server: SandboxServer) -> None:
    """Serves until SIGTERM or SIGINT; then stops accepting, lets running requests finish, removes the scratch."""
    def stop(signum: int, _frame: Any) -> None:
        logger.info("sandbox: %s, stopping", signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        # Running requests end within their run_timeout; the scratch goes once they have.
        drain_by = time.monotonic() + server.sandbox.limits.max_run_timeout_s + 15
        while (server.admission.running or server.admission.waiting) and time.monotonic() < drain_by:
            time.sleep(0.1)
        server.sandbox.close()

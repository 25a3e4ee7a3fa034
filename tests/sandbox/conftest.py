"""A real sandbox server on a free loopback port, and a small /run_code client.

bubblewrap is required: when it is missing, a root shell with apt-get installs Debian's package as `make setup`
does; the tests skip, saying why, only when that is not possible.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.runner import Sandbox, SandboxLimits
from services.sandbox.server import create_server

UID_BASE = 2_000_000_000  # the server's default; tests look for leftover processes in this uid range


def ensure_bwrap() -> None:
    if shutil.which("bwrap"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("bubblewrap (bwrap) is not installed and cannot be installed here (needs root and apt-get): "
                    "install the bubblewrap package to run the sandbox tests")
    install = ["apt-get", "install", "-y", "-q", "bubblewrap"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
        done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    if not shutil.which("bwrap"):
        pytest.skip(f"bubblewrap is not installed and apt-get could not install it: {done.stderr.strip()[-300:]}")


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.base = url.removesuffix("/run_code")

    def post(self, doc: object, *, raw: bytes | None = None) -> tuple[int, dict]:
        data = raw if raw is not None else json.dumps(doc).encode()
        request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def run(self, code: str, **fields: object) -> dict:
        status, body = self.post({"code": code, "language": "python", **fields})
        assert status == 200, body
        return body

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.status, response.read()

    def assert_serving(self) -> None:
        """The service answers the next request normally."""
        body = self.run("print(sum(range(10)))")
        assert body["status"] == "Success" and body["run_result"]["stdout"] == "45\n", body


def start_server(tmp: Path, *, num_workers: int = 2, rate_limit: float = 0.0, max_queue: int = 64,
                 queue_timeout_s: float = 30.0, **limits: object):
    defaults = {"max_run_timeout_s": 10.0, "max_memory_mb": 1024, "max_processes": 32, "max_output_bytes": 64 << 10,
                "max_file_size_mb": 8, "max_scratch_mb": 32}
    sandbox = Sandbox(SandboxLimits(**{**defaults, **limits}), scratch_root=str(tmp), uid_base=UID_BASE)
    sandbox.check()
    server = create_server(host="127.0.0.1", port=0, sandbox=sandbox, num_workers=num_workers, rate_limit=rate_limit,
                           max_queue=max_queue, queue_timeout_s=queue_timeout_s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


def stop_server(server, thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
    server.sandbox.close()


@pytest.fixture(scope="module")
def sandbox_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    ensure_bwrap()
    server, thread = start_server(tmp_path_factory.mktemp("sandbox"))
    try:
        yield server
    finally:
        stop_server(server, thread)


@pytest.fixture(scope="module")
def client(sandbox_server) -> Client:
    return Client(sandbox_server.url)


@pytest.fixture
def bwrap_ready() -> None:
    ensure_bwrap()


@pytest.fixture
def make_client():
    """Client(url) for a server the test started itself."""
    return Client


@pytest.fixture
def leftover_processes():
    """A check that no process runs as a sandbox slot uid (privileged mode): after a run ends there is none."""
    return sandbox_uid_processes


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    """Starts extra servers with their own settings (start_server's keywords); stops them at the end."""
    ensure_bwrap()
    started = []

    def start(**options: object) -> Client:
        server, thread = start_server(tmp_path, **options)
        started.append((server, thread))
        return Client(server.url)

    try:
        yield start
    finally:
        for server, thread in started:
            stop_server(server, thread)


def sandbox_uid_processes() -> list[int]:
    """Host pids running as a sandbox slot uid (privileged mode): after a run ends there must be none."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if UID_BASE <= uid < UID_BASE + 10_000:
            pids.append(int(entry.name))
    return pids

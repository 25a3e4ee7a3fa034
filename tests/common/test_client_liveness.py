"""A call to a dead service fails promptly instead of hanging (issue 12).

The servers run in a child process so the test can SIGKILL or SIGSTOP them mid-call. Regression: with a
retry policy on streaming rpcs, a stream whose server was SIGKILLed before its first reply hung past its
deadline; a SIGSTOPped (hung) server was only noticed at the deadline.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest

from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc
from services.common.client import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, make_channel

# A Verifier that reads its requests and never answers.
_SILENT_SERVER = """
import time
from rlfabric.v1 import verifier_pb2_grpc
from services.common.server import ServiceSpec, create_server

class Silent(verifier_pb2_grpc.VerifierServicer):
    def Verify(self, request_iterator, context):
        for _ in request_iterator:
            pass
        time.sleep(3600)
        yield from ()

server = create_server([ServiceSpec(verifier_pb2_grpc.add_VerifierServicer_to_server, Silent(),
                                    "rlfabric.v1.Verifier")], "127.0.0.1:0", component="silent", metrics_port=None)
server.start()
print(server.address, flush=True)
time.sleep(3600)
"""

DEADLINE_S = 120.0


@pytest.fixture()
def silent_server(repo_root) -> Iterator[tuple[subprocess.Popen, str]]:
    proc = subprocess.Popen([sys.executable, "-c", _SILENT_SERVER], cwd=repo_root, stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address, "the silent server did not start"
        yield proc, address
    finally:
        proc.kill()
        proc.wait()


def _open_stream_then(proc: subprocess.Popen, address: str, fault: signal.Signals) -> grpc.StatusCode | None:
    """Opens a Verify stream, waits until the server holds it, sends `fault` to the server, returns the code
    the stream ended with (None if it had not ended after the deadline plus a margin: a hang)."""
    outcome: list[grpc.StatusCode] = []
    hold_open = threading.Event()
    sent = threading.Event()

    def requests() -> Iterator[verifier_pb2.VerifyRequest]:
        yield verifier_pb2.VerifyRequest(request_id="r0", response="1", ground_truth="1")
        sent.set()
        hold_open.wait()

    def call() -> None:
        with make_channel(address) as channel:
            try:
                for _ in verifier_pb2_grpc.VerifierStub(channel).Verify(requests(), timeout=DEADLINE_S):
                    pass
            except grpc.RpcError as e:
                outcome.append(e.code())

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert sent.wait(30)
    proc.send_signal(fault)
    caller.join(timeout=DEADLINE_S + 30)
    hold_open.set()
    return outcome[0] if outcome else None


def test_stream_to_a_sigkilled_server_fails_unavailable_not_at_the_deadline(silent_server) -> None:
    proc, address = silent_server
    # UNAVAILABLE (the broken connection), not DEADLINE_EXCEEDED and not a hang.
    assert _open_stream_then(proc, address, signal.SIGKILL) == grpc.StatusCode.UNAVAILABLE


def test_stream_to_a_hung_server_is_dropped_by_keepalive(silent_server) -> None:
    proc, address = silent_server
    assert KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS < DEADLINE_S * 1000 / 4
    try:
        # The connection stays up (the kernel still answers TCP); only the unanswered keepalive ping shows
        # that nobody is home.
        assert _open_stream_then(proc, address, signal.SIGSTOP) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.send_signal(signal.SIGCONT)

"""Remote verifier calls share streams: a burst of samples travels in one `Verify` call, each with its deadline.

A verifier server in this process (real gRPC on loopback) records what each stream carried, so the tests
can see the batching; its first stream waits until the test lets it go, which makes the batch sizes
deterministic.
"""

import threading
import time
from concurrent import futures

import grpc
import pytest

from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc
from services.reward.outcome import TIMEOUT
from services.reward.pool import SampleClock
from services.reward.remote import RemoteVerifier
from services.reward.verifier_store import RemoteVerifierEntry


class RecordingVerifier(verifier_pb2_grpc.VerifierServicer):
    """Scores 1.0 when response == ground truth; "sleep:S" sleeps S seconds first. Records each stream's ids."""

    def __init__(self) -> None:
        self.streams: list[list[str]] = []
        self.release_first = threading.Event()
        self._lock = threading.Lock()

    def Verify(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        ids: list[str] = []
        with self._lock:
            first = not self.streams
            self.streams.append(ids)
        if first:
            self.release_first.wait(30)
        for request in request_iterator:
            ids.append(request.request_id)
            if request.response.startswith("sleep:"):
                time.sleep(float(request.response.split(":")[1]))
            yield verifier_pb2.VerifyResponse(request_id=request.request_id,
                                              score=1.0 if request.response == request.ground_truth else 0.0)


@pytest.fixture
def verifier():
    servicer = RecordingVerifier()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release_first.set()
    server.stop(0)


def test_a_burst_is_dealt_over_the_calls_allowed(verifier):
    servicer, endpoint = verifier
    servicer.release_first.set()
    remote = RemoteVerifier(RemoteVerifierEntry("rec", "1", endpoint, timeout_s=30, max_concurrency=4))
    try:
        outcomes = [f.result(30) for f in [remote.submit(f"s{i}", "1", "1", "", SampleClock(60))
                                           for i in range(64)]]
    finally:
        remote.close()
    assert all(o.score == 1.0 and o.reason == "" for o in outcomes)
    assert sorted(x for ids in servicer.streams for x in ids) == sorted(f"s{i}" for i in range(64))
    # A call takes at most its share of the queue (ceil(queued / max_concurrency), at least 8), so that one
    # slow verdict holds up few others; 64 samples need at least 4 calls of 16.
    assert remote.calls == len(servicer.streams) >= 4
    assert max(len(ids) for ids in servicer.streams) <= 16


def test_a_burst_shares_one_call_and_every_answer_reaches_its_sample(verifier):
    servicer, endpoint = verifier
    remote = RemoteVerifier(RemoteVerifierEntry("rec", "1", endpoint, timeout_s=30, max_concurrency=1))
    try:
        first = remote.submit("s0", "0", "0", "", SampleClock(60))
        deadline = time.monotonic() + 30
        while not servicer.streams:  # the first call is open (and held by the server)
            assert time.monotonic() < deadline, "the first call never reached the verifier"
            time.sleep(0.01)
        rest = [remote.submit(f"s{i}", str(i), "7", "", SampleClock(60)) for i in range(1, 40)]
        servicer.release_first.set()
        outcomes = [first.result(30), *(f.result(30) for f in rest)]
    finally:
        remote.close()
    assert [o.score for o in outcomes] == [1.0] + [1.0 if i == 7 else 0.0 for i in range(1, 40)]
    assert all(o.reason == "" for o in outcomes)
    # One call for the first sample, one for the 39 queued behind it (max_concurrency 1: one stream at a time).
    assert servicer.streams == [["s0"], [f"s{i}" for i in range(1, 40)]]
    assert remote.calls == 2


def test_each_request_of_a_call_keeps_its_own_deadline(verifier):
    servicer, endpoint = verifier
    servicer.release_first.set()
    remote = RemoteVerifier(RemoteVerifierEntry("rec", "1", endpoint, timeout_s=1.0, max_concurrency=1))
    try:
        hold = remote.submit("h", "sleep:0.3", "x", "", SampleClock(60))  # keeps the next ones queued together
        fast = remote.submit("fast", "a", "a", "", SampleClock(60))
        slow = remote.submit("slow", "sleep:2", "b", "", SampleClock(60))
        after = remote.submit("after", "c", "c", "", SampleClock(60))
        results = {name: f.result(30) for name, f in (("h", hold), ("fast", fast), ("slow", slow),
                                                        ("after", after))}
    finally:
        remote.close()
    assert results["h"].reason == "" and results["h"].score == 0.0
    assert results["fast"].reason == "" and results["fast"].score == 1.0
    # The slow verdict comes after its 1 s deadline, and with one stream at a time (max_concurrency 1) the
    # one queued behind it in that stream never comes in time: both are timeouts, scored 0.
    assert results["slow"].reason == TIMEOUT and results["slow"].score == 0.0
    assert results["after"].reason == TIMEOUT and results["after"].score == 0.0
    assert remote.calls == 2

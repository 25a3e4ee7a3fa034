"""A custom reward rule served over gRPC: the last number in the response must equal the label.

It implements the public `rlfabric.v1.Verifier` service (protos/rlfabric/v1/verifier.proto) and needs
nothing from rlfabric but the generated stubs; any language with gRPC can do the same. Run it, then
register its endpoint with any reward worker (see README.md in this folder):

    python examples/verifiers/last_number_verifier.py --port 50070
"""

import argparse
import re
import sys
from concurrent import futures

import grpc

from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_score(response: str, ground_truth: str) -> float:
    """1.0 when the last number written in `response` equals `ground_truth` as a number, else 0.0."""
    numbers = _NUMBER.findall(response.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1]) == float(ground_truth.replace(",", "")) else 0.0
    except ValueError:
        return 0.0


class LastNumberVerifier(verifier_pb2_grpc.VerifierServicer):
    """Answers each VerifyRequest of the stream with one VerifyResponse carrying the same request_id."""

    def Verify(self, request_iterator, context):
        for request in request_iterator:
            try:
                score = last_number_score(request.response, request.ground_truth)
                yield verifier_pb2.VerifyResponse(request_id=request.request_id, score=score)
            except Exception as e:  # noqa: BLE001 (report per request; keep the stream going)
                yield verifier_pb2.VerifyResponse(request_id=request.request_id, error=str(e))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free port, printed at start)")
    args = parser.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    verifier_pb2_grpc.add_VerifierServicer_to_server(LastNumberVerifier(), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"last_number verifier listening on {args.host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

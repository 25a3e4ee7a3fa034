"""The reward rule of `make demo`, served over gRPC: the response must start with the answer.

The demo's task is "A+B=" -> the decimal sum. None of the built-in rules fits (they read a `\\boxed{}` or an
`Answer:` line), so the demo brings its own, as any user can: a server of the public `rlfabric.v1.Verifier`
service (protos/rlfabric/v1/verifier.proto) that `rlfabric up` starts and registers:

    rlfabric up CONFIG --verifier-command 'leading_number=python examples/grpo/leading_number_verifier.py --port {port}'

Score: 1.0 when the number the response starts with (leading spaces allowed) equals the label, else 0.0. A
response "123" or "123 and more" for the label "123" scores 1; "1234", "0123" or " = 123" scores 0.
"""

import argparse
import re
import sys
from concurrent import futures

import grpc

from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def leading_number_score(response: str, ground_truth: str) -> float:
    """1.0 when `response` starts with the integer `ground_truth` (as written, no leading zeros), else 0.0."""
    match = _LEADING_NUMBER.match(response)
    return 1.0 if match is not None and match.group(1) == ground_truth.strip() else 0.0


class LeadingNumberVerifier(verifier_pb2_grpc.VerifierServicer):
    """Answers each VerifyRequest of the stream with one VerifyResponse carrying the same request_id."""

    def Verify(self, request_iterator, context):
        for request in request_iterator:
            yield verifier_pb2.VerifyResponse(request_id=request.request_id,
                                              score=leading_number_score(request.response, request.ground_truth))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free port, printed at start)")
    args = parser.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServicer_to_server(LeadingNumberVerifier(), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"leading_number verifier listening on {args.host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

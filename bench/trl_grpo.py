"""The TRL side of bench_e2e.py: TRL's `GRPOTrainer` on the same model, prompts, reward rule and sizes.

Runs in an interpreter that has TRL (the `bench` extra: `pip install -e .[bench]`, or a separate virtual
environment, see bench/RESULTS.md); bench_e2e.py starts it as a subprocess and reads the JSON it writes:
per-step wall times (callback on each optimizer step), generation time per step (the model's `generate`
timed), completion lengths (TRL's own log: mean, min, max, share cut at the limit), prompt lengths (the tokenizer
on the prompts of the data set), and the seconds from the process start to the end of the first step.

Reward (`--reward`): leading_number (W1, W2: the response starts with the sum) or count_sequence (W3,
bench/count_task.py: the response counts down from N to 0). `--no-shuffle` takes the prompts in the file's order, as
rlfabric does with `megatron_training.no_shuffle=true`, so that both sides see the same prompts at each step.

    python bench/trl_grpo.py --model DIR --data rows.jsonl --steps 12 --max-tokens 64 --lr 1e-5 --out trl.json
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402 (the clock starts before the imports, as the other side's does at launch)
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def leading_number_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 when the completion starts with the sum (examples/grpo/leading_number_verifier.py's rule)."""
    out = []
    for text, want in zip(completions, answer, strict=True):
        m = _LEADING_NUMBER.match(text)
        out.append(1.0 if m is not None and m.group(1) == want.strip() else 0.0)
    return out


def count_sequence_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """bench/count_task.py's rule (W3), the one rlfabric's verifier of that file applies."""
    from count_task import count_sequence_score  # bench/ is this script's folder, hence on sys.path

    return [count_sequence_score(text, want) for text, want in zip(completions, answer, strict=True)]


REWARDS = {"leading_number": leading_number_reward, "count_sequence": count_sequence_reward}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="jsonl with problem and answer")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lr-schedule", default="constant")
    p.add_argument("--adam-beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's choice)")
    p.add_argument("--reward", choices=sorted(REWARDS), default="leading_number")
    p.add_argument("--no-shuffle", action="store_true", help="prompts in the file's order")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt_lengths = [len(tokenizer(r["problem"])["input_ids"]) for r in rows]
    data = Dataset.from_list([{"prompt": r["problem"], "answer": r["answer"]} for r in rows])

    gen_seconds: list[float] = []
    generate = model.generate

    def timed_generate(*a: object, **kw: object) -> object:
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_seconds.append(time.perf_counter() - t)

    model.generate = timed_generate

    steps: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a: object, **_k: object) -> None:
            self.t = time.perf_counter()
            self.gen_before = len(gen_seconds)

        def on_step_end(self, *_a: object, **_k: object) -> None:
            end = time.perf_counter()
            steps.append({"seconds": end - self.t, "end_since_start": end - START,
                          "generate_seconds": sum(gen_seconds[self.gen_before:])})

    cfg = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trl")), use_cpu=True, bf16=False, use_vllm=False,
        per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
        max_completion_length=args.max_tokens, beta=args.beta, loss_type="bnpo", gradient_checkpointing=False,
        learning_rate=args.lr, lr_scheduler_type=args.lr_schedule, adam_beta1=0.9, adam_beta2=args.adam_beta2,
        weight_decay=args.weight_decay, max_grad_norm=1.0, temperature=1.0, top_p=1.0, max_steps=args.steps,
        logging_steps=1, save_strategy="no", report_to=[], seed=1, dataloader_num_workers=0,
        shuffle_dataset=not args.no_shuffle,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=REWARDS[args.reward], args=cfg, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    for s, h in zip(steps, logs, strict=False):
        s["completion_mean_length"] = float(h["completions/mean_length"])
        s["completion_min_length"] = float(h["completions/min_length"])
        s["completion_max_length"] = float(h["completions/max_length"])
        s["completion_clipped_ratio"] = float(h.get("completions/clipped_ratio", float("nan")))
        s["reward"] = float(h.get("reward", 0.0))
    Path(args.out).write_text(json.dumps({
        "steps": steps, "prompt_mean_length": sum(prompt_lengths) / len(prompt_lengths),
        "samples_per_step": args.prompts * args.n, "torch_threads": torch.get_num_threads(),
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

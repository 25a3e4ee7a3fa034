"""The multi-turn demo's task and its supervised warm-up: "What is A*B?" (A, B in 317..999), solvable with a tool.

A tiny Qwen2 (hidden 128, 4 layers, digit tokenizer) cannot multiply two 3-digit numbers; it can learn to copy
them into a call of the code interpreter and to copy the tool's answer into `\\boxed{}` (A, B from 317: every
product has 6 digits, so every conversation has the same layout). The conversation the warm-up teaches, in the
`qwen` chat template (configs/model/templates.json), token for token what the coordinator builds during the run
(services/coordinator/multi_turn.py; ReTool prints the value of the code's last line):

    <|im_start|>system ... <|im_start|>user\\nWhat is 412*733?<|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "412*733"}}\\n</tool_call><|im_end|>
    \\n<|im_start|>tool\\n<tool_response>\\n301996\\n\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    \\boxed{301996}<|im_end|>

The loss covers the model's two turns (the call, the answer), never the prompt or the tool's answer. The warm-up
has two phases. First the tool path alone, until greedy decoding solves `stop_at` of a slice of the training
problems (copying the digits is learned in a jump, between steps 300 and 400; mixed from the start with answers the
model cannot know, it was not learned in 1,000 steps). Then `mixed_steps` steps that
imitate an imperfect teacher, so that GRPO has room to improve on each thing the must-show watches: a share of the
problems (`direct_fraction`, 0.4) is answered at once (`\\boxed{N}`, a number the model cannot know), so that the
policy calls the tool on only part of its samples (`tool/calls_per_sample`); a share of the calls
(`malformed_fraction`, 0.25) lacks its last closing brace, which the hermes parser refuses (the conversation shows
the parse error the coordinator answers with), so that part of the calls fail (`tool/success_rate`). GRPO's reward
(`retool_reward`: +1 right, -1 wrong, -0.9 wrong after a tool turn) favours a well-formed call, copied back right.

Used by examples/multi_turn/multi_turn_demo_cpu.sh (`python examples/multi_turn/tool_task.py WORK`) and, in
process, by tests/e2e/test_multi_turn_up.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/grpo_multi_turn_demo_cpu.yaml"
TEMPLATE = "qwen"
TOOL_NAME = "code_interpreter"
IGNORE_INDEX = -100
# Two layers copy the call's digits out of the prompt but never the answer's out of the tool's reply (1,000 steps,
# loss stuck at ln 10 per answer digit); four copy both, every digit, by step ~400.
LAYERS = 4


def multiplication_rows(count: int, *, seed: int, low: int = 317, high: int = 999) -> list[dict[str, str]]:
    """`count` rows {"problem": "What is A*B?", "answer": "A*B's value"} (DeepScaleR's keys), A, B in low..high."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"problem": f"What is {a}*{b}?", "answer": str(a * b)})
    return rows


def operands(problem: str) -> tuple[int, int]:
    a, b = problem.removeprefix("What is ").removesuffix("?").split("*")
    return int(a), int(b)


def write_task(out_dir: str | Path, *, train: int = 4000, held_out: int = 200) -> tuple[Path, Path]:
    """`train.jsonl` and `heldout.jsonl` (distinct seeds; a repeated pair is one in 800,000) under `out_dir`."""
    from services.data.synthetic import write_rows_jsonl

    out = Path(out_dir)
    return (write_rows_jsonl(out / "train.jsonl", multiplication_rows(train, seed=0)),
            write_rows_jsonl(out / "heldout.jsonl", multiplication_rows(held_out, seed=1)))


def call_text(problem: str, *, malformed: bool = False) -> str:
    """The tool call the warm-up teaches (hermes format, as `tool_parser_format: hermes` parses it); `malformed`,
    the same call without its last closing brace (one token's difference), which hermes refuses as invalid JSON."""
    a, b = operands(problem)
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": f"{a}*{b}"}})  # ReTool prints a last line's value
    return f"<tool_call>\n{call[:-1] if malformed else call}\n</tool_call>"


def tool_answer_limits() -> tuple[int, str]:
    """(max_tool_response_length, tool_response_truncate_side) of the demo config: how the coordinator cuts a
    tool's answer, which the warm-up's conversations must show as the run will."""
    import yaml

    rl = yaml.safe_load((REPO / CONFIG).read_text())["rl_config"]
    return int(rl["max_tool_response_length"]), str(rl["tool_response_truncate_side"])


@dataclass(frozen=True)
class Conversation:
    """One problem as the warm-up trains on it: token ids, and which of them the model writes (the loss)."""

    ids: list[int]
    written: list[bool]

    @property
    def first_written(self) -> int:
        return self.written.index(True)


KINDS = ("tool", "direct", "malformed")


def conversation(tokenizer: Any, template: Any, problem: str, answer: str, kind: str = "tool") -> Conversation:
    """The prompt and the turns the model writes for one problem (`kind`):
    - tool: the call, the tool's answer (the sandbox's stdout, `print`'s line, wrapped as the coordinator wraps
      it; context, not written by the model), the boxed answer;
    - malformed: the call without its last brace, the parse error the coordinator answers it with (cut as it
      cuts answers), the boxed answer all the same (which the model cannot know);
    - direct: the boxed answer at once."""
    from services.coordinator.multi_turn import truncate, wrap_answers
    from services.coordinator.tool_parsers import get_tool_parser

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    eos = int(tokenizer.eos_token_id)
    prompt = template.encode_prompt(tokenizer, problem)
    boxed = tokenizer.encode(f"\\boxed{{{answer}}}", add_special_tokens=False) + [eos]
    if kind == "direct":
        return Conversation(prompt + boxed, [False] * len(prompt) + [True] * len(boxed))
    text = call_text(problem, malformed=kind == "malformed")
    reply = f"{answer}\n"
    if kind == "malformed":
        limit, side = tool_answer_limits()
        (error,) = get_tool_parser("hermes")(text)
        reply = truncate(error.message, limit, side)
    call = tokenizer.encode(text, add_special_tokens=False) + [eos]
    observation = template.encode_observation(tokenizer, wrap_answers([reply]))
    return Conversation(prompt + call + observation + boxed,
                        [False] * len(prompt) + [True] * len(call) + [False] * len(observation) + [True] * len(boxed))


STOP_ON = ("tool_path", "frame")


@dataclass(frozen=True)
class WarmupSettings:
    """The warm-up's hyper-parameters (AdamW, linear warm-up then constant; batches drawn with replacement).

    Measured (2-core machine, seed 0, batch 32, lr 3e-3, 4 layers): the frame of the call and answer is right after
    ~100 steps; greedy solves 0% of the checked problems at step 300, 36% at 350 and over 90% at 400, where the first
    phase stops; after the 60 mixed steps, 79% of held-out problems (the tool path, teacher-forced), the first token
    opens a call with probability 0.64, the call's frame is right with probability 0.69. ~2.4 CPU s per step, ~9 min.
    """

    steps: int = 1000  # a cap on the first phase, which stops once `stop_at` is reached
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    clip_grad: float = 1.0
    # The second phase: `mixed_steps` steps on the imperfect teacher's mixture.
    mixed_steps: int = 60
    direct_fraction: float = 0.4  # of the problems: taught as a direct answer
    malformed_fraction: float = 0.25  # of the other problems: the call's last brace left out (a parse error)
    # What `stop_at` measures (see `accuracies`): "tool_path", the share of checked problems greedy decoding
    # solves; "frame", the probability that sampling writes a call and an answer that parse (digits aside): a
    # quick warm-up whose calls run, with wrong numbers.
    stop_on: str = "tool_path"
    stop_at: float = 0.9
    check_every: int = 50
    check_rows: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stop_on not in STOP_ON:
            raise ValueError(f"stop_on {self.stop_on!r}: expected one of {', '.join(STOP_ON)}")


def _batch(conversations: Sequence[Conversation], pad_id: int, skip_first: bool = False) -> tuple[Any, Any, Any]:
    """Right-padded (ids, attention mask, labels), labels on the written tokens (without the first one when
    `skip_first`: the call-or-answer choice, which a mixed warm-up leaves open on purpose)."""
    import torch

    width = max(len(c.ids) for c in conversations)
    ids = torch.full((len(conversations), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(conversations), width), dtype=torch.long)
    labels = torch.full((len(conversations), width), IGNORE_INDEX, dtype=torch.long)
    for i, c in enumerate(conversations):
        ids[i, :len(c.ids)] = torch.tensor(c.ids)
        mask[i, :len(c.ids)] = 1
        for j, written in enumerate(c.written):
            if written and not (skip_first and j == c.first_written):
                labels[i, j] = c.ids[j]
    return ids, mask, labels


def _forward(model: Any, ids: Any, mask: Any, labels: Any) -> tuple[Any, Any, Any]:
    """Per position: the labels' negative log-likelihood (0 where nothing is labelled), whether the argmax is
    the label (True where nothing is labelled), and the labels, all aligned to the logits' positions."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE_INDEX,
                                            reduction="none")
    return nll, (logits.argmax(-1) == target) | (target == IGNORE_INDEX), target


def accuracies(model: Any, conversations: Sequence[Conversation], pad_id: int, digit_ids: Sequence[int],
               batch: int = 64) -> tuple[float, float]:
    """(frame, tool path) over tool conversations, the first written token (see `_batch`) left out:
    - frame: the mean probability that sampling (temperature 1) writes everything but the digits right, the JSON
      of the call and the `\\boxed{}` around the answer, each token given the right ones before it;
    - tool path: the share that greedy decoding writes exactly, digits included.
    Teacher-forced: one forward pass per batch."""
    import torch

    frame = 0.0
    paths = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(conversations), batch):
            nll, right, target = _forward(model, *_batch(conversations[i:i + batch], pad_id, skip_first=True))
            digit = torch.isin(target, torch.tensor(list(digit_ids)))
            frame += float(torch.exp(-(nll * ~digit).sum(dim=1)).sum())
            paths += int(right.all(dim=1).sum())
    model.train()
    n = max(1, len(conversations))
    return frame / n, paths / n


def call_probability(model: Any, conversations: Sequence[Conversation], pad_id: int) -> float:
    """The mean probability that the model's first token opens a tool call (rather than a direct answer), over tool
    conversations: the share of samples that call the tool, at temperature 1."""
    import torch

    model.eval()
    with torch.no_grad():
        ids, mask, _ = _batch(conversations, pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits
        rows = torch.arange(len(conversations))
        first = torch.tensor([c.first_written for c in conversations])
        probs = torch.softmax(logits[rows, first - 1], dim=-1)[rows, ids[rows, first]]
    model.train()
    return float(probs.mean())


class _Trainer:
    """AdamW on the written tokens of conversations drawn with replacement (see WarmupSettings)."""

    def __init__(self, model: Any, settings: WarmupSettings, pad_id: int) -> None:
        import torch

        self.model, self.settings, self.pad_id = model, settings, pad_id
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.steps, self.loss = 0, float("nan")

    def step(self, examples: Sequence[Conversation]) -> None:
        import torch

        s = self.settings
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = s.lr * min(1.0, self.steps / max(1, s.warmup_steps))
        picks = torch.randint(len(examples), (s.batch_size,), generator=self.generator).tolist()
        nll, _, target = _forward(self.model, *_batch([examples[i] for i in picks], self.pad_id))
        loss = nll.sum() / (target != IGNORE_INDEX).sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip_grad)
        self.optimizer.step()
        self.loss = float(loss.detach())


def warm_up(base_dir: str | Path, train_rows: Sequence[dict[str, str]], held_out_rows: Sequence[dict[str, str]],
            out_dir: str | Path, settings: WarmupSettings = WarmupSettings(), quiet: bool = True) -> dict[str, Any]:
    """Fine-tunes the model in `base_dir` in two phases (see module doc) and saves it with `warmup_summary.json`
    to `out_dir`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.data.templates import get_template

    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    template = get_template(TEMPLATE)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    rng = random.Random(settings.seed)
    kinds = ["direct" if rng.random() < settings.direct_fraction else
             "malformed" if rng.random() < settings.malformed_fraction else "tool" for _ in train_rows]
    tool_path = [conversation(tokenizer, template, r["problem"], r["answer"]) for r in train_rows]
    mixed = [conversation(tokenizer, template, r["problem"], r["answer"], k)
             for r, k in zip(train_rows, kinds, strict=True)]
    check = tool_path[:settings.check_rows]
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    trainer = _Trainer(model, settings, pad_id)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    checked = (0.0, 0.0)
    while trainer.steps < settings.steps:
        trainer.step(tool_path)
        if trainer.steps % settings.check_every == 0 or trainer.steps == settings.steps:
            checked = accuracies(model, check, pad_id, digits)
            if not quiet:
                print(f"  step {trainer.steps}: loss {trainer.loss:.3f}; on {len(check)} training problems, sampling "
                      f"writes the frame of call and answer right with probability {checked[0]:.2f}, greedy solves "
                      f"{checked[1]:.0%}", flush=True)
            if checked[1 if settings.stop_on == "tool_path" else 0] >= settings.stop_at:
                break
    tool_path_steps = trainer.steps
    for _ in range(settings.mixed_steps):
        trainer.step(mixed)
    if settings.mixed_steps:
        checked = accuracies(model, check, pad_id, digits)
    held_out = [conversation(tokenizer, template, r["problem"], r["answer"]) for r in held_out_rows]
    held = accuracies(model, held_out, pad_id, digits) if held_out else (None, None)
    summary = {"settings": asdict(settings), "train_rows": len(train_rows), "direct_rows": kinds.count("direct"),
               "malformed_rows": kinds.count("malformed"), "tool_path_steps": tool_path_steps,
               "steps_run": trainer.steps, "final_loss": trainer.loss, "train_check_frame_probability": checked[0],
               "train_check_tool_path_accuracy": checked[1], "held_out_frame_probability": held[0],
               "held_out_tool_path_accuracy": held[1], "call_probability": call_probability(model, check, pad_id),
               "seconds": time.perf_counter() - started}
    if not quiet:
        print(f"  after {settings.mixed_steps} mixed steps: greedy solves {checked[1]:.0%} of the checked problems "
              f"({held[1] if held[1] is None else f'{held[1]:.0%}'} held out); the first token opens a call with "
              f"probability {summary['call_probability']:.2f}", flush=True)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.copyfile(Path(base_dir) / "tokenizer_config.json", tmp / "tokenizer_config.json")  # the pinned class
    (tmp / "warmup_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return summary


def prepare(work: str | Path, settings: WarmupSettings = WarmupSettings(), *, train: int = 4000,
            held_out: int = 200, quiet: bool = True) -> Path:
    """The demo's files under `work` (each made once; a second call finds them): base_model (a tiny Qwen2),
    task/{train,heldout}.jsonl, dataset/{train,heldout} (preprocessed with the `qwen` template), sft_model."""
    from services.common.tiny_model import write_tiny_model
    from services.data.dataset_config import load_dataset_config
    from services.data.preprocess import preprocess

    work = Path(work)
    base = work / "base_model"
    if not (base / "config.json").is_file():
        write_tiny_model(base, vocab_size=512, num_layers=LAYERS, digits="single")
    train_path, held_out_path = work / "task" / "train.jsonl", work / "task" / "heldout.jsonl"
    if not held_out_path.is_file():
        write_task(work / "task", train=train, held_out=held_out)
    for split, path in (("train", train_path), ("heldout", held_out_path)):
        if not (work / "dataset" / f"{split}_packed_input_ids_document.idx").is_file():
            preprocess(load_dataset_config(REPO / "configs" / "datasets" / "deepscaler.yaml", [
                f"input={path}", f"tokenizer_name_or_path={base}", f"output_prefix={work / 'dataset' / split}",
                f"prompt_type={TEMPLATE}", "workers=1"]))
    if not (work / "sft_model" / "warmup_summary.json").is_file():
        rows = [json.loads(line) for line in train_path.read_text().splitlines()]
        held = [json.loads(line) for line in held_out_path.read_text().splitlines()]
        warm_up(base, rows, held, work / "sft_model", settings, quiet=quiet)
    return work


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path, help="folder for the model, the task, the data and the warmed-up model")
    p.add_argument("--steps", type=int, default=WarmupSettings.steps, help="most warm-up steps")
    p.add_argument("--stop-at", type=float, default=WarmupSettings.stop_at,
                   help="stop once this share of checked training problems is right (see --stop-on)")
    p.add_argument("--stop-on", choices=STOP_ON, default=WarmupSettings.stop_on,
                   help="what --stop-at measures: greedy solves the problem (tool_path), or sampling writes the "
                        "frame of call and answer right (frame)")
    p.add_argument("--mixed-steps", type=int, default=WarmupSettings.mixed_steps,
                   help="steps of the second phase, on the mixture of calls, direct answers and malformed calls")
    p.add_argument("--direct-fraction", type=float, default=WarmupSettings.direct_fraction,
                   help="share of problems taught as a direct answer instead of a tool call")
    p.add_argument("--malformed-fraction", type=float, default=WarmupSettings.malformed_fraction,
                   help="share of the tool calls taught without their last brace (a parse error)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    prepare(args.work, WarmupSettings(steps=args.steps, stop_at=args.stop_at, stop_on=args.stop_on,
                                      mixed_steps=args.mixed_steps,
                                      direct_fraction=args.direct_fraction,
                                      malformed_fraction=args.malformed_fraction), quiet=False)
    print(json.dumps(json.loads((args.work / "sft_model" / "warmup_summary.json").read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())

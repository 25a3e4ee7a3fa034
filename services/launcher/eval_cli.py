"""`rlfabric eval`: pass@1, pass@k and mean@n of a model on eval sets, through the rollout and reward services.

    rlfabric eval --model DIR --dataset math500 --dataset aime2024 [-n 8 --k 1 --k 8] [--out DIR]

By default it starts what it needs, as `rlfabric up` does (a private Redis, a reward worker, a vLLM rollout
replica serving --model, custom verifiers), and stops them at the end; with --redis-url it uses the rollout
replicas and reward workers registered there instead (for example those of a running `rlfabric up`: it then
evaluates whatever weights the replicas hold). Writes to --out: `samples.jsonl` (every sample with its
response and scores), `results.json` and `results.md` (the table, also printed).

It lives with the launcher because it starts services; the evaluation itself (sampling, scoring, pass@k) is the
coordinator's (services/coordinator/evaluation.py), which validation during training runs too.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import Any


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    from services.coordinator.evaluation_data import DEFAULT_EVAL_DIR, EVAL_SETS
    from services.launcher.cli import add_verifier_arguments

    p = subparsers.add_parser("eval", help="pass@k of a model on eval sets, through the rollout and reward services",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder (with --redis-url: default the replicas' model)")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME|FILE",
                   help=f"eval set ({', '.join(EVAL_SETS)}) or a .json/.jsonl/.parquet file; repeatable "
                        "(default: math500)")
    p.add_argument("--eval-dir", type=Path, default=DEFAULT_EVAL_DIR, help="where the named eval sets are")
    p.add_argument("--template", default="qwen_r1", help="prompt template from templates.json (default: qwen_r1)")
    p.add_argument("--prompt-key", default="problem", help="problem field (default: problem)")
    p.add_argument("--answer-key", default="answer", help="answer field (default: answer)")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each set")
    p.add_argument("-n", "--n-samples", type=int, default=1, help="samples per problem (default 1)")
    p.add_argument("--k", type=int, action="append", default=[], help="report pass@k (repeatable; default 1 and n)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0, greedy, for n = 1; 1.0 for n > 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0)")
    p.add_argument("--max-tokens", type=int, default=1024, help="response tokens per sample (default 1024)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: fresh entropy)")
    p.add_argument("--verifier-function", action="append", default=[], metavar="NAME",
                   help="reward rule(s) scoring the samples, as in rl_config.verifier_function, weight 1 each "
                        "(default: math_equiv)")
    p.add_argument("--threshold", type=float, default=1.0, help="reward at or above which a sample is correct")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: runs/eval-TIMESTAMP)")
    p.add_argument("--redis-url", default=None, help="use the services registered in this Redis")
    p.add_argument("--dtype", default="auto", help="engine dtype of the replica it starts (default auto)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="engine length of the replica it starts (default: longest prompt + max tokens)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for services")
    p.add_argument("--deadline", type=float, default=3600.0,
                   help="longest one Generate or scoring call may take, in seconds (default 3600)")
    add_verifier_arguments(p)
    from services.common.security import add_security_args

    add_security_args(p, server=False)  # with --redis-url: the running services' token, CA, Redis URL file
    p.set_defaults(func=_eval)


def _settings(args: argparse.Namespace) -> Any:
    from services.coordinator.evaluation import EvalSettings

    n = args.n_samples
    if n < 1 or args.max_tokens < 1:
        raise ValueError("-n and --max-tokens must be >= 1")
    bad = [k for k in args.k if not 1 <= k <= n]
    if bad:
        raise ValueError(f"--k {bad[0]}: k must be in 1..n ({n}); draw more samples with -n")
    temperature = args.temperature if args.temperature is not None else (0.0 if n == 1 else 1.0)
    seed = args.seed if args.seed is not None else secrets.randbits(63)  # drawn here so results.json records it
    return EvalSettings(n=n, max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p, top_k=-1,
                        seed=seed, verifiers=tuple((v, 1.0) for v in (args.verifier_function or ["math_equiv"])),
                        ks=tuple(sorted(set(args.k or [1, n]))), threshold=args.threshold,
                        deadline_s=args.deadline)


def _eval(args: argparse.Namespace) -> int:
    from services.common.errors import DataError
    from services.common.security import configure_client
    from services.launcher.cli import verifiers_from_args

    try:
        configure_client(args)  # reads --auth-token-file / --redis-url-file; calls to the services use them
        settings = _settings(args)
        verifiers = verifiers_from_args(args)
        if not args.model and not args.redis_url:
            raise ValueError("--model is required (unless --redis-url names running replicas)")
        if args.model:
            from services.common.model_paths import require_model_dir

            require_model_dir(args.model, "--model")  # at once: transformers would try it as a hub id for a minute
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    from services.coordinator.errors import IterationError
    from services.launcher.eval_services import EvalServices
    from services.launcher.stack import ServiceStartError

    services = EvalServices(out / "services", redis_url=args.redis_url, verifiers=verifiers,
                            startup_timeout_s=args.startup_timeout, auth_token=args.auth_token)
    try:
        problems, left_out, tokenizer = _problems(args, settings, services)
        engine_length = 0 if services.attach else args.max_model_len or _engine_length(
            problems, settings.max_tokens, args.model)
        services.start(args.model, dtype=args.dtype, max_model_len=engine_length)
        return _run(args, settings, services, problems, left_out, tokenizer, out)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ServiceStartError, IterationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        services.stop()


def _problems(args: argparse.Namespace, settings: Any, services: Any) -> tuple[list, dict[str, int], Any]:
    from transformers import AutoTokenizer

    from services.coordinator.evaluation_data import load_problems, resolve_dataset

    sets = [resolve_dataset(spec, args.eval_dir) for spec in args.dataset or ["math500"]]
    model = args.model or services.attached_model()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model}: cannot load its tokenizer: {e}") from e
    limit_len = services.attached_max_model_len()
    max_prompt = None if limit_len is None else limit_len - settings.max_tokens
    problems, left_out = [], {}
    for name, path in sets:
        found, too_long = load_problems(name, path, tokenizer, args.template, prompt_key=args.prompt_key,
                                        answer_key=args.answer_key, limit=args.limit, max_prompt_length=max_prompt)
        problems += found
        left_out[name] = too_long
    return problems, left_out, tokenizer


# A replica started without a config refuses an engine length its default max_tokens (rlfabric rollout serve's
# own default) cannot fit beside a one-token prompt; eval's requests set max_tokens themselves, so the engine
# just gets at least this many positions.
MIN_ENGINE_LENGTH = 256


def _engine_length(problems: list, max_tokens: int, model: str) -> int:
    from services.common.model_spec import read_config_json

    positions = read_config_json(model).get("max_position_embeddings", 1 << 30)
    needed = max(len(p.prompt_ids) for p in problems) + max_tokens
    if needed > positions:
        raise ValueError(f"the longest prompt plus --max-tokens needs {needed} positions; the model has {positions}: "
                         "lower --max-tokens or --limit the set")
    return min(positions, max(needed, MIN_ENGINE_LENGTH))


def _run(args: argparse.Namespace, settings: Any, services: Any, problems: list, left_out: dict[str, int],
         tokenizer: Any, out: Path) -> int:
    from services.coordinator.evaluation import evaluate, summarize_samples
    from services.launcher.eval_report import print_table, write_outputs

    def progress(done: int, total: int) -> None:
        print(f"eval: {done}/{total} problems sampled and scored", flush=True)

    started = time.perf_counter()
    samples = evaluate(services.replicas(), services.score, problems,
                       lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), settings, progress=progress)
    results = summarize_samples(samples, settings)
    for name, figures in results.items():
        figures["left_out_too_long"] = float(left_out.get(name, 0))
    model = args.model or services.attached_model()
    write_outputs(out, samples, results, settings, model=str(model), template=args.template,
                  seconds=time.perf_counter() - started)
    print_table(results, settings, model=str(model))
    print(f"samples: {out / 'samples.jsonl'}; table: {out / 'results.md'}", flush=True)
    return 0

"""`rlfabric rollout serve`: start one rollout replica (argument parsing here, heavy imports in the func)."""

from __future__ import annotations

import argparse
import sys

from services.common.net import add_network_arguments, advertised_address, check_network_arguments
from services.rollout.options import EngineOptions, SamplingOptions  # no vLLM: cheap

# The engine a replica without a config gets (the schema's generate_config defaults), for the flags' help.
_ENGINE_DEFAULTS = EngineOptions(model="")

# Without a config, a request that sets no max_tokens gets the schema's sampling_config.max_tokens, or half the
# engine when that is shorter: `--max-model-len 128` alone starts, and a request still has half the engine for its
# prompt.
DEFAULT_MAX_TOKENS = SamplingOptions().max_tokens

_DESCRIPTION = (
    "Serves the rlfabric.v1.Rollout gRPC API around one vLLM engine. Engine and sampling defaults come from "
    "the MindSpeed-RL YAML's generate_config (infer_tensor_parallel_size, max_num_seqs, max_model_len, "
    "max_num_batched_tokens, dtype, gpu_memory_utilization, enforce_eager, enable_prefix_caching, "
    "trust_remote_code, sampling_config); without --config, the flags below and the defaults of those keys "
    "(docs/config.md) apply, as for a config that sets none of them. "
    "The replica starts at weights version 0 (as loaded from --model). A usage or config mistake exits 2 with "
    "one line naming it."
)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rollout", help="the rollout service (vLLM generation over gRPC)")
    sub = p.add_subparsers(dest="rollout_command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="serve one rollout replica", description=_DESCRIPTION)
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="MindSpeed-RL YAML (its generate_config section configures the engine)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a YAML key, e.g. --set generate_config.max_num_seqs=32; repeatable")
    p.add_argument("--model", help="HF model folder to load (default: the config's rollout tokenizer/model path)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 picks one (default 0)")
    p.add_argument("--dtype", help="engine dtype, overriding generate_config.dtype (e.g. float32 on CPU; without "
                                   f"--config: {_ENGINE_DEFAULTS.dtype})")
    p.add_argument("--return-routed-experts", action="store_true",
                   help="MoE: every sample carries the experts each MoE layer chose (routing replay); without "
                        "--config only (with it, rlfabric.routing_replay decides)")
    p.add_argument("--tensor-parallel-size", type=int, help="overrides generate_config.infer_tensor_parallel_size "
                                                            f"(without --config: {_ENGINE_DEFAULTS.tensor_parallel_size})")
    p.add_argument("--max-num-seqs", type=int, help="overrides generate_config.max_num_seqs (without --config: "
                                                    f"{_ENGINE_DEFAULTS.max_num_seqs})")
    p.add_argument("--max-model-len", type=int, help="overrides generate_config.max_model_len (without --config: "
                                                     f"{_ENGINE_DEFAULTS.max_model_len})")
    p.add_argument("--max-tokens", type=int,
                   help="response tokens of a request that sets none; overrides "
                        f"generate_config.sampling_config.max_tokens (without --config: {DEFAULT_MAX_TOKENS}, or half "
                        "the engine length when that is shorter)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="samples admitted into the engine at once (default 2 x max_num_seqs)")
    p.add_argument("--max-samples-per-group", type=int, default=None,
                   help="largest PromptGroup.n served; a larger one is refused (default 4 x max_num_seqs)")
    p.add_argument("--cpu-kv-cache-gib", type=int, default=_ENGINE_DEFAULTS.cpu_kv_cache_gib,
                   help=f"CPU only: KV-cache size in GiB (default {_ENGINE_DEFAULTS.cpu_kv_cache_gib})")
    p.add_argument("--num-threads", type=int, default=None, help="CPU only: torch threads for the engine")
    p.add_argument("--seed", type=int, default=_ENGINE_DEFAULTS.seed, help=f"engine seed (default {_ENGINE_DEFAULTS.seed})")
    add_network_arguments(p, default_address="0.0.0.0:50052",
                          redis_help="register this replica in Redis as service 'rollout' (default: $REDIS_URL)")
    p.add_argument("--instance-id", default=None, help="registry instance id (default rollout-HOST-PORT)")
    from services.common.security import add_security_args

    add_security_args(p)  # token guards UpdateWeights, Sleep and Wake (docs/security.md)


def build_options(args: argparse.Namespace):
    """EngineOptions and default SamplingOptions from the config (if any) and the flags.

    Raises:
        DataError: no model, a model folder that is not there, or a config error (ConfigError).
    """
    import dataclasses

    from services.common.errors import DataError
    from services.common.model_paths import require_model_dir
    from services.rollout.options import options_from_config

    extra = {"cpu_kv_cache_gib": args.cpu_kv_cache_gib, "num_threads": args.num_threads, "seed": args.seed}
    if args.config and args.return_routed_experts:
        raise DataError("--return-routed-experts is for a replica without --config; with one, set "
                        "rlfabric.routing_replay: rollout")
    if args.config:
        from services.common.config import load_config

        cfg = load_config(args.config, args.overrides)
        model = args.model or cfg.derived.rollout_tokenizer_name_or_path
        if not model:
            raise DataError("no model: pass --model or set generate_config.tokenizer_name_or_path / "
                            "megatron_training.tokenizer_name_or_path")
        require_model_dir(model, "--model" if args.model else "tokenizer_name_or_path")
        # Routing replay needs each sample's routing from the engine (a MoE model; checked when the config loaded).
        replay = cfg.rlfabric.routing_replay == "rollout"
        engine, sampling = options_from_config(cfg.generate_config, model, return_routed_experts=replay,
                                               batch_invariant=cfg.rlfabric.deterministic, **extra)
    else:
        if not args.model:
            raise DataError("pass --model DIR (or --config YAML)")
        require_model_dir(args.model, "--model")
        from services.common.config import GenerateConfig

        # The schema's generate_config, every key at its default: what a config that sets none of them gives.
        engine, sampling = options_from_config(GenerateConfig(), args.model,
                                               return_routed_experts=args.return_routed_experts, **extra)
    changes = {k: v for k, v in (("dtype", args.dtype), ("tensor_parallel_size", args.tensor_parallel_size),
                                 ("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len))
               if v is not None}
    engine = dataclasses.replace(engine, **changes)
    if args.max_tokens is not None:
        sampling = dataclasses.replace(sampling, max_tokens=args.max_tokens)
    elif not args.config:
        sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, max(1, engine.max_model_len // 2)))
    return engine, sampling


def _usage_error(message: str) -> int:
    print(f"rlfabric rollout serve: {message}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from services.common.errors import DataError
    from services.common.security import server_security
    from services.rollout.options import InvalidSamplingValueError

    # Usage and config mistakes first: one line, exit 2, before anything is logged or imported.
    bad = check_network_arguments(args)
    if bad:
        return _usage_error(bad)
    try:
        engine_options, sampling = build_options(args)
    except DataError as e:  # ConfigError included
        return _usage_error(str(e))
    try:
        sampling.validate(engine_options.max_model_len)
    except InvalidSamplingValueError as e:
        return _usage_error(f"generate_config.sampling_config: {e} (flags: --max-tokens, --max-model-len)")
    try:  # before the engine's imports, so that the auth mode is the first line logged
        server_security(args, "rlfabric.v1.Rollout")  # create_server below serves with this process's token and TLS
    except ValueError as e:
        return _usage_error(str(e))
    from services.common.server import serve_until_signal
    from services.rollout.engine import RolloutEngine
    from services.rollout.server import create_rollout_server

    engine = RolloutEngine(engine_options)
    server, _ = create_rollout_server(engine, sampling, args.address, max_in_flight_samples=args.max_in_flight,
                                      max_samples_per_group=args.max_samples_per_group,
                                      metrics_port=args.metrics_port)
    server.start()
    registration = None
    if args.redis_url:
        from services.common.redis_store import Registry, connect
        from services.common.service_kind import ServiceKind

        endpoint = advertised_address(args, server.port)
        registration = Registry(connect(args.redis_url)).register(
            ServiceKind.ROLLOUT, args.instance_id or f"rollout-{endpoint.replace(':', '-')}", endpoint,
            metadata={"model": engine_options.model, "metrics_port": server.metrics_port},
        )
    print(f"rollout serving on {server.address} (metrics :{server.metrics_port})", flush=True)
    try:
        serve_until_signal(server)
    finally:
        if registration is not None:
            registration.close()
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.rollout", description=_DESCRIPTION)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    from services.common.logs import setup_logging

    setup_logging("INFO")
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())

"""`rlfabric config ...`: check a MindSpeed-RL YAML and list the keys each section accepts.

    rlfabric config check FILE [--override section.key=value ...] [--json]
    rlfabric config keys [SECTION]

`check` prints the resolved configuration (every section, then the derived values) and exits 0, or
prints every error to stderr and exits 2. With --json it prints one JSON document on stdout either
way: {"ok": true, "config": {...}, "warnings": [...]} or {"ok": false, "errors": [...]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_CONFIG_ERROR = 2


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="check MindSpeed-RL YAML configs",
                                   description="Check MindSpeed-RL YAML configs and list their keys.")
    commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)

    check = commands.add_parser("check", help="load, merge and validate a config; print it or its errors",
                                description="Load, merge and validate a MindSpeed-RL YAML. Prints the resolved "
                                            "sections and derived values (exit 0) or every error (exit 2).")
    check.add_argument("file", metavar="FILE", help="the config YAML, e.g. configs/grpo_qwen25_7b_A3.yaml")
    check.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, value parsed as YAML, e.g. rl_config.clip_ratio=0.3 (repeatable)")
    check.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    check.set_defaults(func=run_check)

    keys = commands.add_parser("keys", help="list the keys a section accepts, with defaults and help",
                               description="List the keys each config section accepts, their defaults and help.")
    keys.add_argument("section", nargs="?", metavar="SECTION",
                      help="megatron_training, actor_config, model, rl_config, generate_config, sampling_config, "
                           "profiler_config or msprobe_config (default: all)")
    keys.set_defaults(func=run_keys)


def run_check(args: argparse.Namespace) -> int:
    from services.common.config import ConfigError, load_config

    try:
        cfg = load_config(args.file, overrides=args.override)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "errors": [i.to_dict() for i in exc.issues]}, indent=2))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.json:
        print(json.dumps({"ok": True, "config": cfg.to_dict(), "warnings": cfg.warnings}, indent=2))
        return 0
    print(_render(cfg))
    return 0


def _dump(data: dict) -> str:
    """Block-style YAML with lists kept on one line."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    _Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120).rstrip()


def _render(cfg: Any) -> str:
    data = cfg.to_dict()
    derived = data.pop("derived")
    d = cfg.derived
    a = cfg.actor_config
    lines = [f"# {cfg.path}: resolved configuration (model block: {cfg.model_name})",
             _dump(data),
             "",
             "# derived values (sizes in samples unless named prompts)",
             _dump({"derived": derived}),
             ""]
    # Warnings are already logged by the loader (stderr); they are in the --json document too.
    lines.append(
        f"OK: actor DP = {d.actor_data_parallel_size} ({d.actor_world_size} devices / TP {a.tensor_model_parallel_size}"
        f" x PP {a.pipeline_model_parallel_size} x CP {a.context_parallel_size}), rollout DP = "
        f"{d.rollout_data_parallel_size}, {d.samples_per_iteration} samples per iteration "
        f"({d.prompts_per_iteration} prompts x {cfg.rl_config.n_samples_per_prompt}), "
        f"{d.micro_batches_per_mini_batch} micro-batches per mini-batch")
    return "\n".join(lines)


def run_keys(args: argparse.Namespace) -> int:
    import dataclasses

    from services.common.config import (
        FabricConfig,
        GenerateConfig,
        MegatronConfig,
        ModelConfig,
        MsprobeConfig,
        ProfilerConfig,
        RLConfig,
        SamplingConfig,
    )

    sections = {
        "megatron_training": MegatronConfig, "actor_config": MegatronConfig, "ref_config": MegatronConfig,
        "model": ModelConfig, "rl_config": RLConfig, "generate_config": GenerateConfig,
        "sampling_config": SamplingConfig, "generate_config.sampling_config": SamplingConfig,
        "profiler_config": ProfilerConfig, "msprobe_config": MsprobeConfig, "rlfabric": FabricConfig,
    }
    wanted = [args.section] if args.section else ["megatron_training", "rl_config", "generate_config",
                                                  "sampling_config", "profiler_config", "msprobe_config",
                                                  "rlfabric"]
    for name in wanted:
        cls = sections.get(name)
        if cls is None:
            print(f"error: unknown section `{name}`; choose one of: {', '.join(sections)}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(f"{name}:")
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
                default = "{...}" if dataclasses.is_dataclass(default) else default
            else:
                default = "(required)"
            shown = repr(default) if isinstance(default, str) else json.dumps(default)
            print(f"  {f.name}: {shown}  # {f.metadata.get('help', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: `python -m services.common.config_cli check FILE`."""
    parser = argparse.ArgumentParser(prog="rlfabric")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["config", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

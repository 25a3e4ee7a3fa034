"""`rlfabric config ...`: check a MindSpeed-RL YAML and list the keys each section accepts.

    rlfabric config check FILE [--override section.key=value ...] [--full] [--json] [--require-files]
    rlfabric config keys [SECTION] [--markdown]

`check` prints a summary: the keys the file sets that rlfabric accepts but does not act on (inert keys with
their reason, keys only another platform acts on (vllm-ascend's), keys the algorithm does not read), the model
block's check against the `config.json` it will load (when the model folder is there), the input paths that are
not here (tokenizer, `load` and reference folders, `data_path`: what `rlfabric up` stops on, each with the
command that makes it; services/common/config/input_paths.py), the algorithm and the device count it resolves
to. A config is often checked away from its data (on a laptop), so missing inputs are listed, not failed;
`--require-files` makes them errors (exit 2), the check a cluster node runs before `up`. With --full the resolved configuration follows (every section, then the derived
values; some 800 lines for the 7B config). It exits 0, or prints every error to stderr and exits 2. With --json it prints one JSON document on
stdout either way: {"ok": true, "config": {...}, "keys": {...}, "model_checked": [...], "missing_inputs": [...],
"warnings": [...]} or {"ok": false, "errors": [...]}.
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
    check.add_argument("--full", action="store_true",
                       help="after the summary, print the resolved configuration: every section, derived values")
    check.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    check.add_argument("--require-files", action="store_true",
                       help="fail (exit 2) when a path the run reads is not here: the tokenizer, load and reference "
                            "folders, data_path (by default they are listed, so a config can be checked away from "
                            "its data)")
    check.set_defaults(func=run_check)

    keys = commands.add_parser("keys", help="list the keys a section accepts, with defaults and help",
                               description="List the keys each config section accepts, their defaults and help.")
    keys.add_argument("section", nargs="?", metavar="SECTION",
                      help="megatron_training, actor_config, model, rl_config, generate_config, sampling_config, "
                           "profiler_config or msprobe_config (default: all)")
    keys.add_argument("--markdown", action="store_true",
                      help="print every key's status (read / refused / inert) as the table of docs/config.md")
    keys.set_defaults(func=run_keys)


def run_check(args: argparse.Namespace) -> int:
    import dataclasses

    from services.common.config import ConfigError, check_model_files, load_config
    from services.common.config.catalog import key_report
    from services.common.config.input_paths import missing_input_paths

    try:
        cfg = load_config(args.file, overrides=args.override)
        missing = missing_input_paths(cfg)
        if args.require_files and missing:
            raise ConfigError(missing, str(cfg.path) if cfg.path else None)
        checked = check_model_files(cfg)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "errors": [i.to_dict() for i in exc.issues]}, indent=2))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    report = key_report(cfg)
    if args.json:
        print(json.dumps({"ok": True, "config": cfg.to_dict(), "keys": dataclasses.asdict(report),
                          "model_checked": [str(d / "config.json") for d in checked],
                          "missing_inputs": [i.to_dict() for i in missing], "warnings": cfg.warnings},
                         indent=2))
        return 0
    print(_render(cfg, report, checked, missing, full=args.full))
    return 0


def _dump(data: dict) -> str:
    """Block-style YAML with lists kept on one line."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    _Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120).rstrip()


def _render(cfg: Any, report: Any, checked: list, missing: list, *, full: bool = False) -> str:
    """The summary (what to act on, then the one-line verdict); with `full`, the resolved YAML after it."""
    d = cfg.derived
    a = cfg.actor_config
    shown = "the resolved configuration follows" if full else "--full prints the resolved configuration"
    lines = [f"# {cfg.path}: model block {cfg.model_name} ({shown})",
             *_key_lines(report),
             *(f"model block checked against {p / 'config.json'}: it matches" for p in checked),
             *([] if checked else ["model block not checked: no config.json in the tokenizer or load folder"]),
             *_missing_lines(missing),
             _algorithm_line(cfg)]
    # Warnings are already logged by the loader (stderr); they are in the --json document too.
    lines.append(
        f"OK: actor DP = {d.actor_data_parallel_size} ({d.actor_world_size} devices / TP {a.tensor_model_parallel_size}"
        f" x PP {a.pipeline_model_parallel_size} x CP {a.context_parallel_size}){_experts(cfg)}, rollout DP = "
        f"{d.rollout_data_parallel_size}, {d.samples_per_iteration} samples per iteration "
        f"({d.prompts_per_iteration} prompts x {cfg.rl_config.n_samples_per_prompt}), "
        f"{d.micro_batches_per_mini_batch} micro-batches per mini-batch")
    if full:
        data = cfg.to_dict()
        derived = data.pop("derived")
        lines += ["", f"# {cfg.path}: resolved configuration (model block: {cfg.model_name})", _dump(data), "",
                  "# derived values (sizes in samples unless named prompts)", _dump({"derived": derived})]
    return "\n".join(lines)


def _missing_lines(missing: list) -> list[str]:
    """The input paths not here: listed, not failed (a config checked away from its data); `up` stops on them."""
    if not missing:
        return ["input paths: every folder and dataset the run reads is here"]
    return [f"input paths not here ({len(missing)}; `rlfabric up` stops on them, --require-files fails on them):",
            *(f"  {issue}" for issue in missing)]


def _experts(cfg: Any) -> str:
    """The actor's expert layout for the OK line ("" for a dense model)."""
    a, d = cfg.actor_config, cfg.derived
    if a.num_experts is None:
        return ""
    ep, tp = a.expert_model_parallel_size, a.tensor_model_parallel_size
    layout = f"EP {ep} x TP {tp} (moe_tp_extend_ep)" if a.moe_tp_extend_ep else f"EP {ep}"
    split = "" if d.actor_expert_tensor_parallel_size == 1 else f", each split over TP {tp}"
    return (f", experts: {layout}, {d.actor_experts_per_rank} of {a.num_experts} per rank{split}, "
            f"top-{a.moe_router_topk}")


def _key_lines(report: Any) -> list[str]:
    lines = []
    if report.inert:
        lines.append("# keys this file sets that rlfabric accepts and does not act on (inert), by reason:")
        for reason, keys in report.inert.items():
            lines.append(f"#   {reason}:")
            lines.append(f"#     {', '.join(keys)}")
    if report.inactive_here:
        platforms = sorted(set(report.inactive_here.values()))
        lines.append(f"# keys inactive on this platform (only {', '.join(platforms)} acts on them): "
                     f"{', '.join(report.inactive_here)}")
    for key, why in report.inactive_for_algorithm.items():
        lines.append(f"# {key} is not read: {why}")
    return [*lines, ""] if lines else []


def _algorithm_line(cfg: Any) -> str:
    d, rl = cfg.derived, cfg.rl_config
    stage = cfg.actor_config.stage or "ray_grpo (unset)"
    if d.use_kl_loss:
        kl = f"KL term {rl.kl_penalty} x {rl.init_kl_coef} ({rl.kl_ctrl_type}), reference world size {d.ref_world_size}"
    elif d.use_reference:
        kl = (f"KL in the reward {rl.kl_penalty} x {rl.init_kl_coef} ({rl.kl_ctrl_type}), reference world size "
              f"{d.ref_world_size}")
    else:
        kl = "no KL term, no reference model"
    if d.critic_trainer:
        kl += (f"; critic world size {d.critic_world_size}, GAE (gamma {rl.gamma}, lam {rl.lam}), value clip "
               f"{rl.cliprange_value}")
    clip = (f"clip [1 - {rl.clip_ratio_low}, 1 + {rl.clip_ratio_high}]" if rl.clip_higher_enable
            else f"clip {rl.clip_ratio}")
    loss = "token-level loss" if rl.token_level_loss or d.algorithm != "dapo" else "sequence-mean-token-mean loss"
    extras = [f"overlong shaping (buffer {rl.overlong_buffer})" if rl.overlong_buffer_enable else "",
              f"dynamic sampling to {rl.filter_groups_train_batch_size} prompts" if d.dynamic_sampling else ""]
    names = ["actor", *(["reference"] if d.use_reference else [])]
    if rl.use_integrated_worker:
        mode = f"integrated: {', '.join(names)} and rollout share them{', the critic on its own' if d.critic_trainer else ''}"
    else:
        mode = f"disaggregated: {', '.join(names + (['critic'] if d.critic_trainer else []))} and rollout"
    return (f"algorithm: {(d.algorithm or '?').upper()} (stage: {stage}): {kl}; {loss}, {clip}"
            f"{''.join(', ' + e for e in extras if e)}; world size {d.world_size} devices ({mode})")


def run_keys(args: argparse.Namespace) -> int:
    import dataclasses

    from services.common.config import SECTIONS
    from services.common.config.catalog import render_status_table

    if args.markdown:
        sys.stdout.write(render_status_table())
        return 0
    sections = {**SECTIONS, "sampling_config": SECTIONS["generate_config.sampling_config"]}
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
            status = f.metadata.get("status")
            print(f"  {f.name}: {shown}  # {f.metadata.get('help', '')} [{status.kind if status else 'no status'}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: `python -m services.common.config_cli check FILE`."""
    parser = argparse.ArgumentParser(prog="rlfabric")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["config", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""`rlfabric convert ...` and `rlfabric trainer serve`: argument parsing only, heavy imports inside funcs."""

from __future__ import annotations

import argparse
import sys


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    conv = subparsers.add_parser("convert", help="convert weights between Hugging Face and Megatron-core layouts")
    conv_sub = conv.add_subparsers(dest="convert_command", metavar="DIRECTION", required=True)

    h2m = conv_sub.add_parser("hf2mcore", help="HF folder -> Megatron checkpoint (release/mp_rank_*)")
    h2m.add_argument("hf_dir", help="Hugging Face model folder (config.json + *.safetensors)")
    h2m.add_argument("out_dir", help="output Megatron checkpoint directory (use it as `load`)")
    h2m.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size (default: 1)")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size (default: 1)")
    h2m.add_argument("--quiet", action="store_true", help="no progress output")
    h2m.set_defaults(func=_hf2mcore)

    m2h = conv_sub.add_parser("mcore2hf", help="Megatron checkpoint -> complete HF folder")
    m2h.add_argument("mcore_dir", help="Megatron checkpoint directory (holds latest_checkpointed_iteration.txt)")
    m2h.add_argument("out_dir", help="output Hugging Face folder")
    m2h.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the latest)")
    m2h.add_argument(
        "--hf-assets", default=None,
        help="HF folder to take config/tokenizer files from (default: MCORE_DIR/hf_assets)",
    )
    m2h.add_argument("--quiet", action="store_true", help="no progress output")
    m2h.set_defaults(func=_mcore2hf)

    tr = subparsers.add_parser("trainer", help="the trainer service (Megatron-core actor / reference)")
    tr_sub = tr.add_subparsers(dest="trainer_command", metavar="COMMAND", required=True)
    serve = tr_sub.add_parser("serve", help="start one process per rank; rank 0 serves the Trainer gRPC API")
    from services.trainer.launch import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)


def _progress(quiet: bool):
    def report(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return report


def _hf2mcore(args: argparse.Namespace) -> int:
    from services.trainer.convert import convert_hf_to_mcore

    try:
        root = convert_hf_to_mcore(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, progress=_progress(args.quiet))
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(root)
    return 0


def _mcore2hf(args: argparse.Namespace) -> int:
    from services.trainer.convert import convert_mcore_to_hf

    try:
        out = convert_mcore_to_hf(
            args.mcore_dir, args.out_dir, iteration=args.iteration, hf_assets=args.hf_assets,
            progress=_progress(args.quiet),
        )
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from services.trainer.launch import serve_group

    return serve_group(args)

"""The trainer's command lines, the one argparse home: `rlfabric convert ...`, `rlfabric trainer serve|rank`.

`trainer serve` starts one process per rank on this host and supervises them (launch.py); each of those
runs `trainer rank`, which is also what torchrun or a Kubernetes pod runs (the environment gives RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Both take the same flags. Argument parsing only; heavy imports
happen inside the funcs.
"""

from __future__ import annotations

import argparse
import sys

from services.common.net import add_network_arguments
from services.trainer.roles import ACTOR, ROLES


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    conv = subparsers.add_parser("convert", help="convert weights between Hugging Face and Megatron-core layouts")
    conv_sub = conv.add_subparsers(dest="convert_command", metavar="DIRECTION", required=True)

    h2m = conv_sub.add_parser("hf2mcore", help="HF folder -> Megatron checkpoint (release/mp_rank_*)")
    h2m.add_argument("hf_dir", help="Hugging Face model folder (config.json + *.safetensors)")
    h2m.add_argument("out_dir", help="output Megatron checkpoint directory (use it as `load`)")
    h2m.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size (default: 1)")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size (default: 1)")
    h2m.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                     help="expert_model_parallel_size: experts split over EP ranks, one mp_rank_*_EEE folder each "
                          "(MoE models; default: 1)")
    add_stage_layout_arguments(h2m)
    h2m.add_argument("--quiet", action="store_true", help="no progress output")
    h2m.set_defaults(func=_convert)

    m2h = conv_sub.add_parser("mcore2hf", help="Megatron checkpoint -> complete HF folder")
    m2h.add_argument("mcore_dir", help="Megatron checkpoint directory (holds latest_checkpointed_iteration.txt)")
    m2h.add_argument("out_dir", help="output Hugging Face folder")
    m2h.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the latest)")
    m2h.add_argument(
        "--hf-assets", default=None,
        help="HF folder to take config/tokenizer files from (default: MCORE_DIR/hf_assets)",
    )
    add_stage_layout_arguments(m2h, checked=True)
    m2h.add_argument("--quiet", action="store_true", help="no progress output")
    m2h.set_defaults(func=_convert)

    tr = subparsers.add_parser("trainer", help="the trainer service (Megatron-core actor / reference / critic)")
    tr_sub = tr.add_subparsers(dest="trainer_command", metavar="COMMAND", required=True)
    serve = tr_sub.add_parser("serve", help="start one process per rank; rank 0 serves the Trainer gRPC API")
    add_group_arguments(serve)
    add_multi_host_arguments(serve)
    serve.add_argument("--threads", type=int, default=1, metavar="N",
                       help="torch intra-op threads of each rank (default 1: the services of one host share its "
                            "cores; more helps a trainer that runs while the others wait, as in synchronous GRPO)")
    serve.set_defaults(func=_serve)
    rank = tr_sub.add_parser("rank", help="run one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the "
                                          "environment, as `trainer serve` or torchrun set them)")
    add_group_arguments(rank)
    rank.set_defaults(func=_rank)


def add_stage_layout_arguments(p: argparse.ArgumentParser, *, checked: bool = False) -> None:
    """MindSpeed's uneven pipeline stages, as its converter and the YAML keys num_layer_list / noop_layers say them."""
    why = " (checked against what the checkpoint holds)" if checked else ""
    p.add_argument("--num-layer-list", default=None, metavar="A,B,...",
                   help=f"layers of each pipeline stage, no-op layers counted (num_layer_list){why}")
    p.add_argument("--noop-layers", default=None, metavar="I,J,...",
                   help="global indices of identity layers, counted among the layers (noop_layers): the model's "
                        f"layers are placed as if they were layers{why}")


def add_multi_host_arguments(p: argparse.ArgumentParser) -> None:
    """`trainer serve` only: where its ranks sit in a group that spans hosts (with --master-addr and --master-port).
    (`trainer rank` under torchrun or Kubernetes gets the same from RANK / WORLD_SIZE / MASTER_ADDR and the
    backends' *_SOCKET_IFNAME.)"""
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts the group spans; `trainer serve` on each starts world-size / nnodes ranks (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index in the group (0 hosts rank 0)")
    p.add_argument("--socket-ifname", default=None, metavar="IFNAME",
                   help="network interface of the collectives (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME of "
                        "every rank; the seed's SOCKET_IFNAME); default: the backends' own choice")


def add_group_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `trainer serve` and `trainer rank` (serve hands them on to every rank)."""
    p.add_argument("--config", default=None, help="MindSpeed-RL YAML (actor_config / rl_config are read)")
    p.add_argument("--override", action="append", default=[], help="dotted config override, repeatable")
    p.add_argument("--role", default=ACTOR, choices=ROLES,
                   help="model role (default: actor); critic: PPO's value model, from the config's critic_config")
    p.add_argument("--hf-dir", default=None, help="HF model folder (architecture, tokenizer, initial weights)")
    p.add_argument("--load", default=None, help="Megatron checkpoint dir to load (overrides the config)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: config or 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: config or 1)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert parallel size (MoE models; default 1): EP x TP x PP must divide the world size")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks in the group (default: pp * lcm(tp, ep * expert-TP)); with --nnodes, each host starts "
                        "world-size / nnodes")
    p.add_argument("--port-file", default=None, help="write rank 0's bound port here once serving")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port of rank 0 (0 = any free)")
    p.add_argument("--master-port", type=int, default=None, help="torch.distributed port (default: a free one)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="update micro-batch rows (without --config)")
    p.add_argument("--forward-micro-batch-size", type=int, default=None, help="log-prob micro-batch rows")
    p.add_argument("--lr", type=float, default=None, help="learning rate (without --config)")
    p.add_argument("--kl-coef", type=float, default=None, help="KL coefficient (default: config init_kl_coef)")
    p.add_argument("--grace-s", type=float, default=5.0, help="seconds before survivors of a dead rank are stopped")
    add_network_arguments(p, default_address="127.0.0.1:0",
                          redis_help="register rank 0 in Redis as service 'trainer' with its role (what the "
                                     "coordinator discovers; default: $REDIS_URL)")
    p.add_argument("--instance-id", default=None, help="registry instance id (default: trainer-ROLE-PID)")
    p.add_argument("--lease-s", type=float, default=10.0, help="registry lease in seconds (heartbeat every lease/3)")
    p.add_argument("--checkpoint-root", action="append", default=[], metavar="DIR",
                   help="SaveCheckpoint/LoadCheckpoint may use directories under DIR only (repeatable; the "
                        "config's save and load directories and --load always count)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="torch.distributed rendezvous host: the address the store of `trainer serve` binds on node 0, "
                        "and what the other nodes dial (default 127.0.0.1: its ranks all run on this host)")
    p.add_argument("--master-listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # trainer serve -> rank 0
    from services.common.security import add_security_args

    add_security_args(p)


def _convert(args: argparse.Namespace) -> int:
    from services.common.model_paths import require_model_dir

    # A missing input is named at once, before torch loads (a DataError: `rlfabric` prints one line, exits 2).
    if args.convert_command == "hf2mcore":
        require_model_dir(args.hf_dir, "HF_DIR")
    else:
        require_model_dir(args.mcore_dir, "MCORE_DIR", needs=("latest_checkpointed_iteration.txt",),
                          kind="a Megatron checkpoint folder (`rlfabric convert hf2mcore` or a trainer's save)")
    from services.trainer.convert import convert_hf_to_mcore, convert_mcore_to_hf

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        if args.convert_command == "hf2mcore":
            out = convert_hf_to_mcore(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep,
                                      progress=progress, num_layer_list=args.num_layer_list,
                                      noop_layers=args.noop_layers)
        else:
            out = convert_mcore_to_hf(args.mcore_dir, args.out_dir, iteration=args.iteration,
                                      hf_assets=args.hf_assets, progress=progress,
                                      num_layer_list=args.num_layer_list, noop_layers=args.noop_layers)
    except (FileNotFoundError, ValueError, KeyError) as e:  # an input that is not there or not what it should be
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _check_hf_dir(args: argparse.Namespace) -> None:
    """A missing --hf-dir is named here, at once, not in a rank's traceback after torch has loaded (a DataError:
    `rlfabric` prints it as one line and exits 2)."""
    if args.hf_dir:
        from services.common.model_paths import require_model_dir

        require_model_dir(args.hf_dir, "--hf-dir")


def _serve(args: argparse.Namespace) -> int:
    from services.trainer.launch import serve_group

    _check_hf_dir(args)
    return serve_group(args)


def _rank(args: argparse.Namespace) -> int:
    from services.trainer.launch import run_rank

    _check_hf_dir(args)
    return run_rank(args)

"""Run a trainer group: one process per rank (torchrun-style), rank 0 serving gRPC.

`rlfabric trainer serve` (serve_group) spawns `rlfabric trainer rank ...` (run_rank) once per rank on
this host with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, and watches them: when any rank
exits, the others get SIGTERM after a grace period (rank 0 has by then failed in-flight calls with
UNAVAILABLE), so a supervisor sees the group exit and can restart it. Under torchrun or Kubernetes
the same `rank` entry point runs with the environment those set. The flags are parsed in cli.py.

This module imports only the standard library (and roles.py, which does too) at top level.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.processes import EXIT_REASON, describe_exit, die_with_parent
from services.trainer.roles import megatron_section

logger = logging.getLogger(__name__)


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line of one rank (same for all ranks; the rank comes from the environment)."""
    argv = [sys.executable, "-m", "services.cli", "--log-level", getattr(args, "log_level", "WARNING")]
    if getattr(args, "log_json", False):
        argv.append("--log-json")
    argv += ["trainer", "rank"]
    from services.common.security import SecretFile

    for key, value in vars(args).items():
        if isinstance(value, SecretFile):  # read from a file whose path (another key) is passed on instead
            continue
        if key in ("func", "command", "trainer_command", "log_level", "log_json", "world_size", "grace_s",
                   "master_addr", "nnodes", "node_rank", "socket_ifname", "threads"):  # the last five reach ranks as env
            continue
        if value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        elif value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def rank_env(args: argparse.Namespace, rank: int, world: int, local_rank: int, master_port: int) -> dict[str, str]:
    """The environment of one rank: torch.distributed's variables, the collectives' interface, its threads."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
               MASTER_ADDR=args.master_addr, MASTER_PORT=str(master_port), OMP_NUM_THREADS=str(args.threads))
    if args.socket_ifname:
        env.update(GLOO_SOCKET_IFNAME=args.socket_ifname, NCCL_SOCKET_IFNAME=args.socket_ifname)
    return env


def serve_group(args: argparse.Namespace) -> int:
    """Spawn every rank and supervise them; returns the group's exit code."""
    import socket

    from services.common.security import server_security

    if args.threads < 1:
        print(f"rlfabric trainer serve: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    tp, pp = args.tp, args.pp
    if args.config and not (tp and pp):  # a bad config is the one line its error is, before any other output
        from services.common.config import load_config  # no torch: cheap

        cfg = load_config(args.config, overrides=args.override)
        try:
            mt = megatron_section(cfg, args.role)
        except ValueError as e:
            print(f"rlfabric trainer serve: {e}", file=sys.stderr)
            return 2
        tp, pp = tp or mt.tensor_model_parallel_size, pp or mt.pipeline_model_parallel_size
    try:
        server_security(args, "rlfabric.v1.Trainer")  # refuse bad security flags here, once, not in every rank
    except ValueError as e:
        print(f"rlfabric trainer serve: {e}", file=sys.stderr)
        return 2
    tp, pp = tp or 1, pp or 1
    ep, etp = _expert_sizes(args)
    # The smallest world that holds the dense layout (TP x PP) and the experts' (expert-TP x EP x PP).
    world = args.world_size or pp * math.lcm(tp, (etp or tp) * ep)
    bad = _check_nodes(args, world)
    if bad:
        print(f"rlfabric trainer serve: {bad}", file=sys.stderr)
        return 2
    local = world // args.nnodes
    # On node 0 the torch.distributed store listens on this socket, bound to --master-addr only (a store torch
    # makes itself listens on every interface); rank 0 inherits it. Binding here also closes the free-port race.
    store_socket = socket.create_server((args.master_addr, args.master_port or 0), backlog=128) \
        if args.node_rank == 0 else None
    master_port = store_socket.getsockname()[1] if store_socket else args.master_port
    argv = rank_argv(argparse.Namespace(**{**vars(args), "tp": tp, "pp": pp}))
    procs: list[subprocess.Popen] = []
    for local_rank in range(local):
        rank = args.node_rank * local + local_rank
        env = rank_env(args, rank, world, local_rank, master_port)
        fds = [store_socket.fileno()] if rank == 0 and store_socket else []
        # A rank without its leader serves no one: it dies with `trainer serve`, even a SIGKILLed one, so no
        # rank is left holding its port and memory (in the leader's process group, which `stop` ends).
        procs.append(subprocess.Popen([*argv, "--master-listen-fd", str(fds[0])] if fds else argv, env=env,
                                      pass_fds=fds, preexec_fn=die_with_parent(own_session=False)))
    if store_socket:
        store_socket.close()
    stopping = False

    def stop(signum, _frame):
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = supervise(procs, grace_s=args.grace_s, first_rank=args.node_rank * local)
    return 0 if stopping else code


def _check_nodes(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with the multi-host flags, naming the flag; None when they fit."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})"
    if world % args.nnodes:
        return f"world size {world} is not divisible by --nnodes {args.nnodes}"
    if args.nnodes > 1 and not args.master_port:
        return "--master-port is required with --nnodes > 1 (every host must name the same one)"
    if args.nnodes > 1 and args.master_addr in ("127.0.0.1", "localhost"):
        return "--master-addr must be node 0's address as the other hosts reach it (not loopback) with --nnodes > 1"
    return None


def supervise(procs: list[subprocess.Popen], *, grace_s: float, first_rank: int = 0) -> int:
    """Wait for the ranks; once one exits, give the rest `grace_s`, then SIGTERM (then SIGKILL).

    `procs` are ranks `first_rank`, `first_rank` + 1, ... The first rank to exit is the group's story: it is named on stderr as the group's `EXIT_REASON` line,
    and its code is the group's (a signal's death as a shell reports it, 128 + the signal number).
    """
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    first = next(p for p in procs if p.poll() is not None)
    if first.returncode:
        print(f"{EXIT_REASON}rank {first_rank + procs.index(first)} (pid {first.pid}) {describe_exit(first.returncode)}; "
              "the group stops its other ranks", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    code = first.returncode or max((p.returncode or 0) for p in procs)
    return 128 - code if code < 0 else code


def run_rank(args: argparse.Namespace) -> int:
    """One rank: join the group, build the worker; rank 0 serves gRPC, the others follow the bus."""
    import torch

    from services.common import determinism
    from services.common.security import server_security
    from services.trainer import parallel
    from services.trainer.group import CommandBus, GroupExecutor, Liveness
    from services.trainer.handlers import worker_handlers
    from services.trainer.server import create_trainer_server
    from services.trainer.worker import TrainerWorker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # This process's token and TLS: its server's and its weight pushes'. Rank 0 says the auth mode, unless
    # `trainer serve` (which hands it --master-listen-fd) already did.
    standalone_leader = os.environ.get("RANK", "0") == "0" and args.master_listen_fd is None
    server_security(args, "rlfabric.v1.Trainer" if standalone_leader else None)
    opts, kl_coef, tp, pp = _worker_options(args)
    if opts.deterministic:
        determinism.use_deterministic_kernels()
    ep, etp = _expert_sizes(args)
    roots = checkpoint_roots(args, opts)
    parallel.init_distributed(store=_bound_store(args))
    parallel.init_model_parallel(tp, pp, seed=opts.update.seed, ep=ep, etp=etp)
    worker = TrainerWorker(opts)
    liveness = Liveness()
    liveness.start()
    bus = CommandBus(worker_handlers(worker))
    if torch.distributed.get_rank() != 0:
        try:
            bus.serve_forever()
        finally:
            liveness.close()
            parallel.shutdown()
        return 0
    from contextlib import nullcontext

    from services.common.redis_store import Registry, connect
    from services.common.server import serve_until_signal
    from services.common.service_kind import ServiceKind

    registry = Registry(connect(args.redis_url)) if args.redis_url else None
    executor = GroupExecutor(bus, liveness)
    server, _ = create_trainer_server(
        executor, worker, address=args.address, kl_coef=kl_coef, metrics_port=args.metrics_port,
        checkpoint_roots=roots,
        push_targets=registry and (lambda: {m.endpoint for m in registry.members(ServiceKind.ROLLOUT)}),
    )
    server.start()
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, args.port_file)
    logger.info("trainer (%s, TP=%d PP=%d DP=%d) serving on %s", opts.role, tp, pp, worker.layout.dp, server.address)
    registration = nullcontext()
    if registry is not None:
        from services.common.net import advertised_address

        registration = registry.register(
            ServiceKind.TRAINER, args.instance_id or f"trainer-{opts.role}-{os.getpid()}",
            advertised_address(args, server.port), lease_s=args.lease_s,
            metadata={"role": opts.role, "tp": tp, "pp": pp, "dp": worker.layout.dp})
    try:
        with registration:
            serve_until_signal(server)
    finally:
        executor.shutdown()
        liveness.close()
        if executor.broken is None:
            parallel.shutdown()
    return 0 if executor.broken is None else 1


def _bound_store(args: argparse.Namespace):
    """Rank 0's TCPStore on the listening socket `trainer serve` handed down (None: torch makes its own)."""
    fd = getattr(args, "master_listen_fd", None)
    if fd is None or int(os.environ.get("RANK", "0")) != 0:
        return None
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ.get("WORLD_SIZE", "1")), True, timeout=datetime.timedelta(seconds=600),
                          wait_for_workers=False, master_listen_fd=fd)
    # The other ranks join through `init_method=tcp://`, whose store init_process_group prefixes so; a store
    # passed in is used as is, so rank 0 must use the same prefix or the ranks never meet.
    return dist.PrefixStore("default_pg", store)


def checkpoint_roots(args: argparse.Namespace, opts) -> list[Path]:
    """Where SaveCheckpoint/LoadCheckpoint may read and write: --checkpoint-root, the config's save and load."""
    found = [*args.checkpoint_root, opts.load]
    if args.config:
        from services.common.config import load_config

        cfg = load_config(args.config, overrides=args.override)
        mt = megatron_section(cfg, args.role)
        found += [getattr(mt, "save", None), getattr(mt, "load", None)]
    return [Path(p).resolve() for p in dict.fromkeys(found) if p]


def _expert_sizes(args: argparse.Namespace) -> tuple[int, int | None]:
    """(expert parallel size, expert tensor parallel size or None for TP): --ep, else the config's derived
    actor_expert_parallel_size / actor_expert_tensor_parallel_size (MindSpeed's moe_tp_extend_ep folded in), else 1."""
    if args.ep:
        return args.ep, None
    if args.config:
        from services.common.config import load_config

        d = load_config(args.config, overrides=args.override).derived
        return d.actor_expert_parallel_size, d.actor_expert_tensor_parallel_size
    return 1, None


def _worker_options(args: argparse.Namespace):
    import dataclasses

    from services.trainer.worker import WorkerOptions

    kl_coef = 0.0
    if args.config:
        from services.common.config import load_config
        from services.trainer.options import worker_options_from_config

        cfg = load_config(args.config, overrides=args.override)
        opts, kl_coef = worker_options_from_config(cfg, args.role, hf_dir=args.hf_dir)
        mt = megatron_section(cfg, args.role)
        tp, pp = mt.tensor_model_parallel_size, mt.pipeline_model_parallel_size
    else:
        from services.trainer.update import UpdateOptions

        # Without a config, --kl-coef plays init_kl_coef: a KL term (and required ref_log_probs) iff it is non-zero.
        opts = WorkerOptions(role=args.role, hf_dir=args.hf_dir, finetune=True,
                             update=UpdateOptions(use_kl=bool(args.kl_coef)))
        tp, pp = 1, 1
    changes = {}
    if args.load:
        changes["load"] = args.load
    if args.forward_micro_batch_size:
        changes["forward_micro_batch_size"] = args.forward_micro_batch_size
    if args.micro_batch_size:
        changes["update"] = dataclasses.replace(opts.update, micro_batch_size=args.micro_batch_size)
    if args.lr is not None:
        changes["optimizer"] = dataclasses.replace(opts.optimizer, lr=args.lr)
    opts = dataclasses.replace(opts, **changes)
    if args.kl_coef is not None:
        kl_coef = args.kl_coef
    return opts, kl_coef, args.tp or tp, args.pp or pp

"""The bind / advertise / Redis flags every `serve` command takes (services/common/net.py), and the trainer's
multi-host flags, refused with a message naming the flag when they cannot work."""

from __future__ import annotations

import argparse
import socket

import pytest

from services.cli import build_parser
from services.common.net import advertised_address, check_network_arguments, join_host_port, split_host_port

SERVE_COMMANDS = [["coordinator", "serve"], ["rollout", "serve"], ["trainer", "serve"], ["trainer", "rank"],
                  ["reward", "serve"]]


def ns(address: str, advertise: str | None = None, interface: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(address=address, advertise_address=advertise, advertise_interface=interface)


@pytest.mark.parametrize("command", SERVE_COMMANDS, ids=" ".join)
def test_every_serve_command_takes_the_same_network_flags(command: list[str], monkeypatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://10.0.0.9:6379/0")
    args = build_parser().parse_args([*command, "--address", "0.0.0.0:0", "--advertise-address", "10.0.0.5",
                                      "--advertise-interface", "lo"])
    assert (args.address, args.advertise_address, args.advertise_interface) == ("0.0.0.0:0", "10.0.0.5", "lo")
    assert build_parser().parse_args(command).redis_url == "redis://10.0.0.9:6379/0"  # $REDIS_URL everywhere


@pytest.mark.parametrize(("args", "port", "expected"), [
    (ns("10.1.2.3:0"), 4242, "10.1.2.3:4242"),  # the bound host
    (ns("0.0.0.0:0", "10.9.9.9"), 4242, "10.9.9.9:4242"),  # advertised host, bound port
    (ns("0.0.0.0:50052", "gw.example:443"), 50052, "gw.example:443"),  # a proxy in front: its port
    (ns("0.0.0.0:0", interface="lo"), 7, "127.0.0.1:7"),  # CURRENT_IP by interface
    (ns("[::]:0", "fd00::5"), 9, "[fd00::5]:9"),  # IPv6 gets its brackets
    (ns("0.0.0.0:0"), 9, f"{socket.gethostname()}:9"),  # wildcard, nothing said: this host's name
])
def test_advertised_address(args: argparse.Namespace, port: int, expected: str) -> None:
    assert advertised_address(args, port) == expected


def test_multi_host_flags_belong_to_trainer_serve_and_reach_ranks_as_environment(monkeypatch) -> None:
    from services.trainer.launch import rank_argv, rank_env

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `rlfabric up` gives its children: the flag wins
    serve = build_parser().parse_args(["trainer", "serve", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                       "10.0.0.2", "--socket-ifname", "eth0", "--advertise-interface", "eth0",
                                       "--threads", "2"])
    argv = rank_argv(serve)
    assert "--nnodes" not in argv and "--socket-ifname" not in argv and "--master-addr" not in argv
    assert "--threads" not in argv
    env = rank_env(serve, 3, 4, 1, 29500)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "3", "4", "1", "10.0.0.2", "29500")
    assert (env["GLOO_SOCKET_IFNAME"], env["OMP_NUM_THREADS"]) == ("eth0", "2")
    assert rank_env(build_parser().parse_args(["trainer", "serve"]), 0, 1, 0, 1)["OMP_NUM_THREADS"] == "1"
    assert argv[argv.index("--advertise-interface") + 1] == "eth0"
    with pytest.raises(SystemExit):  # `trainer rank` takes them from the environment, not as (inert) flags
        build_parser().parse_args(["trainer", "rank", "--nnodes", "2"])


def test_bad_network_flags_are_named() -> None:
    assert "no IPv4 address" in check_network_arguments(ns("0.0.0.0:0", interface="rlf-no-such-if"))
    assert "--advertise-interface rlf-no-such-if" in check_network_arguments(ns("0.0.0.0:0", interface="rlf-no-such-if"))
    assert "port must be 0-65535" in check_network_arguments(ns("0.0.0.0:99999"))
    assert "no host" in check_network_arguments(ns("0.0.0.0:0", ":80"))
    assert check_network_arguments(ns("127.0.0.1:0", "[fd00::1]:80")) is None
    assert split_host_port("[fd00::1]") == ("fd00::1", None) and join_host_port("h", 1) == "h:1"


@pytest.mark.parametrize(("flags", "message"), [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be in [0, --nnodes 2)"),
    (["--nnodes", "2", "--world-size", "3", "--master-port", "1", "--master-addr", "10.0.0.1"],
     "world size 3 is not divisible by --nnodes 2"),
    (["--nnodes", "2", "--world-size", "2", "--master-addr", "10.0.0.1"], "--master-port is required"),
    (["--nnodes", "2", "--world-size", "2", "--master-port", "1"], "--master-addr must be node 0's address"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
])
def test_trainer_serve_refuses_multi_host_flags_that_cannot_work(flags: list[str], message: str, capsys) -> None:
    args = build_parser().parse_args(["trainer", "serve", "--tp", "1", "--pp", "1", *flags])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err

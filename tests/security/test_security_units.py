"""Security building blocks, each against the real thing: secret files and flags, a password-protected
redis-server, the registry's handling of entries anyone with Redis access could write, checkpoint confinement,
the guarded-method table of every server, and the torch.distributed store's bind."""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import redis

from services.common.security import (
    GUARDED_METHODS,
    SecretFile,
    SecretFileError,
    add_security_args,
    read_secret_file,
    redact_url,
    resolve_secrets,
    write_secret_file,
)


def _parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", default=None)
    add_security_args(p, **kwargs)
    return p


def test_token_file_is_read_and_never_printed(tmp_path: Path) -> None:
    token = write_secret_file(tmp_path / "token", "0123abcd")
    assert token.stat().st_mode & 0o777 == 0o600
    args = resolve_secrets(_parser().parse_args(["--auth-token-file", str(token)]))
    assert args.auth_token == "0123abcd" and isinstance(args.auth_token, SecretFile)
    assert "0123abcd" not in repr(args) and str(token) in repr(args)
    # A trainer group hands it to its other ranks pickled (their pushes carry it): it arrives whole.
    copy = pickle.loads(pickle.dumps(args.auth_token))
    assert copy == "0123abcd" and isinstance(copy, SecretFile) and copy.path == args.auth_token.path


def test_empty_or_missing_secret_files_are_refused_world_readable_ones_named(tmp_path: Path, caplog) -> None:
    open_file = tmp_path / "open"
    open_file.write_text("x")
    open_file.chmod(0o644)
    assert read_secret_file(open_file, "--auth-token-file") == "x"
    assert "--auth-token-file" in caplog.text and "readable by every user" in caplog.text
    empty = write_secret_file(tmp_path / "empty", "")
    with pytest.raises(SecretFileError, match="empty"):
        read_secret_file(empty, "--redis-url-file")
    with pytest.raises(SecretFileError, match="--auth-token-file .*missing: cannot read it"):
        resolve_secrets(_parser().parse_args(["--auth-token-file", str(tmp_path / "missing")]))


def test_redis_url_file_overrides_the_flag_and_rank_argv_passes_paths(tmp_path: Path) -> None:
    url_file = write_secret_file(tmp_path / "url", "redis://:pw@127.0.0.1:1/0")
    token = write_secret_file(tmp_path / "token", "s3cret-token")
    args = resolve_secrets(_parser().parse_args(["--redis-url-file", str(url_file), "--auth-token-file", str(token)]))
    assert args.redis_url == "redis://:pw@127.0.0.1:1/0"
    with pytest.raises(ValueError, match="not both"):
        resolve_secrets(_parser().parse_args(["--redis-url-file", str(url_file), "--redis-url", "redis://x:1"]))
    from services.trainer.cli import add_group_arguments
    from services.trainer.launch import rank_argv

    p = argparse.ArgumentParser()
    add_group_arguments(p)
    argv = rank_argv(resolve_secrets(p.parse_args(["--redis-url-file", str(url_file), "--auth-token-file", str(token)])))
    joined = " ".join(argv)
    assert "pw@" not in joined and "s3cret-token" not in joined
    assert f"--redis-url-file {url_file}" in joined and f"--auth-token-file {token}" in joined


def test_redact_url() -> None:
    assert redact_url("redis://:pw@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_private_redis_requires_its_password_and_hides_it(tmp_path: Path) -> None:
    import psutil

    from services.common.redis_store import start_private_redis

    with start_private_redis(str(tmp_path / "r"), password="pw0123456789") as server:
        assert ":pw0123456789@" in server.url
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).set("rlfabric:members:reward:x", "{}")
        assert redis.Redis.from_url(server.url).ping()
        assert "pw0123456789" not in " ".join(psutil.Process(server.process.pid).cmdline())
        conf = next((tmp_path / "r").glob("*.conf"))
        assert conf.stat().st_mode & 0o077 == 0


def test_a_malformed_registry_entry_is_skipped_not_fatal(redis_url: str) -> None:
    from services.common.redis_store import Registry, connect

    client = connect(redis_url)
    registry = Registry(client, prefix="sec-test")
    with registry.register("reward", "good", "127.0.0.1:5000"):
        bad = {"junk": "not json{", "list": json.dumps([1, 2]), "noport": json.dumps({"endpoint": "host"}),
               "meta": json.dumps({"endpoint": "h:1", "metadata": [1]}),
               "url": json.dumps({"endpoint": "http://evil/x:1"})}
        for name, value in bad.items():
            client.set(f"sec-test:members:reward:{name}", value, px=60_000)
        try:
            members = registry.members("reward")
        finally:
            client.delete(*[f"sec-test:members:reward:{n}" for n in bad])
    assert [(m.instance_id, m.endpoint) for m in members] == [("good", "127.0.0.1:5000")]


def test_checkpoint_directories_are_confined(tmp_path: Path) -> None:
    from services.trainer.checkpoint import CheckpointPathError, confine

    root = tmp_path / "run" / "ckpt"
    assert confine(str(root / "iter"), [root]) == (root / "iter").resolve()
    for escape in (str(tmp_path / "elsewhere"), str(root / ".." / ".." / "x"), "/etc"):
        with pytest.raises(CheckpointPathError, match="outside the directories"):
            confine(escape, [root])
    (tmp_path / "link").symlink_to("/tmp")
    with pytest.raises(CheckpointPathError):
        confine(str(tmp_path / "link" / "x"), [root])
    assert confine("/anywhere", []) == Path("/anywhere")  # a bare trainer (no config, no root) is unconfined


def test_every_mutating_rpc_is_guarded() -> None:
    """The table against the protos: every rpc of our services is guarded or listed as read-only here."""
    from rlfabric.v1 import coordinator_pb2, reward_pb2, rollout_pb2, tool_pb2, trainer_pb2

    open_rpcs = {"rlfabric.v1.Trainer": {"Info"}, "rlfabric.v1.Rollout": {"Info", "Generate"},
                 "rlfabric.v1.Coordinator": {"GetRun", "StreamMetrics"},
                 "rlfabric.v1.Reward": {"Score", "ListVerifiers"}, "rlfabric.v1.Tool": {"ListTools"}}
    for module in (coordinator_pb2, reward_pb2, rollout_pb2, tool_pb2, trainer_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods = {m.name for m in service.methods}
            assert methods == GUARDED_METHODS[service.full_name] | open_rpcs[service.full_name], service.full_name
            assert not GUARDED_METHODS[service.full_name] & open_rpcs[service.full_name]


def test_create_server_uses_the_process_token_on_the_guarded_methods() -> None:
    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
    from services.common.client import make_channel
    from services.common.credentials import ServerCredentials, set_server_credentials
    from services.common.server import ServiceSpec, create_server

    class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
        def GetRun(self, request, context):  # noqa: N802 (the generated servicer names it)
            return coordinator_pb2.RunStatus(run_id=request.run_id)

        def StopRun(self, request, context):  # noqa: N802
            return coordinator_pb2.RunStatus(run_id="stopped")

    before = set_server_credentials(ServerCredentials(token="tok"))
    try:
        srv = create_server([ServiceSpec(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, Coordinator(),
                                         "rlfabric.v1.Coordinator")], component="t", metrics_port=None).start()
    finally:
        set_server_credentials(before)
    try:
        with make_channel(srv.address, token=None) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert stub.GetRun(coordinator_pb2.GetRunRequest(run_id="r"), timeout=5).run_id == "r"
            with pytest.raises(grpc.RpcError) as e:
                stub.StopRun(coordinator_pb2.StopRunRequest(run_id="r"), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(srv.address, token="tok") as channel:
            stopped = coordinator_pb2_grpc.CoordinatorStub(channel).StopRun(coordinator_pb2.StopRunRequest(), timeout=5)
            assert stopped.run_id == "stopped"
    finally:
        srv.stop(0)


def test_a_two_rank_group_meets_on_the_bound_store(tmp_path: Path) -> None:
    """Rank 0 on the store `trainer serve` bound and handed down, rank 1 through `init_method=tcp://` (as the
    ranks of `trainer serve` do): they form one group (a store without torch's key prefix never met)."""
    code = (
        "import os, sys, socket, subprocess, argparse\n"
        "if sys.argv[1] == 'parent':\n"
        "    s = socket.create_server(('127.0.0.1', 0))\n"
        "    procs = []\n"
        "    for r in range(2):\n"
        "        env = dict(os.environ, RANK=str(r), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1',\n"
        "                   MASTER_PORT=str(s.getsockname()[1]))\n"
        "        fds = [s.fileno()] if r == 0 else []\n"
        "        procs.append(subprocess.Popen([sys.executable, '-c', CODE, str(fds[0]) if fds else '-'], env=env,\n"
        "                                      pass_fds=fds, stdout=subprocess.PIPE, text=True))\n"
        "    s.close()\n"
        # One pipe per rank: the two ranks print at the same moment and a shared stdout interleaves them.
        "    outs = [p.communicate(timeout=100)[0] for p in procs]\n"
        "    print(''.join(outs), end='')\n"
        "    sys.exit(max(p.returncode for p in procs))\n"
        "import torch.distributed as dist\n"
        "from services.trainer import parallel\n"
        "from services.trainer.launch import _bound_store\n"
        "fd = None if sys.argv[1] == '-' else int(sys.argv[1])\n"
        "parallel.init_distributed(backend='gloo', timeout_s=60, store=_bound_store(argparse.Namespace(master_listen_fd=fd)))\n"
        "dist.barrier()\n"
        "print('met', dist.get_rank(), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", f"CODE = {code!r}\n" + code, "parent"], capture_output=True, text=True,
                         timeout=150, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split("\n")[:2]) == ["met 0", "met 1"]


def test_bound_store_listens_on_the_master_addr_only(tmp_path: Path) -> None:
    """`trainer serve`'s store socket (what rank 0's TCPStore serves on) is bound to --master-addr only."""
    code = (
        "import os, socket, psutil, datetime, argparse\n"
        "from services.trainer.launch import _bound_store\n"
        "s = socket.create_server(('127.0.0.1', 0))\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(s.getsockname()[1]))\n"
        "store = _bound_store(argparse.Namespace(master_listen_fd=s.fileno()))\n"
        "store.set('k', 'v'); assert store.get('k') == b'v'\n"
        "print(sorted({c.laddr.ip for c in psutil.Process().net_connections('tcp') if c.status == 'LISTEN'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['127.0.0.1']"


def test_start_run_refuses_a_run_id_that_escapes_the_runs_dir(redis_url: str) -> None:
    """The run id names a directory under --runs-dir: '..' or '/' in it would put the run's files elsewhere."""
    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
    from services.common.client import make_channel
    from services.common.redis_store import connect
    from services.common.server import ServiceSpec, create_server
    from services.coordinator.server import CoordinatorServicer

    built: list[str] = []

    def factory(config_yaml: str, overrides: list[str], run_id: str):
        built.append(run_id)
        raise ValueError("no run in this test")

    servicer = CoordinatorServicer(connect(redis_url), factory)
    srv = create_server([ServiceSpec(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer,
                                     "rlfabric.v1.Coordinator")], component="c", metrics_port=None, auth_token=None)
    srv.start()
    try:
        with make_channel(srv.address, token=None) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for bad in ("../../etc", "a/b", ".hidden", "x" * 200):
                with pytest.raises(grpc.RpcError) as e:
                    stub.StartRun(coordinator_pb2.StartRunRequest(run_id=bad), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "run_id" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:  # a good id reaches the driver factory
                stub.StartRun(coordinator_pb2.StartRunRequest(run_id="sec-ok-1.a_b"), timeout=10)
            assert e.value.details() == "no run in this test"
    finally:
        srv.stop(0)
    assert built == ["sec-ok-1.a_b"]


def _coordinator_serve(repo_root: Path, redis_url: str, tmp_path: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "coordinator", "serve", "--redis-url", redis_url, "--address",
         "127.0.0.1:0", "--runs-dir", str(tmp_path / "runs"), *flags],
        cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_lines(proc: subprocess.Popen) -> tuple[str, str]:
    """(first stderr line, the endpoint of the 'coordinator serving on' stdout line)."""
    first = proc.stderr.readline()
    line = proc.stdout.readline()
    assert "coordinator serving on" in line, (first, line, proc.stderr.read() if proc.poll() is not None else "")
    return first, line.split()[3]


@pytest.mark.parametrize("insecure", [False, True])
def test_a_standalone_server_without_a_token_fails_closed_unless_insecure_and_says_so_first(
        repo_root: Path, redis_url: str, tmp_path: Path, insecure: bool) -> None:
    """Without --auth-token-file a `serve` used to leave every guarded RPC open and log nothing."""
    from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
    from services.common.client import make_channel

    proc = _coordinator_serve(repo_root, redis_url, tmp_path, *(["--insecure"] if insecure else []))
    try:
        first, endpoint = _first_lines(proc)
        with make_channel(endpoint, token=None) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as e:  # a bad run id: refused by the servicer once past the guard
                stub.StartRun(coordinator_pb2.StartRunRequest(run_id="../x"), timeout=30)
            with pytest.raises(grpc.RpcError) as open_call:
                stub.GetRun(coordinator_pb2.GetRunRequest(run_id="nobody"), timeout=30)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)  # reads what it still writes: a full pipe would hold it up
    assert open_call.value.code() == grpc.StatusCode.NOT_FOUND  # open RPCs stay open either way
    if insecure:
        assert "auth: INSECURE" in first and "StartRun, StopRun are open to every caller" in first
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        assert "auth: closed" in first and "StartRun, StopRun refuse every caller" in first
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "started without --auth-token-file" in e.value.details()


def test_insecure_and_a_token_together_are_refused(repo_root: Path, redis_url: str, tmp_path: Path) -> None:
    token = write_secret_file(tmp_path / "token", "t0k")
    proc = _coordinator_serve(repo_root, redis_url, tmp_path, "--insecure", "--auth-token-file", str(token))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "give it or --auth-token-file, not both" in err


@pytest.mark.parametrize("command", [["coordinator", "serve"], ["rollout", "serve"], ["trainer", "serve"],
                                     ["trainer", "rank"], ["reward", "serve"]])
def test_every_serve_command_has_insecure_and_hands_it_to_the_ranks(command: list[str]) -> None:
    from services.cli import build_parser

    args = build_parser().parse_args([*command, "--insecure"])
    assert args.insecure is True and build_parser().parse_args(command).insecure is False
    if command == ["trainer", "serve"]:
        from services.trainer.launch import rank_argv

        assert "--insecure" in rank_argv(args)


def test_server_security_modes(tmp_path: Path) -> None:
    from services.common.credentials import (
        client_credentials,
        server_credentials,
        set_client_credentials,
        set_server_credentials,
    )
    from services.common.security import CLOSED_REFUSAL, server_security

    token = write_secret_file(tmp_path / "token", "t0k")
    p = _parser()
    before = server_credentials(), client_credentials()
    try:
        assert server_security(p.parse_args([])).mode == "closed"
        assert server_credentials().token and server_credentials().refusal == CLOSED_REFUSAL
        assert client_credentials().token is None  # a fail-closed server's own calls send no token
        assert server_security(p.parse_args(["--insecure"])).mode == "insecure"
        assert server_credentials().token is None
        assert server_security(p.parse_args(["--auth-token-file", str(token)])).mode == "token"
        assert server_credentials().token == "t0k" and server_credentials().refusal is None
        assert client_credentials().token == "t0k"
    finally:
        set_server_credentials(before[0])
        set_client_credentials(before[1])


def _open_to_others(root: Path) -> list[str]:
    """Paths under `root` (itself included) that a group or other user may read, write or enter."""
    return [f"{p} {p.stat().st_mode & 0o777:o}" for p in [root, *root.rglob("*")] if p.stat().st_mode & 0o077]


def test_redis_files_service_logs_and_run_dirs_are_the_users_only(tmp_path: Path) -> None:
    """Redis' append-only file (the registrations the password protects) and the logs were 0644 in 0755 folders."""
    from services.common.processes import ServiceProcess
    from services.launcher.stack import LocalStack

    stack = LocalStack(tmp_path / "run")
    stack.start_redis()  # the private Redis of `up`: append-only, in RUN_DIR/redis
    try:
        registry_client = redis.Redis.from_url(stack.redis_url)
        registry_client.set("rlfabric:members:reward:x", "{}")
        registry_client.execute_command("BGREWRITEAOF")
        proc = ServiceProcess("child", [], stack.logs_dir / "child.log",
                              command=[sys.executable, "-c", "print('hello')"]).start()
        assert proc.proc is not None and proc.proc.wait(timeout=60) == 0
        assert (stack.logs_dir / "child.log").read_text() == "hello\n"
        assert any((tmp_path / "run" / "redis").rglob("*.aof"))
        assert _open_to_others(tmp_path / "run") == []
    finally:
        assert stack.redis is not None
        stack.redis.stop()


@pytest.mark.parametrize("insecure", [False, True])
def test_reward_worker_without_a_token_is_closed_unless_insecure(insecure: bool) -> None:
    from rlfabric.v1 import reward_pb2, reward_pb2_grpc
    from services.common.client import make_channel
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    with RewardWorker(RewardWorkerOptions(processes=1, metrics_port=None, insecure=insecure)) as worker:
        with make_channel(worker.server.address, token=None) as channel:
            with pytest.raises(grpc.RpcError) as e:
                reward_pb2_grpc.RewardStub(channel).UnregisterVerifier(
                    reward_pb2.UnregisterVerifierRequest(name="x"), timeout=30)
    # Past the guard, a worker without Redis cannot unregister anything.
    expected = grpc.StatusCode.FAILED_PRECONDITION if insecure else grpc.StatusCode.UNAUTHENTICATED
    assert e.value.code() == expected

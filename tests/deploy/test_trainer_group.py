"""The trainer command of deploy/k8s, run as a LeaderWorkerSet group of two pods would run it, on loopback.

The rendered cpu overlay's trainer-actor leader and worker containers are started as two processes with the
environment the LWS controller and the downward API give them (LWS_GROUP_SIZE=2, LWS_WORKER_INDEX 0/1,
LWS_LEADER_ADDRESS, POD_IP, ...), each in its own working directory that holds the tiny model where the
YAML's relative paths point: the two torchrun agents rendezvous at the leader, the group spans both "pods"
(DP 2), and global rank 0 registers in Redis and answers gRPC health on the address the manifest binds.
Only the fixed ports are swapped for free ones, so that the test can run beside others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deploy_checks import CONFIGS_MOUNT, DEPLOY_DIR, substitute

REPO = DEPLOY_DIR.parent
FIXED_PORTS = {"50054": "grpc", "9400": "metrics", "29500": "master"}


def test_lws_trainer_command_forms_a_two_pod_group(render, redis_url, tiny_model_dir, tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.net import free_port
    from services.common.redis_store import Registry, connect

    docs = render(DEPLOY_DIR / "k8s" / "overlays" / "cpu")
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"] == "trainer-actor")
    ports = {fixed: str(free_port()) for fixed in FIXED_PORTS}
    bin_dir = Path(sys.executable).parent
    procs: list[subprocess.Popen] = []
    from services.common.security import write_secret_file

    secrets = tmp_path / "secrets"  # the pod's projected Secret volume
    write_secret_file(secrets / "token", "0123abcd")
    write_secret_file(secrets / "redis-url", redis_url)
    try:
        for index, key in enumerate(("leaderTemplate", "workerTemplate")):
            container = lws["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"][0]
            env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": "127.0.0.1",
                   "POD_IP": "127.0.0.1", "POD_NAME": f"trainer-actor-0{'-1' if index else ''}",
                   "REDIS_URL": redis_url, "RUN_CONFIG": "grpo_tiny_cpu.yaml"}
            argv = []
            for a in container["args"]:
                a = substitute(a, env).replace(CONFIGS_MOUNT, str(REPO / "configs")).replace(
                    "/etc/rlfabric/secrets", str(secrets))
                for fixed, free in ports.items():
                    a = a.replace(f":{fixed}", f":{free}").replace(f"={fixed}", f"={free}")
                argv.append(a)
            assert all(f"={free}" in " ".join(argv) or f":{free}" in " ".join(argv) for free in ports.values())
            assert container["command"] == ["rlfabric-exec", "torchrun"]
            pod_dir = tmp_path / f"pod{index}"  # the shared volume, as mounted at /data in the pod
            pod_dir.mkdir()
            (pod_dir / "runs" / "tiny_cpu").mkdir(parents=True)  # where configs/grpo_tiny_cpu.yaml looks
            (pod_dir / "runs" / "tiny_cpu" / "tiny_model").symlink_to(tiny_model_dir)
            proc_env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
            procs.append(subprocess.Popen([str(bin_dir / "torchrun"), *argv], cwd=pod_dir, env=proc_env,
                                          stdout=open(tmp_path / f"pod{index}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        registry = Registry(connect(redis_url))
        deadline = time.monotonic() + 600
        members = []
        while not members:
            members = [m for m in registry.members("trainer") if m.instance_id == "trainer-actor-0"]
            dead = [p.returncode for p in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (
                f"group did not come up (exits {dead}):\n" + (tmp_path / "pod0.log").read_text()[-3000:])
            time.sleep(1)
        (member,) = members
        assert member.endpoint == f"127.0.0.1:{ports['50054']}"
        assert member.metadata["role"] == "actor" and member.metadata["dp"] == 2  # both pods' ranks joined
        with grpc.insecure_channel(member.endpoint) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="rlfabric.v1.Trainer"), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.poll() is not None for p in procs)

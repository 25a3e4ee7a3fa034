"""Multi-host on one machine: every service in its own network namespace ("host"), started with its `serve`
command, `--redis-url` and bind / advertise addresses, talking only over the test network (each namespace has
eth0 and its own loopback; nothing in one namespace can reach another's loopback, so there is no loopback
shortcut to fall back on). Two GRPO iterations run across them, and a second reward worker joins on a third
host once the run has started.

  host a (.1): Redis, coordinator (binds 0.0.0.0, advertises eth0's address), reward worker 1
  host b (.2): rollout replica (vLLM; wildcard bind, --advertise-interface eth0), trainer rank 0 (gRPC)
  host c (.3): trainer rank 1 (gloo rendezvous at b), `rlfabric train` (the client), reward worker 2 (scale-up)

Each cross-host assumption this exercises is listed in docs/deploy.md ("Multi-host, proven on one machine").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.common.processes import ServiceProcess, tail, wait_until

CONFIG = "configs/grpo_tiny_cpu.yaml"
REDIS_PORT = 6379  # a fixed port is safe: host a's namespace is private to this test
MASTER_PORT = 29500
METRICS_PORT = 9400
SAMPLES_PER_ITERATION = 8  # 2 prompts x 4 samples
# A worker started after `train` registers after its Python start-up, measured at ~3 s on a quiet machine, when
# about 4 of these 0.7 s iterations have run (with 2 it once joined after the last one, under load): 12 leave it
# most of the run.
ITERATIONS = 12


def overrides(tiny_model_dir: Path, arith_prefix: Path, run_dir: Path) -> list[str]:
    """ITERATIONS small ones; the actor group is two ranks (DP 2) on two hosts; no reference model."""
    return [f"megatron_training.tokenizer_name_or_path={tiny_model_dir}", f"megatron_training.data_path={arith_prefix}",
            f"actor_config.load={tiny_model_dir}", f"actor_config.save={run_dir / 'ckpt'}",
            f"megatron_training.train_iters={ITERATIONS}", "megatron_training.save_interval=100",
            "megatron_training.global_batch_size=2", "rl_config.n_samples_per_prompt=4", "rl_config.mini_batch_size=2",
            "actor_config.micro_batch_size=4", "rl_config.actor_forward_micro_batch_size=4",
            "rl_config.init_kl_coef=0", "rl_config.actor_resource.num_npus=2",
            "generate_config.sampling_config.max_tokens=16"]


def scores_of(url: str) -> float:
    """rlfabric_reward_scores_total summed over verifiers, read from a worker's /metrics across the network."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rlfabric_reward_scores_total{"))


def health(endpoint: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.client import make_channel

    with make_channel(endpoint) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_a_run_across_three_hosts_takes_a_reward_worker_added_mid_run(network, tiny_model_dir: Path, arith_prefix: Path, repo_root: Path,
                                           tmp_path: Path) -> None:
    from services.common.redis_store import Registry, connect

    a, b, c = network.hosts["a"], network.hosts["b"], network.hosts["c"]
    logs = tmp_path / "logs"
    procs: list[ServiceProcess] = []
    py = [sys.executable, "-m", "services.cli", "--log-level", "INFO"]

    def start(name: str, host, *argv: str) -> ServiceProcess:
        proc = ServiceProcess(name, [], logs / f"{name}.log", command=host.command(*argv)).start()
        procs.append(proc)
        return proc

    url = f"redis://{a.ip}:{REDIS_PORT}/0"
    o = overrides(tiny_model_dir, arith_prefix, tmp_path)
    trainer = [*py, "trainer", "serve", "--config", CONFIG, *[x for v in o for x in ("--override", v)],
               "--role", "actor", "--world-size", "2", "--nnodes", "2", "--master-addr", b.ip,
               "--master-port", str(MASTER_PORT), "--socket-ifname", "eth0", "--redis-url", url, "--insecure"]
    try:
        start("redis", a, "redis-server", "--bind", a.ip, "--port", str(REDIS_PORT), "--save", "",
              "--appendonly", "no", "--protected-mode", "no")
        start("reward-1", a, *py, "reward", "serve", "--address", f"{a.ip}:0", "--redis-url", url,
              "--metrics-port", str(METRICS_PORT))
        start("rollout", b, *py, "rollout", "serve", "--config", CONFIG, *[x for v in o for x in ("--set", v)],
              "--address", "0.0.0.0:0", "--advertise-interface", "eth0", "--redis-url", url, "--insecure")
        # Rank 1 first: stopped in reverse, rank 0 then tells it to stop while it still runs.
        start("trainer-node1", c, *trainer, "--node-rank", "1")
        start("trainer-node0", b, *trainer, "--node-rank", "0", "--address", "0.0.0.0:0",
              "--advertise-address", b.ip)
        start("coordinator", a, *py, "coordinator", "serve", "--address", "0.0.0.0:0", "--advertise-interface",
              "eth0", "--redis-url", url, "--runs-dir", str(tmp_path / "runs"), "--insecure")

        registry = Registry(connect(f"redis://{a.ip}:{REDIS_PORT}/0"))  # from the observer, across the network

        def members() -> dict[str, list[str]]:
            return {s: [m.endpoint for m in registry.members(s)] for s in ("reward", "rollout", "trainer",
                                                                              "coordinator")}

        wait_until(lambda: all(members().values()), procs, 600, "every service registered")
        registered = members()
        # Advertised, not bound: wildcard binds register eth0's address; nothing registers a loopback address.
        assert registered == {"reward": [registered["reward"][0]], "rollout": [registered["rollout"][0]],
                              "trainer": [registered["trainer"][0]], "coordinator": [registered["coordinator"][0]]}
        hosts = {s: e[0].rsplit(":", 1)[0] for s, e in registered.items()}
        assert hosts == {"reward": a.ip, "rollout": b.ip, "trainer": b.ip, "coordinator": a.ip}, registered
        assert all(health(e[0]) == "SERVING" for e in registered.values())
        # One actor group of two ranks over hosts b and c (gloo over eth0): data-parallel 2.
        (actor,) = registry.members("trainer")
        assert (actor.metadata["role"], actor.metadata["dp"]) == ("actor", 2), actor.metadata

        started = time.monotonic()
        train = subprocess.Popen(c.command(*py[:3], "train", CONFIG, *[x for v in o for x in ("-o", v)],
                                           "--coordinator", registered["coordinator"][0]),
                                 cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Scale up while the run goes on: a second worker on another host, advertised by address.
        start("reward-2", c, *py, "reward", "serve", "--address", "0.0.0.0:0", "--advertise-address", c.ip,
              "--redis-url", url, "--metrics-port", str(METRICS_PORT))
        wait_until(lambda: len(registry.members("reward")) == 2, procs, 120, "reward-2 registered")
        joined_after_s = time.monotonic() - started
        out, _ = train.communicate(timeout=600)
        run_s = time.monotonic() - started
        assert train.returncode == 0, out[-4000:] + "\n" + "\n".join(
            f"--- {p.name}:\n{tail(p.log_path, 15)}" for p in procs)

        (metrics_file,) = (tmp_path / "runs").glob("*/metrics.jsonl")
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
        for m in metrics:
            assert m["global_batch_size"] * m["n_samples_per_prompt"] == SAMPLES_PER_ITERATION
            assert m["failed_samples"] == 0
        # Every sample scored exactly once, over both workers; the one that joined during the run took work.
        first = scores_of(f"http://{a.ip}:{METRICS_PORT}/metrics")
        second = scores_of(f"http://{c.ip}:{METRICS_PORT}/metrics")
        assert first + second == ITERATIONS * SAMPLES_PER_ITERATION, (first, second)
        assert second > 0, f"reward-2 (registered {joined_after_s:.1f}s into the run) scored nothing"
        print(f"{ITERATIONS} iterations across 3 namespaces: run {run_s:.1f}s; reward-2 joined at {joined_after_s:.1f}s "
              f"and scored {second:.0f} of {ITERATIONS * SAMPLES_PER_ITERATION}")
    finally:
        for p in reversed(procs):
            p.stop()
    assert not any(p.alive() for p in procs)

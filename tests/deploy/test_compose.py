"""deploy/compose: the files validate offline against the Compose Specification's JSON schema (carried in
tests/deploy/schemas/), and their values hold: real CLI flags, health checks on the bound ports that really
report SERVING, Redis with an append-only file and a password, scalable reward workers, and device layouts
that match the MindSpeed-RL YAML. There is no docker engine here: nothing is started by Compose.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from deploy_checks import CONFIGS_MOUNT, DEPLOY_DIR, ENTRYPOINT, JEMALLOC, check_argv, grpc_service, load_json

COMPOSE = DEPLOY_DIR / "compose"
REPO = DEPLOY_DIR.parent
FILES = ("compose.yaml", "compose.cuda.yaml", "compose.ascend.yaml")
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SAMPLE = {"REDIS_PASSWORD": "0a1b", "RLFABRIC_AUTH_TOKEN": "2c3d", "RLFABRIC_DATA": "/srv/rlfabric"}
OPTIONAL = {"RLFABRIC_IMAGE", "RLFABRIC_CONFIG"}  # the only variables with defaults
SELF_IP = "172.18.0.5"
COMPONENT = {"coordinator": "coordinator", "rollout": "rollout", "reward": "reward", "trainer-actor": "trainer",
             "trainer-reference": "trainer"}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / name).read_text())  # resolves anchors and `<<` merge keys


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation ($$ is a literal $), failing on a required variable left unset."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env and (env[name] or ":" not in op):
            return env[name]
        assert "?" not in op, f"{name} is required: {arg}"
        return arg

    return INTERPOLATION.sub(one, value).replace("$$", "$")


def service_argv(name: str, service: dict[str, Any], env: dict[str, str]) -> list[str]:
    """What follows `rlfabric` on the service's command line."""
    command = [interpolate(a, env) for a in service["command"]]
    if service.get("entrypoint") == ["rlfabric-exec", "sh", "-c"]:
        (script,) = command
        argv = shlex.split(script.replace('$(hostname -i | cut -d\' \' -f1)', SELF_IP))
        assert argv[:2] == ["exec", "rlfabric"], f"{name}: {script}"
        return argv[2:]
    assert "entrypoint" not in service, f"{name}: the image's entrypoint ({ENTRYPOINT}) runs rlfabric"
    return command


def arg(argv: list[str], flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag:
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {argv}")


@pytest.mark.parametrize("name", FILES)
def test_validates_against_the_compose_spec(name):
    jsonschema.Draft7Validator(load_json("compose-spec.json")).validate(load(name))


def test_the_spec_schema_rejects_a_broken_file():
    doc = load("compose.yaml")
    doc["services"]["reward"]["replica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(load_json("compose-spec.json")).validate(doc)


@pytest.mark.parametrize("name", FILES)
def test_only_documented_variables_have_defaults(name):
    """Secrets and the data directory must be given (`:?`), never defaulted or committed."""
    for m in INTERPOLATION.finditer((COMPOSE / name).read_text()):
        if m.group(1) in OPTIONAL:
            assert m.group(2) == ":-", m.group(0)
        else:
            assert m.group(1) in SAMPLE and m.group(2) in (":?", None), m.group(0)


def test_services_run_the_real_cli_and_check_their_own_port(rlfabric_parser):
    services = load("compose.yaml")["services"]
    assert set(services) == {"redis", *COMPONENT}
    for name, component in COMPONENT.items():
        service = services[name]
        argv = service_argv(name, service, SAMPLE)
        args = check_argv(rlfabric_parser, argv)
        host, port = args.address.rsplit(":", 1)
        check = service["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"]
        target, served = check[4:]
        assert served == grpc_service(component), name
        assert target.rsplit(":", 1)[1] == port, f"{name}: health check port != bound port"
        if name == "reward":  # scalable: binds everything, advertises its own IP, no fixed name or host port
            assert host == "0.0.0.0" and args.advertise_address == SELF_IP
            assert "container_name" not in service and "ports" not in service and "hostname" not in service
        else:  # single instance: binds (and registers) its service name, which the network resolves
            assert host == name == target.rsplit(":", 1)[0]
        if getattr(args, "config", None):
            assert Path(args.config).parent.as_posix() == CONFIGS_MOUNT
            assert (REPO / "configs" / Path(args.config).name).is_file()
        assert service["environment"]["LD_PRELOAD"] == JEMALLOC, name
        assert service["working_dir"] == "/data", name
        mounts = {v.rsplit(":", 2)[1] if v.endswith(":ro") else v.rsplit(":", 1)[1]: v for v in service["volumes"]}
        assert set(mounts) == {"/data", CONFIGS_MOUNT}, name
        assert (COMPOSE / mounts[CONFIGS_MOUNT].split(":")[0]).resolve() == REPO / "configs"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_redis_uses_the_kubernetes_settings_with_a_password():
    redis = load("compose.yaml")["services"]["redis"]
    host_conf, container_conf = redis["volumes"][0].split(":")[:2]
    assert (COMPOSE / host_conf).resolve() == DEPLOY_DIR / "k8s" / "base" / "redis.conf"
    assert "appendonly yes" in (COMPOSE / host_conf).read_text()
    script = interpolate(redis["command"][-1], SAMPLE)
    assert f"cat {container_conf}" in script and "requirepass" in script and "$REDIS_PASSWORD" in script
    assert script.rstrip().endswith("exec redis-server /tmp/redis.conf")
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    assert redis["volumes"][1] == "redis-data:/data" and "redis-data" in load("compose.yaml")["volumes"]
    # The services get the token and the Redis URL (password inside) as secret files, never as arguments
    # or environment variables.
    doc = load("compose.yaml")
    assert doc["secrets"] == {"rlfabric-token": {"environment": "RLFABRIC_AUTH_TOKEN"},
                              "rlfabric-redis-url": {"environment": "RLFABRIC_REDIS_URL"}}
    for name in COMPONENT:
        service = doc["services"][name]
        argv = service_argv(name, service, SAMPLE)
        assert set(service["secrets"]) == set(doc["secrets"]), name
        assert arg(argv, "--auth-token-file") == "/run/secrets/rlfabric-token", name
        assert arg(argv, "--redis-url-file") == "/run/secrets/rlfabric-redis-url", name
        assert not any(a.startswith(("--redis-url=", "--auth-token=")) or a == "--redis-url" for a in argv), name
        assert not set(service["environment"]) & {"REDIS_URL", "RLFABRIC_AUTH_TOKEN", "REDIS_PASSWORD"}, name


@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_device_layout_matches_the_seed_config(platform):
    """Each trainer gets TP x PP devices (`trainer serve` starts that many ranks), the rollout its engine's
    tensor-parallel size; the actor shares none of its devices."""
    from services.common.config import load_config

    base = load("compose.yaml")["services"]
    override = load(f"compose.{platform}.yaml")["services"]
    assert set(override) <= set(base)
    cfg = load_config(REPO / "configs" / "grpo_qwen25_7b_A3.yaml")

    def devices(name: str) -> list[str]:
        service = override[name]
        if platform == "cuda":
            (request,) = service["deploy"]["resources"]["reservations"]["devices"]
            assert request["driver"] == "nvidia" and request["capabilities"] == ["gpu"]
            return request["device_ids"]
        numbered = [d for d in service["devices"] if re.fullmatch(r"/dev/davinci\d+", d)]
        assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(service["devices"])
        assert any(v.startswith("/usr/local/Ascend/driver/lib64:") for v in service["volumes"])
        return numbered

    actor, reference, rollout = devices("trainer-actor"), devices("trainer-reference"), devices("rollout")
    for devs, mt in ((actor, cfg.actor_config), (reference, cfg.ref_config)):
        assert len(set(devs)) == mt.tensor_model_parallel_size * mt.pipeline_model_parallel_size
    assert len(rollout) == cfg.generate_config.infer_tensor_parallel_size
    assert not set(actor) & (set(reference) | set(rollout))
    for name in COMPONENT:
        assert override[name]["image"] == f"${{RLFABRIC_IMAGE:-rlfabric-{platform}:0.1.0}}", name


def test_health_check_script_reports_the_serving_state():
    """The compose health check, run against a real rlfabric gRPC server: 0 while SERVING, else non-zero."""
    from services.common.server import ServiceSpec, create_server

    script = load("compose.yaml")["x-grpc-health"]
    spec = ServiceSpec(add_fn=lambda servicer, server: None, servicer=None, name="rlfabric.v1.Reward")
    server = create_server([spec], "127.0.0.1:0", component="probe", metrics_port=None).start()

    def check(service: str) -> int:
        return subprocess.run([sys.executable, "-c", script, server.address, service], capture_output=True,
                              timeout=60).returncode

    try:
        assert check("rlfabric.v1.Reward") == 0
        assert check("rlfabric.v1.Nothing") != 0
        server.set_serving(False)
        assert check("rlfabric.v1.Reward") != 0
    finally:
        server.stop(0)

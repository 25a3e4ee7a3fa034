"""deploy/k8s: every overlay renders offline and passes schema validation; the values mean what they say.

Native kinds are validated strictly (unknown fields are errors) against the schemas of pinned Kubernetes
versions that `kubernetes-validate` ships; LeaderWorkerSet against tests/deploy/schemas/leaderworkerset-v1.json,
its pod templates against Kubernetes' PodTemplateSpec. Then the values: real CLI flags, probes on the real
gRPC ports and service names, device requests that match the MindSpeed-RL YAML's world sizes, Redis with an
append-only file and a password, references that resolve. Nothing is applied to a cluster.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from deploy_checks import CONFIGS_MOUNT, DEPLOY_DIR, JEMALLOC, check_argv, grpc_service, load_json, substitute

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: `make setup` installs it (dev extra)")

K8S = DEPLOY_DIR / "k8s"
REPO = DEPLOY_DIR.parent
OVERLAYS = ("cpu", "cuda", "ascend")
# The oldest Kubernetes the manifests claim (LeaderWorkerSet needs >= 1.26, gRPC probes are GA in 1.27)
# and the newest whose schemas the pinned kubernetes-validate carries.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
DEVICE = {"cpu": None, "cuda": "nvidia.com/gpu", "ascend": "huawei.com/ascend-1980"}
IMAGE = {"cpu": "rlfabric-cpu", "cuda": "rlfabric-cuda", "ascend": "rlfabric-ascend"}
GANG = {"cpu": False, "cuda": True, "ascend": True}
LWS_ENV = {"LWS_LEADER_ADDRESS": "trainer-actor-0.trainer-actor", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
# Secret -> keys, created by deploy/k8s/secrets.sh.
SECRETS = {"rlfabric-redis": {"password", "url"}, "rlfabric-auth": {"token"}}
SECRETS_DIR = "/etc/rlfabric/secrets"  # the token and the Redis URL as files (docs/security.md)
OPTIONAL_SECRETS = {"rlfabric-tls"}


# ---------------------------------------------------------------------------------------------- walking


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a workload document."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet"):
        yield doc["metadata"]["name"], spec["template"]
    elif doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                yield f"{doc['metadata']['name']}/{key}", lwt[key]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(where, document, pod template, container) for every container of every workload."""
    for doc in docs:
        for where, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                yield f"{where}/{c['name']}", doc, template, c


def rlfabric_containers(docs):
    return [(w, d, t, c) for w, d, t, c in containers(docs) if c["name"] != "redis"]


def container_env(doc: dict[str, Any], c: dict[str, Any], configmaps: dict[str, dict]) -> dict[str, str]:
    """Values the $(VAR) references of a container resolve to, checking each reference is defined
    before use (Kubernetes expands only variables defined earlier in the list)."""
    env: dict[str, str] = dict(LWS_ENV) if doc["kind"] == "LeaderWorkerSet" else {}
    samples = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}
    for item in c.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = substitute(item["value"], env)
        elif "fieldRef" in source:
            env[item["name"]] = samples[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = configmaps[ref["name"]]["data"][ref["key"]]
        elif "secretKeyRef" in source:
            env[item["name"]] = "0123abcd"
        else:
            raise AssertionError(f"env {item['name']}: unexpected source {source}")
    return env


def by_kind(docs, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def arg_value(args: list[str], flag: str) -> str:
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {args}")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request, render) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(K8S / "overlays" / request.param)


def run_config_name(docs) -> str:
    (run,) = [d for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("rlfabric-run")]
    return run["data"]["config"]


# ---------------------------------------------------------------------------------------------- schemas


def validate_document(doc: dict[str, Any], version: str) -> None:
    if doc["kind"] == "LeaderWorkerSet":
        jsonschema.validate(doc, load_json("leaderworkerset-v1.json"))
        for where, template in pod_templates(doc):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": where.replace("/", "-").lower()},
                       "template": template}
            kubernetes_validate.validate(wrapped, version, strict=True)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_overlay_renders_and_validates(overlay, version):
    name, docs = overlay
    kinds = sorted({d["kind"] for d in docs})
    assert {"Deployment", "StatefulSet", "LeaderWorkerSet", "HorizontalPodAutoscaler", "Service", "ConfigMap",
            "PersistentVolumeClaim", "NetworkPolicy", "Namespace"} <= set(kinds), kinds
    for doc in docs:
        try:
            validate_document(doc, version)
        except kubernetes_validate.SchemaNotFoundError as e:  # a new CRD kind needs a schema here
            raise AssertionError(f"{name}: no schema for {doc['kind']} {doc['apiVersion']}") from e
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name}: {doc['kind']}/{doc['metadata']['name']} is invalid for "
                                 f"Kubernetes {version}: {e.message}") from e
        assert doc["metadata"].get("namespace", "rlfabric") == "rlfabric" or doc["kind"] == "Namespace"


def test_validators_reject_broken_documents(render):
    """The checks above can fail: a typo in a native field, in an LWS field, and in an LWS pod template."""
    docs = render(K8S / "overlays" / "cpu")
    deployment = copy.deepcopy(by_kind(docs, "Deployment")["rollout"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50052}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    lws = copy.deepcopy(by_kind(docs, "LeaderWorkerSet")["trainer-actor"])
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validate_document(lws, KUBERNETES_VERSIONS[0])
    lws = copy.deepcopy(by_kind(docs, "LeaderWorkerSet")["trainer-actor"])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_document(lws, KUBERNETES_VERSIONS[0])


def with_component(root: Path, component: str, overlay: str = "cpu") -> Path:
    """A user's kustomization: an overlay plus one component (kustomize wants relative paths)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, root)],
        "components": [os.path.relpath(K8S / "components" / component, root)]}))
    return root


def test_components_render_and_validate(render, tmp_path):
    """Each optional component on top of an overlay (as a user's own kustomization would add it)."""
    for component in sorted(p.name for p in (K8S / "components").iterdir()):
        for doc in render(with_component(tmp_path / component, component)):
            validate_document(doc, KUBERNETES_VERSIONS[-1])


def test_queue_depth_component_scales_on_the_reward_gauge(render, tmp_path):
    from services.reward.metrics import QUEUE_DEPTH

    hpa = by_kind(render(with_component(tmp_path, "reward-queue-depth")), "HorizontalPodAutoscaler")["reward"]
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names == [QUEUE_DEPTH._name]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"] == ["cpu"]


# ---------------------------------------------------------------------------------------------- values


def test_every_config_file_is_shipped_and_projected(overlay):
    """configMapGenerator lists every file of configs/, and every pod mounts each at its relative path."""
    name, docs = overlay
    expected = {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*") if p.is_file()}
    configmaps = by_kind(docs, "ConfigMap")
    for _, _, template, c in rlfabric_containers(docs):
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        if "configs" not in mounts:
            continue
        assert mounts["configs"] == CONFIGS_MOUNT
        projected = set()
        for source in volumes["configs"]["projected"]["sources"]:
            cm = configmaps[source["configMap"]["name"]]
            items = source["configMap"].get("items") or [{"key": k, "path": k} for k in cm["data"]]
            assert {i["key"] for i in items} == set(cm["data"]), f"{cm['metadata']['name']}: keys not all projected"
            for item in items:
                projected.add(item["path"])
                assert cm["data"][item["key"]] == (REPO / "configs" / item["path"]).read_text(), item["path"]
        assert projected == expected, f"{name}: configs/ and the projected files differ: {projected ^ expected}"


def test_configmap_sources_are_a_copy_of_configs():
    """deploy/k8s/base/configs/ (the ConfigMap sources, inside the kustomization's root so that plain
    `kubectl apply -k` loads them) holds exactly the files of configs/, byte for byte."""
    copy_root = K8S / "base" / "configs"
    files = {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*") if p.is_file()}
    copies = {p.relative_to(copy_root).as_posix() for p in copy_root.rglob("*") if p.is_file()}
    stale = sorted(f for f in files & copies
                   if (REPO / "configs" / f).read_bytes() != (copy_root / f).read_bytes())
    assert (files ^ copies, stale) == (set(), []), (
        f"deploy/k8s/base/configs differs from configs/ (missing or extra {sorted(files ^ copies)}, "
        f"changed {stale}): run deploy/k8s/sync-configs.sh")


def test_container_args_use_the_real_cli(overlay, rlfabric_parser, trainer_rank_args):
    """Every rlfabric container's command line parses with our own parsers (torchrun's for trainers),
    with every $(VAR) defined before use, and names a config file that the pod mounts."""
    from torch.distributed.run import get_args_parser

    name, docs = overlay
    configmaps = by_kind(docs, "ConfigMap")
    for where, doc, _, c in rlfabric_containers(docs):
        env = container_env(doc, c, configmaps)
        argv = [substitute(a, env) for a in c.get("args", [])]
        command = c.get("command")
        if command is None:  # the image's ENTRYPOINT: rlfabric-exec rlfabric
            args = check_argv(rlfabric_parser, argv)
            assert args.func, where
        else:
            assert command == ["rlfabric-exec", "torchrun"], f"{where}: {command}"
            run = get_args_parser().parse_args(argv)
            assert run.module and run.training_script == "services.trainer", where
            assert (run.nnodes, run.node_rank, run.master_addr) == (
                LWS_ENV["LWS_GROUP_SIZE"], int(LWS_ENV["LWS_WORKER_INDEX"]), LWS_ENV["LWS_LEADER_ADDRESS"]), where
            args = trainer_rank_args(run.training_script_args)
            assert args.trainer_command == "rank", where
        if getattr(args, "config", None):
            assert args.config == f"{CONFIGS_MOUNT}/{run_config_name(docs)}", where
            assert (REPO / "configs" / Path(args.config).name).is_file(), where


def test_grpc_probes_on_the_served_port(overlay):
    """Containers that serve gRPC probe it (startup, readiness, liveness) on the port they bind, for the
    service name they register; ranks on LWS worker pods serve nothing, so they have no probes and are
    otherwise the leader's container."""
    name, docs = overlay
    for where, doc, template, c in rlfabric_containers(docs):
        if where.endswith("workerTemplate/trainer"):
            assert not any(k in c for k in ("startupProbe", "readinessProbe", "livenessProbe")), where
            leader = doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
            stripped = {k: v for k, v in leader.items()
                        if k not in ("startupProbe", "readinessProbe", "livenessProbe", "ports")}
            assert c == stripped, f"{where} differs from its leader beyond probes and ports"
            continue
        address = arg_value(c.get("args", []), "--address")
        port = int(address.rsplit(":", 1)[1])
        component = c["name"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == port and ports["metrics"] == int(arg_value(c["args"], "--metrics-port")), where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port, "service": grpc_service(component)}, f"{where} {probe}"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"]), where


def test_services_select_pods_and_ports(overlay):
    name, docs = overlay
    pods = [(doc, template) for doc in docs for _, template in pod_templates(doc)]
    for svc in by_kind(docs, "Service").values():
        selector = svc["spec"]["selector"]
        if "leaderworkerset.sigs.k8s.io/name" in selector:  # labels the LWS controller puts on its pods
            lws = by_kind(docs, "LeaderWorkerSet")[selector["leaderworkerset.sigs.k8s.io/name"]]
            assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
            assert svc["metadata"]["name"] != lws["metadata"]["name"], "LWS creates a Service of its own name"
            matched = [lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]]
        else:
            matched = [t for _, t in pods if selector.items() <= t["metadata"]["labels"].items()]
        assert len(matched) == 1, f"{name}: Service {svc['metadata']['name']} selects {len(matched)} templates"
        named = {p["name"] for c in matched[0]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"Service {svc['metadata']['name']}: no port {port['targetPort']}"


def test_redis_is_persistent_with_aof_and_a_password(overlay):
    name, docs = overlay
    redis = by_kind(docs, "StatefulSet")["redis"]
    spec = redis["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    conf_map = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    conf = dict(line.split(None, 1) for line in by_kind(docs, "ConfigMap")[conf_map]["data"]["redis.conf"].splitlines()
                if line.strip() and not line.startswith("#"))
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "everysec"
    data_mount = next(m for m in c["volumeMounts"] if m["name"] == "data")
    assert data_mount["mountPath"] == conf["dir"]
    assert [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]] == ["data"]
    (password,) = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "rlfabric-redis", "key": "password"}
    script = c["command"][-1]
    assert "requirepass" in script and "$REDIS_PASSWORD" in script and "exec redis-server" in script
    # ... and every rlfabric container reaches it with the URL (password inside) from a file of that Secret,
    # and takes the service token from a file: no secret in an argument or in the environment.
    for where, _, template, rc in rlfabric_containers(docs):
        args = rc.get("args", [])
        assert arg_value(args, "--redis-url-file") == f"{SECRETS_DIR}/redis-url", where
        assert arg_value(args, "--auth-token-file") == f"{SECRETS_DIR}/token", where
        assert not any(a.startswith(("--redis-url=", "--auth-token=")) for a in args), where
        assert not {e["name"] for e in rc.get("env", [])} & {"REDIS_URL", "REDIS_PASSWORD", "RLFABRIC_AUTH_TOKEN"}, where
        mount = next(m for m in rc["volumeMounts"] if m["mountPath"] == SECRETS_DIR)
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
        files = {i["path"]: (src["secret"]["name"], i["key"]) for src in volume["projected"]["sources"]
                 for i in src["secret"]["items"]}
        assert files == {"token": ("rlfabric-auth", "token"), "redis-url": ("rlfabric-redis", "url")}, where
        assert volume["projected"]["defaultMode"] & 0o007 == 0, where  # never world-readable


def test_redis_start_script_runs_redis_with_aof_and_password(render, tmp_path):
    """Runs the Redis container's start-up script with a real redis-server: AOF on, password required
    (the Redis part is the same in every overlay)."""
    import redis as redis_client

    from services.common.net import free_port
    from services.common.redis_store import find_redis_server

    docs = render(K8S / "overlays" / "cpu")
    redis_doc = by_kind(docs, "StatefulSet")["redis"]
    (c,) = redis_doc["spec"]["template"]["spec"]["containers"]
    conf = by_kind(docs, "ConfigMap")[next(n for n in by_kind(docs, "ConfigMap") if n.startswith("redis-config"))]
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "data").mkdir()
    port = free_port()
    text = conf["data"]["redis.conf"].replace("dir /data", f"dir {tmp_path / 'data'}").replace(
        "port 6379", f"port {port}\nbind 127.0.0.1")
    (tmp_path / "etc" / "redis.conf").write_text(text)
    script = (c["command"][-1].replace("/etc/redis", str(tmp_path / "etc")).replace("/run/redis", str(tmp_path / "run"))
              .replace("exec redis-server", f"exec {shlex.quote(find_redis_server())}"))
    proc = subprocess.Popen(["sh", "-c", script], env={"REDIS_PASSWORD": "s3cret", "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis_client.Redis(host="127.0.0.1", port=port, password="s3cret", socket_timeout=5)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis_client.exceptions.ConnectionError:
                time.sleep(0.1)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("rlfabric:probe", "1")
        assert any(p.stat().st_size for p in (tmp_path / "data").rglob("*.aof")), "no append-only file written"
        with pytest.raises(redis_client.exceptions.AuthenticationError):
            redis_client.Redis(host="127.0.0.1", port=port, socket_timeout=5).set("k", "v")
        assert oct((tmp_path / "run" / "redis.conf").stat().st_mode & 0o777) == "0o600"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_devices_match_the_config_world_sizes(overlay):
    """Device requests are the overlay's, and group size x processes per pod is the role's world size."""
    from services.common.config import load_config

    name, docs = overlay
    cfg = load_config(REPO / "configs" / run_config_name(docs))
    device = DEVICE[name]
    for where, _, _, c in rlfabric_containers(docs):
        limits = c["resources"].get("limits", {})
        devices = {k: v for k, v in limits.items() if "/" in k}
        if device is None or c["name"] in ("coordinator", "reward"):
            assert devices == {}, f"{where}: {devices}"
    rollout = by_kind(docs, "Deployment")["rollout"]["spec"]["template"]["spec"]["containers"][0]
    if device:
        assert rollout["resources"]["limits"] == {**rollout["resources"]["limits"],
                                                  device: cfg.generate_config.infer_tensor_parallel_size}
    for role, lws in (("actor", "trainer-actor"), ("reference", "trainer-reference")):
        doc = by_kind(docs, "LeaderWorkerSet")[lws]
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        nproc = set()
        for where, template in pod_templates(doc):
            c = template["spec"]["containers"][0]
            n = int(arg_value(c["args"], "--nproc-per-node"))
            nproc.add(n)
            if device:
                assert c["resources"]["limits"][device] == n, f"{where}: {device} != --nproc-per-node"
            assert arg_value(c["args"], "--role") == role
        (n,) = nproc
        mt = cfg.actor_config if role == "actor" else cfg.ref_config
        model_parallel = mt.tensor_model_parallel_size * mt.pipeline_model_parallel_size
        if role == "actor":
            assert size * n == cfg.derived.actor_world_size, f"{name}: actor {size} x {n} devices"
        assert (size * n) % model_parallel == 0, f"{name}: {role} world {size * n} vs TP x PP {model_parallel}"


def test_gang_scheduling(overlay):
    name, docs = overlay
    for lws in by_kind(docs, "LeaderWorkerSet").values():
        assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # gang scheduling needs the leader with its workers
        assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        schedulers = {t["spec"].get("schedulerName") for _, t in pod_templates(lws)}
        queue = lws["metadata"].get("annotations", {}).get("scheduling.volcano.sh/queue-name")
        if GANG[name]:
            assert schedulers == {"volcano"} and queue, lws["metadata"]["name"]
        else:
            assert schedulers == {None} and queue is None, lws["metadata"]["name"]


def test_pods_share_paths_preload_jemalloc_and_keep_service_links_off(overlay):
    name, docs = overlay
    for where, _, template, c in rlfabric_containers(docs):
        spec = template["spec"]
        assert spec["enableServiceLinks"] is False, where
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlfabric", where  # NetworkPolicy
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["LD_PRELOAD"] == JEMALLOC, where
        image, _, tag = c["image"].rpartition(":")
        assert image == IMAGE[name] and tag and tag != "latest", f"{where}: {c['image']}"
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        if c["name"] != "reward":  # verifiers need no files; everything else reads the YAML's relative paths
            assert c["workingDir"] == "/data" and volumes[mounts["/data"]]["persistentVolumeClaim"] == {
                "claimName": "rlfabric-shared"}, where
        if c["name"] in ("rollout", "trainer"):
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", where
    pvc = by_kind(docs, "PersistentVolumeClaim")["rlfabric-shared"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for where, _, _, c in containers(docs):
        assert ":" in c["image"] and not c["image"].endswith(":latest"), where


def test_references_resolve(overlay):
    """Every ConfigMap named by a pod exists in the render (hash suffixes included, LWS too); every Secret
    is one that deploy/k8s/secrets.sh creates, or the optional TLS one."""
    name, docs = overlay
    configmaps = by_kind(docs, "ConfigMap")
    text = (K8S / "secrets.sh").read_text()
    for secret, keys in SECRETS.items():
        for key in keys:
            assert f"{secret}:{key}" in text, f"secrets.sh does not create {secret}/{key}"
    for where, _, template, c in containers(docs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                assert ref["configMapKeyRef"]["key"] in configmaps[ref["configMapKeyRef"]["name"]]["data"], where
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["key"] in SECRETS[ref["secretKeyRef"]["name"]], where
        for v in template["spec"].get("volumes", []):
            sources = [s["configMap"] for s in v.get("projected", {}).get("sources", []) if "configMap" in s] + (
                [v["configMap"]] if "configMap" in v else [])
            for cm in sources:
                assert cm["name"] in configmaps, f"{where}: ConfigMap {cm['name']} is not rendered"
            if "secret" in v:
                assert v["secret"]["secretName"] in OPTIONAL_SECRETS and v["secret"]["optional"] is True, where
            for src in v.get("projected", {}).get("sources", []):
                if "secret" in src:
                    keys = {i["key"] for i in src["secret"]["items"]}
                    assert keys <= SECRETS[src["secret"]["name"]], f"{where}: {src['secret']}"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in by_kind(docs, "PersistentVolumeClaim"), where
    assert re.search(r"NAMESPACE=\$\{NAMESPACE:-rlfabric\}", text)


def test_reward_autoscaler(overlay):
    name, docs = overlay
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["reward"]
    target = hpa["spec"]["scaleTargetRef"]
    deployment = by_kind(docs, target["kind"])[target["name"]]
    assert target["name"] == "reward" and "replicas" not in deployment["spec"]  # the HPA owns the count
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["requests"]["cpu"]  # utilisation is relative to the request
    assert int(arg_value(c["args"], "--processes")) == int(c["resources"]["requests"]["cpu"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_make_up_target_k8s_applies_the_rendered_overlay(repo_root):
    """`make up TARGET=k8s` renders then applies the chosen overlay; plain `make up` starts the local system."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`

    def dry(*args: str) -> str:
        done = subprocess.run(["make", "--no-print-directory", "-n", "up", *args], cwd=repo_root, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert " ".join(dry().replace("\\\n", " ").split()) == (
        "bash examples/grpo/tiny_assets.sh "  # the default config's files, made once
        ".venv/bin/rlfabric system up configs/grpo_tiny_cpu.yaml --reward-workers 1 --rollout-replicas 1 "
        "--dir runs/system")
    assert "tiny_assets" not in dry("CONFIG=configs/dapo_tiny_cpu.yaml")
    out = dry("TARGET=k8s", "OVERLAY=cuda", "KUBECTL=kc")
    assert "KUBECTL=kc bash deploy/k8s/secrets.sh" in out
    assert "kc kustomize deploy/k8s/overlays/cuda" in out
    assert "kc apply -f" in out
    assert "deploy/k8s/overlays/cpu" in dry("TARGET=k8s")


def test_tls_component_serves_every_service_over_tls(render, tmp_path, rlfabric_parser):
    """With deploy/k8s/components/tls every rlfabric container serves TLS and trusts the CA from the mounted
    rlfabric-tls Secret, and the probes no longer speak plaintext gRPC to it."""
    docs = render(with_component(tmp_path, "tls"))
    tls = "/etc/rlfabric/tls"
    seen = 0
    for where, _, template, c in rlfabric_containers(docs):
        args = c.get("args", [])
        assert arg_value(args, "--tls-cert") == f"{tls}/tls.crt", where
        assert arg_value(args, "--tls-key") == f"{tls}/tls.key", where
        assert arg_value(args, "--tls-ca") == f"{tls}/ca.crt", where
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == tls)
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "rlfabric-tls", where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                assert "grpc" not in c[probe] and c[probe]["tcpSocket"] == {"port": "grpc"}, (where, probe)
        seen += 1
    assert seen >= 7  # coordinator, rollout, reward, two trainer groups x leader/worker

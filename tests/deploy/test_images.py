"""deploy/docker: lint of the Dockerfiles (no docker engine here, so they are never built by the tests).

Every base image pinned to a tag, the shared entrypoint, jemalloc at the path the manifests preload, the
platform's extra installed (the CPU image exactly as `make setup` installs it), build-context sources that
exist and pass the Dockerfile's ignore file, and image names that the manifests and compose files use.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
import yaml
from deploy_checks import DEPLOY_DIR, ENTRYPOINT, JEMALLOC

DOCKER = DEPLOY_DIR / "docker"
REPO = DEPLOY_DIR.parent
PLATFORMS = ("cpu", "cuda", "ascend")
VERSION = "0.1.0"


def instructions(platform: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument text) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKER / platform / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            out.append((keyword.upper(), " ".join(rest.split())))
            pending = ""
    return out


def runs(platform: str) -> str:
    return "\n".join(text for keyword, text in instructions(platform) if keyword == "RUN")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_base_images_are_pinned(platform):
    args: dict[str, str] = {}
    froms = []
    for keyword, text in instructions(platform):
        if keyword == "ARG" and "=" in text:
            name, value = text.split("=", 1)
            args[name] = value
        if keyword == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text.split()[0])
            froms.append(image)
    assert froms, platform
    for image in froms:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag not in ("", "latest"), f"{platform}: {image} is not pinned to a tag"
        assert re.search(r"\d", tag), f"{platform}: {image}: the tag names no version"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_entrypoint_jemalloc_and_extra(platform):
    entrypoints = [json.loads(text) for keyword, text in instructions(platform) if keyword == "ENTRYPOINT"]
    assert entrypoints == [ENTRYPOINT]
    copies = [text.split() for keyword, text in instructions(platform) if keyword == "COPY"]
    assert ["deploy/docker/rlfabric-exec", "/usr/local/bin/rlfabric-exec"] in copies
    run = runs(platform)
    assert "libjemalloc2" in run and f"{JEMALLOC} " in run + " " and f"test -e {JEMALLOC}" in run
    assert re.search(rf"pip install (-c \S+ )?-e '\.\[{platform}\]'", run), f"{platform}: does not install .[{platform}]"
    workdirs = [text for keyword, text in instructions(platform) if keyword == "WORKDIR"]
    assert workdirs[-1] == "/data"  # the YAML's relative paths resolve in the shared directory


def test_cpu_image_installs_like_make_setup():
    """Same torch pin, constraints, removed packages and import check as deploy/local/setup_cpu.sh."""
    setup = (REPO / "deploy" / "local" / "setup_cpu.sh").read_text()
    constraints = (REPO / "requirements" / "constraints-cpu.txt").read_text()
    run = runs("cpu")
    (torch_pin,) = re.findall(r"^torch==(\S+)$", constraints, re.M)
    assert f"pip install --index-url https://download.pytorch.org/whl/cpu torch=={torch_pin}" in run
    assert "-c requirements/constraints-cpu.txt -e '.[cpu]'" in run
    removed = re.search(r"uninstall -y -q ([\w ]+?) 2>", setup).group(1).split()
    assert f"pip uninstall -y {' '.join(removed)}" in run
    (imports,) = set(re.findall(r'-c "(import [^"]+)"', setup))
    assert f'-c "{imports}"' in run
    python = next(text for keyword, text in instructions("cpu") if keyword == "FROM")
    assert python.startswith("python:3.11."), python  # the interpreter the constraints were frozen on


@pytest.mark.parametrize("platform", PLATFORMS)
def test_build_context_sources_exist_and_are_not_ignored(platform):
    ignore = [ln.strip() for ln in (DOCKER / platform / "Dockerfile.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "the ignore file is an allow-list (the repository root holds .venv, models, runs)"
    allowed = [p.removeprefix("!").rstrip("/") for p in ignore if p.startswith("!")]
    for keyword, text in instructions(platform):
        if keyword != "COPY":
            continue
        *sources, _dest = shlex.split(text)
        for source in sources:
            assert (REPO / source).exists(), f"{platform}: COPY {source}: no such path"
            assert any(source == a or source.startswith(a + "/") for a in allowed), f"{platform}: {source} is ignored"


def test_entrypoint_wrapper_runs_its_arguments():
    wrapper = DOCKER / "rlfabric-exec"
    assert wrapper.stat().st_mode & 0o111, "rlfabric-exec must be executable"
    done = subprocess.run([str(wrapper), "sh", "-c", 'printf "%s" "$1"; exit 3', "sh", "a b"], capture_output=True,
                          text=True, timeout=30)
    assert (done.stdout, done.returncode) == ("a b", 3)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_manifests_and_compose_use_the_built_image(platform):
    header = (DOCKER / platform / "Dockerfile").read_text()
    assert f"-f deploy/docker/{platform}/Dockerfile -t rlfabric-{platform}:{VERSION} ." in header
    overlay = yaml.safe_load((DEPLOY_DIR / "k8s" / "overlays" / platform / "kustomization.yaml").read_text())
    assert overlay["images"] == [{"name": "rlfabric", "newName": f"rlfabric-{platform}", "newTag": VERSION}]
    compose = "compose.yaml" if platform == "cpu" else f"compose.{platform}.yaml"
    assert f"rlfabric-{platform}:{VERSION}" in (DEPLOY_DIR / "compose" / compose).read_text()


def test_python_versions_are_supported():
    """The CUDA image's Ubuntu 24.04 Python (3.12) and the CANN image's Python are within requires-python."""
    import tomllib

    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec == ">=3.11,<3.13"
    cann = next(text for keyword, text in instructions("ascend") if keyword == "ARG" and text.startswith("CANN_IMAGE"))
    assert re.search(r"-py3\.1[12]$", cann), cann
    assert next(text for keyword, text in instructions("cuda") if keyword == "FROM").endswith("ubuntu24.04")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_image_installs_its_platform_lock(platform):
    """The image copies requirements/constraints-<platform>.txt and installs its extra under it
    (tests/deploy/test_locks.py checks the locks against the index)."""
    lock = f"requirements/constraints-{platform}.txt"
    copies = [text.split() for keyword, text in instructions(platform) if keyword == "COPY"]
    assert [lock, "requirements/"] in copies
    assert f"pip install -c {lock} -e '.[{platform}]'" in runs(platform)

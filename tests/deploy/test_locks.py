"""requirements/constraints-{cpu,cuda,ascend}.txt: every platform's lock still exists on the package index.

Resolving a whole stack with pip's dry-run report takes minutes (pip fetches each wheel's metadata with range
requests: ~160 s for the cuda set), too slow for `make test`. So the default suite checks, per platform, that
every pin of the lock has a file on the index for that platform's target (a wheel whose tags the target
interpreter accepts, or an sdist where the lock says the package is built from source), and that the pins
agree with pyproject.toml's; in parallel, ~600 index pages, seconds. `make soak` (marker `slow`) resolves
the cuda and ascend sets whole with `pip install --dry-run --report` against the lock, so a pin that no longer fits the
others fails there (for ascend without vllm-ascend's own requirements: it needs triton-ascend from Ascend's
index). Targets: cpu and cuda Linux x86_64 / Python 3.11 (`make setup`), cuda also Python 3.12 (the CUDA
image's Ubuntu 24.04), ascend Linux aarch64 / Python 3.12 (the CANN image; Atlas hosts are aarch64).

Index: PyPI's JSON simple API (PEP 691); the tests skip when it cannot be reached. Not checkable from PyPI,
and said so in the lock files: the `+cpu` local label of the CPU torch (PyTorch's own index; the public
version is checked), and Ascend's own index (triton-ascend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
# platform -> (machine, Python, pyproject extras the lock covers)
TARGETS = {"cpu": ("x86_64", (3, 11), ("cpu", "dev")), "cuda": ("x86_64", (3, 11), ("cuda",)),
           "ascend": ("aarch64", (3, 12), ("ascend",))}
# Existence is also checked for these (platform, Python) pairs beyond TARGETS' own.
EXTRA_PYTHONS = (("cuda", (3, 12)),)
# Installed without their own requirements by the full resolution (see the module docstring).
NO_DEPS = {"ascend": {"vllm-ascend"}}
# A lock line `name==version  # source: X` names where a pin comes from when it is not a PyPI wheel.
SDIST = "sdist"            # built from source (the lock says how)
NOT_ON_PYPI = "not-pypi"   # another index (the lock names it): not checked here


def lock(platform: str) -> dict[str, tuple[Version, str]]:
    """{name: (version, source)} of requirements/constraints-<platform>.txt."""
    out = {}
    for line in (REPO / "requirements" / f"constraints-{platform}.txt").read_text().splitlines():
        spec, _, comment = line.partition("#")
        if not spec.strip():
            continue
        req = Requirement(spec.strip())
        [pin] = req.specifier
        assert pin.operator == "==", f"constraints-{platform}.txt: {line!r} is not an exact pin"
        source = comment.split("source:", 1)[1].split()[0] if "source:" in comment else "wheel"
        out[canonicalize_name(req.name)] = (Version(pin.version), source)
    return out


def pyproject_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in [*project["dependencies"],
                                      *(r for e in extras for r in project["optional-dependencies"][e])]]


def platform_tags(machine: str) -> list[str]:
    return [f"manylinux_2_{m}_{machine}" for m in range(35, 4, -1)] + [f"manylinux2014_{machine}",
                                                                         f"manylinux1_{machine}", f"linux_{machine}"]


def supported_tags(machine: str, python: tuple[int, int]) -> set[Tag]:
    platforms = platform_tags(machine)
    return set(cpython_tags(python, platforms=platforms)) | set(compatible_tags(python, platforms=platforms))


def _fetch_index_files(name: str) -> tuple[str, ...]:
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return tuple(f["filename"] for f in json.load(response)["files"] if not f.get("yanked"))
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return ()
        raise


@cache
def index_files(name: str, attempts: int = 4) -> tuple[str, ...]:
    """The index's files of `name`; a failed lookup or connection (a DNS blip failed CI once mid-test) is tried
    again a few times before it counts (an HTTP error is an answer: not tried again)."""
    for attempt in range(attempts - 1):
        try:
            return _fetch_index_files(name)
        except urllib.error.HTTPError:
            raise
        except urllib.error.URLError:
            time.sleep(2.0 * (attempt + 1))
    return _fetch_index_files(name)


@pytest.fixture(scope="module")
def index() -> str:
    try:
        index_files("pip")
    except OSError as e:
        pytest.skip(f"the package index {INDEX} cannot be reached ({e}): the locks are not checked")
    return INDEX


def missing_pins(platform: str, python: tuple[int, int]) -> list[str]:
    machine = TARGETS[platform][0]
    tags = supported_tags(machine, python)
    pins = {n: p for n, p in lock(platform).items() if p[1] != NOT_ON_PYPI}
    with ThreadPoolExecutor(16) as pool:
        files = dict(zip(pins, pool.map(index_files, pins), strict=True))
    missing = []
    for name, (version, source) in sorted(pins.items()):
        ok = False
        for filename in files[name]:
            try:
                if filename.endswith(".whl"):
                    _, v, _, wheel_tags = parse_wheel_filename(filename)
                    ok = v.public == version.public and bool(wheel_tags & tags)
                elif source == SDIST and filename.endswith(".tar.gz"):
                    ok = parse_sdist_filename(filename)[1] == version
            except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
                continue  # old uploads with names today's tools refuse (as pip skips them)
            if ok:
                break
        if not ok:
            missing.append(f"{name}=={version}" + (" (sdist)" if source == SDIST else ""))
    return missing


@pytest.mark.parametrize(("platform", "python"), [(p, t[1]) for p, t in TARGETS.items()] + list(EXTRA_PYTHONS))
def test_every_pin_exists_for_the_target(index, platform, python):
    machine = TARGETS[platform][0]
    assert missing_pins(platform, python) == [], (
        f"constraints-{platform}.txt pins releases that {index} lacks for Linux {machine}, Python "
        f"{python[0]}.{python[1]}")


@pytest.mark.parametrize("platform", list(TARGETS))
def test_lock_agrees_with_pyproject(platform):
    """Every exact pin of pyproject.toml (base + the platform's extras) is the lock's version, and the lock
    pins every package pyproject names (dev tools excepted outside cpu)."""
    pins = lock(platform)
    disagree = []
    for req in pyproject_requirements(TARGETS[platform][2]):
        name = canonicalize_name(req.name)
        if name not in pins:
            disagree.append(f"{name}: not in the lock")
        elif not req.specifier.contains(pins[name][0].public, prereleases=True):
            disagree.append(f"{name}: pyproject {req.specifier}, lock {pins[name][0]}")
    assert disagree == []


def test_each_platform_pins_its_own_torch():
    """No torch for all: the base dependencies leave torch's version to the platform extras."""
    base = {canonicalize_name(r.name): r for r in pyproject_requirements(())}
    assert str(base["torch"].specifier) == ""
    torch = {p: lock(p)["torch"][0].public for p in TARGETS}
    assert torch == {"cpu": "2.13.0", "cuda": "2.13.0", "ascend": "2.10.0"}
    assert lock("ascend")["torch-npu"][0] == Version("2.10.0.post4")


def resolve(platform: str, report: Path) -> subprocess.CompletedProcess[str]:
    """`pip install --dry-run --report` of the platform's pyproject requirements under its lock, for its
    target (PyPI only, no local configuration: what a fresh machine would get)."""
    machine, python, extras = TARGETS[platform]
    pins = lock(platform)
    # Pins PyPI cannot serve as wheels are left to the lock's notes (see the module docstring).
    skip = {n for n, (_, source) in pins.items() if source != "wheel"} | NO_DEPS.get(platform, set())
    requirements = [str(r) for r in pyproject_requirements(extras) if canonicalize_name(r.name) not in skip]
    constraints = report.with_suffix(".constraints.txt")
    constraints.write_text("".join(f"{n}=={v.public}\n" for n, (v, s) in pins.items() if n not in skip))
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--target", str(report.parent / "unused"), "--only-binary=:all:",
           "--python-version", f"{python[0]}.{python[1]}", "--use-feature=fast-deps", "--index-url", INDEX,
           "-c", str(constraints)]
    for tag in platform_tags(machine):
        cmd += ["--platform", tag]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    return subprocess.run(cmd + requirements, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cuda", "ascend"])
def test_whole_lock_resolves(index, platform, tmp_path):
    """cpu is left out: its torch is PyTorch's CPU build (`+cpu`, another index), whose dependencies differ
    from PyPI's CUDA build of the same version; `make setup` installs that lock in CI instead."""
    done = resolve(platform, tmp_path / "report.json")
    assert done.returncode == 0, done.stderr[-3000:]
    pins = lock(platform)
    installed = {canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
                 for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    drift = {n: (str(v), str(pins[n][0]) if n in pins else None) for n, v in installed.items()
             if n not in pins or pins[n][0].public != v.public}
    assert drift == {}, f"constraints-{platform}.txt does not pin all it resolves to: {drift}"

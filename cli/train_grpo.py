"""MindSpeed-RL's `python cli/train_grpo.py --config-name NAME [KEY=VALUE ...]` as a thin alias of `rlfabric up`.

    python cli/train_grpo.py --config-name grpo_qwen25_7b_A3 actor_config.lr=2e-6
    ->  rlfabric up configs/grpo_qwen25_7b_A3.yaml -o actor_config.lr=2e-6

Upstream takes its config through Hydra: `--config-name NAME` (or `-cn`) names `configs/NAME.yaml` (its
`@hydra.main(config_path="../configs")`), `--config-path DIR` (`-cp`) another folder, and `section.key=value`
arguments override keys. Those map to `rlfabric up`'s config and `-o` overrides; Hydra's `+key=value` (add) and
`~key` (delete) have no rlfabric equivalent and are refused by name. Any other argument (`--run-dir DIR`,
`--resume`, `-o KEY=VALUE`, ...) goes to `rlfabric up` unchanged. The run happens on this host (`rlfabric up`); on a cluster
the services are started under deploy/ instead of a Ray cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROG = "cli/train_grpo.py"


def _configs() -> Path:
    """configs/ beside cli/ (unresolved: a linked checkout keeps its own), relative to here when it is below."""
    folder = Path(__file__).absolute().parents[1] / "configs"
    return folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder


def to_up_argv(argv: list[str]) -> list[str] | str:
    """`rlfabric up` argv for upstream's Hydra-style arguments, or a message naming the argument it cannot take."""
    name, folder, overrides, passed = None, _configs(), [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in ("--config-name", "-cn", "--config-path", "-cp"):
            if not eq:
                if i + 1 >= len(argv):
                    return f"{flag} needs a value"
                i, value = i + 1, argv[i + 1]
            if flag in ("--config-name", "-cn"):
                name = value
            else:
                folder = Path(value)
        elif arg in ("-o", "--override"):  # rlfabric's own override flag, as `rlfabric up` takes it
            if i + 1 >= len(argv):
                return f"{arg} needs a value"
            i, overrides = i + 1, [*overrides, "-o", argv[i + 1]]
        elif arg.startswith(("+", "~")):
            return (f"{arg}: Hydra's `+key=value` / `~key` are not supported; override keys the config has with "
                    f"section.key=value, or edit the YAML")
        elif not arg.startswith("-") and "=" in arg:
            overrides += ["-o", arg]
        else:
            passed.append(arg)
        i += 1
    if name is None:
        return "--config-name NAME is required (a file configs/NAME.yaml, e.g. grpo_qwen25_7b_A3)"
    config = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not config.is_file():
        known = " ".join(sorted(p.stem for p in folder.glob("*.yaml"))) if folder.is_dir() else "none"
        return f"--config-name {name}: no file {config} (configs there: {known})"
    return ["up", str(config), *overrides, *passed]


def main(argv: list[str] | None = None) -> int:
    target = to_up_argv(sys.argv[1:] if argv is None else argv)
    if isinstance(target, str):
        print(f"{PROG}: error: {target}", file=sys.stderr)
        return 2
    from services.cli import main as rlfabric

    return rlfabric(target)


if __name__ == "__main__":
    sys.exit(main())

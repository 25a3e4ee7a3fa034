"""Generate the Python gRPC stubs from `protos/` (used by `make proto` and the drift test).

The stubs are committed so that a checkout runs without grpcio-tools; `tests/common/test_protos.py`
regenerates them into a temporary folder and fails when the committed copies differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "rlfabric" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto file; returns the generated files (relative to `out_dir`)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    gen = out_dir / "rlfabric" / "v1"
    return sorted(p.relative_to(out_dir) for p in gen.iterdir() if p.name.endswith((".py", ".pyi")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        if path.name != "__init__.py":
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

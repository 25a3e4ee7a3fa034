"""The committed stubs match the .proto files, and the contract keeps its documented shape."""

from __future__ import annotations

import re
from pathlib import Path

from services.common import protogen


def test_generated_stubs_do_not_drift(tmp_path: Path, repo_root: Path) -> None:
    generated = protogen.generate(tmp_path)
    assert len(generated) == 18  # 6 protos x (_pb2.py, _pb2.pyi, _pb2_grpc.py)
    for rel in generated:
        committed = repo_root / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} drifted: run `make proto`"


def test_every_service_is_defined() -> None:
    from rlfabric.v1 import coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2, verifier_pb2

    services = {
        name
        for module in (coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2, verifier_pb2)
        for name in module.DESCRIPTOR.services_by_name
    }
    assert services == {"Coordinator", "Reward", "Rollout", "Trainer", "Verifier"}


def test_every_field_message_and_rpc_is_commented(repo_root: Path) -> None:
    undocumented = []
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = re.match(r"^(repeated |optional )?[\w.]+ \w+ = \d+;", stripped)
            is_decl = re.match(r"^(message|service|enum|rpc) ", stripped) or re.match(r"^[A-Z_]+ = \d+;", stripped)
            if (is_field or is_decl) and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {stripped}")
    assert not undocumented, "\n".join(undocumented)


def test_package_is_versioned(repo_root: Path) -> None:
    for proto in protogen.proto_files():
        assert "package rlfabric.v1;" in proto.read_text(), proto
        assert proto.parent == repo_root / "protos" / "rlfabric" / "v1"

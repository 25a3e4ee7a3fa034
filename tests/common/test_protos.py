"""The committed stubs match the .proto files, and the contract keeps its documented shape."""

from __future__ import annotations

import re
from pathlib import Path

from services.common import protogen


def test_generated_stubs_do_not_drift(tmp_path: Path, repo_root: Path) -> None:
    generated = protogen.generate(tmp_path)
    assert len(generated) == 21  # 7 protos x (_pb2.py, _pb2.pyi, _pb2_grpc.py)
    for rel in generated:
        committed = repo_root / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} drifted: run `make proto`"


def test_every_service_is_defined() -> None:
    from rlfabric.v1 import coordinator_pb2, reward_pb2, rollout_pb2, tool_pb2, trainer_pb2, verifier_pb2

    services = {
        name
        for module in (coordinator_pb2, reward_pb2, rollout_pb2, tool_pb2, trainer_pb2, verifier_pb2)
        for name in module.DESCRIPTOR.services_by_name
    }
    assert services == {"Coordinator", "Reward", "Rollout", "Tool", "Trainer", "Verifier"}


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



def _rpc_comments(proto: Path) -> dict[str, str]:
    """rpc name -> the comment block right above it."""
    lines = proto.read_text().splitlines()
    out = {}
    for i, line in enumerate(lines):
        match = re.match(r"\s*rpc (\w+)\(", line)
        if not match:
            continue
        block = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("//"):
            block.insert(0, lines[j].strip().removeprefix("//").strip())
            j -= 1
        out[match.group(1)] = " ".join(block)
    return out


def test_every_rpc_lists_its_error_codes_and_whether_to_retry() -> None:
    import grpc

    codes = {c.name for c in grpc.StatusCode} - {"OK"}
    missing = []
    for proto in protogen.proto_files():
        for rpc, comment in _rpc_comments(proto).items():
            # "any code": a contract others implement (Verifier.Verify) may end a stream with whatever it needs.
            names_a_code = (any(re.search(rf"\b{c}\b", comment) for c in codes) or "Errors: none" in comment
                            or "any code" in comment)
            says_retry = re.search(r"retry|idempotent", comment, re.IGNORECASE)
            if not (names_a_code and says_retry):
                missing.append(f"{proto.name} {rpc}: " + ("" if names_a_code else "no status code; ")
                               + ("" if says_retry else "no retry statement"))
    assert not missing, "\n".join(missing)


def test_the_contract_is_typed() -> None:
    """No dtype as a string, no JSON in bytes: enums and messages."""
    for proto in protogen.proto_files():
        text = proto.read_text()
        assert not re.search(r"^\s*string dtype = ", text, re.MULTILINE), proto.name
        assert not re.search(r"^\s*bytes plan = ", text, re.MULTILINE), proto.name
        assert not re.search(r"^\s*string transport = ", text, re.MULTILINE), proto.name

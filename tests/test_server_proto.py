"""The committed gRPC stubs are what scripts/gen_protos.sh generates from the committed .proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "server" / "proto"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["nice", "-n", "19", "bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    generated = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert generated == ["policy_service_pb2.py", "policy_service_pb2.pyi", "policy_service_pb2_grpc.py"]
    for name in generated:
        assert (PROTO_DIR / name).read_text() == (tmp_path / name).read_text(), (
            f"server/proto/{name} is stale: run scripts/gen_protos.sh"
        )


def test_stubs_import_as_a_package() -> None:
    """The generated grpc module's import of the messages module is relative (works without sys.path hacks)."""
    text = (PROTO_DIR / "policy_service_pb2_grpc.py").read_text()
    assert "from . import policy_service_pb2 as" in text
    from server.proto import policy_service_pb2, policy_service_pb2_grpc

    assert policy_service_pb2.DESCRIPTOR.package == "vla_rl.v1"
    assert hasattr(policy_service_pb2_grpc, "PolicyServiceStub")

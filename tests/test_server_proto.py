"""The committed gRPC stubs are what scripts/gen_protos.sh generates from the committed .proto files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "packages" / "vla-rl-client" / "vla_rl_client" / "proto"
STUBS = [
    f"{stem}{suffix}"
    for stem in ("collector", "policy_service")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["nice", "-n", "19", "bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    generated = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert generated == STUBS
    for name in generated:
        assert (PROTO_DIR / name).read_text() == (tmp_path / name).read_text(), (
            f"{PROTO_DIR.relative_to(ROOT)}/{name} is stale: run scripts/gen_protos.sh"
        )


def test_stubs_import_as_a_package() -> None:
    """The generated modules import each other relatively (no sys.path hacks), and the collector's
    messages carry the policy service's Tensor."""
    for stem in ("policy_service", "collector"):
        assert f"from . import {stem}_pb2 as" in (PROTO_DIR / f"{stem}_pb2_grpc.py").read_text()
    assert "from . import policy_service_pb2 as" in (PROTO_DIR / "collector_pb2.py").read_text()
    from vla_rl_client.proto import (
        collector_pb2,
        collector_pb2_grpc,
        policy_service_pb2,
        policy_service_pb2_grpc,
    )

    assert policy_service_pb2.DESCRIPTOR.package == "vla_rl.v1"
    assert hasattr(policy_service_pb2_grpc, "PolicyServiceStub")
    assert collector_pb2.DESCRIPTOR.package == "vla_rl.fleet.v1"
    assert hasattr(collector_pb2_grpc, "CollectorStub")
    batch = collector_pb2.FrameBatch(state=policy_service_pb2.Tensor(dtype="float32", shape=[1, 2]))
    assert list(batch.state.shape) == [1, 2]

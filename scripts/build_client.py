"""Build ``vla-rl-client``: the robot-side modules as their own wheel, needing only numpy, grpcio, protobuf
and Pillow (no torch, lerobot, mani-skill, zarr or SQLAlchemy).

    python -m scripts.build_client --out dist/          # from the repo root; prints the wheel's path
    pip install dist/vla_rl_client-*.whl                 # on the robot (extra [health]: client.health())

It holds the policy clients (``server.client``, ``server.aio_client``, ``server.client_common``), the
action queue, the tensor codec, the robot spec, the fleet robot client with its wire encoding and episode
types, and the generated stubs: :data:`CLIENT_FILES`, taken from this source tree as they are. Before
staging them, the import graph (``scripts/import_graph.py``) must show that importing them loads nothing
outside that list, and that nothing else they import is outside :data:`ALLOWED_IMPORTS` and the standard
library. Do not install it next to the full ``vla-rl`` distribution: both provide these packages.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from scripts.import_graph import ROOT, Graph, build, closure

NAME = "vla-rl-client"
CLIENT_FILES = (
    "vla_rl/__init__.py",
    "vla_rl/spec.py",
    "server/__init__.py",
    "server/action_queue.py",
    "server/aio_client.py",
    "server/client.py",
    "server/client_common.py",
    "server/codec.py",
    "server/proto/__init__.py",
    "server/proto/policy_service_pb2.py",
    "server/proto/policy_service_pb2_grpc.py",
    "fleet/__init__.py",
    "fleet/meta.py",
    "fleet/robot_client.py",
    "fleet/wire.py",
    "fleet/proto/__init__.py",
    "fleet/proto/collector_pb2.py",
    "fleet/proto/collector_pb2_grpc.py",
)
PACKAGE_DATA = ("*.pyi", "*.proto")  # next to the generated stubs: type stubs and the contracts
# Distribution -> the top-level module it provides. Version specifiers come from the main pyproject.toml;
# where it has none, the generated stubs' minimum (they refuse an older grpcio / protobuf runtime).
DEPENDENCIES = {"numpy": "numpy", "grpcio": "grpc", "protobuf": "google", "Pillow": "PIL"}
STUB_RUNTIMES = {"grpcio": ">=1.85.1", "protobuf": ">=7.35.1,<8"}
# Extra -> (requirement, the module it provides): client.health() imports grpc_health when it is called.
OPTIONAL = {"health": ("grpcio-health-checking>=1.85.1", "grpc_health")}
ALLOWED_IMPORTS = frozenset(DEPENDENCIES.values()) | {module for _, module in OPTIONAL.values()}


def check_self_contained(graph: Graph, files: tuple[str, ...] = CLIENT_FILES) -> list[str]:
    """Problems that would make the client package import something it does not ship (empty: none)."""
    problems = [f"{f}: not in the source tree" for f in files if f not in graph.edges]
    if problems:
        return problems
    listed = set(files)
    for f in sorted(closure(graph, files) - listed):
        why = [str(e) for src in files for e in graph.edges[src] if e.dst == f]
        problems.append(f"{f} is loaded but not in the package: " + ("; ".join(why) or "a package __init__"))
    for f in files:
        extra = graph.external[f] - ALLOWED_IMPORTS - sys.stdlib_module_names
        if extra:
            problems.append(f"{f} imports {sorted(extra)}: not a dependency of {NAME}")
    return problems


def _dependencies(root: Path) -> list[str]:
    main = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower(): d for d in main}
    out = []
    for dist in DEPENDENCIES:
        spec = by_name.get(dist.lower(), dist)
        out.append(spec if spec != dist else dist + STUB_RUNTIMES.get(dist, ""))
    return out


def pyproject(root: Path = ROOT) -> str:
    """The generated pyproject.toml of the client distribution."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    packages = sorted({str(Path(f).parent).replace("/", ".") for f in CLIENT_FILES})
    q = '", "'
    optional = "\n".join(f'{extra} = ["{req}"]' for extra, (req, _) in OPTIONAL.items())
    data = "\n".join(f'"{p}" = ["{q.join(PACKAGE_DATA)}"]' for p in packages if p.endswith(".proto"))
    return f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{NAME}"
version = "{project["version"]}"
description = "Robot side of vla-rl: policy clients, action queue, tensor codec, robot spec, fleet robot client."
requires-python = "{project["requires-python"]}"
license = "{project["license"]}"
dependencies = ["{q.join(_dependencies(root))}"]

[project.optional-dependencies]
{optional}

[tool.setuptools]
packages = ["{q.join(packages)}"]

[tool.setuptools.package-data]
{data}
"""


def stage(dest: Path, root: Path = ROOT) -> None:
    """Copy the client's files (and the stubs' package data) into ``dest`` with its pyproject.toml."""
    for rel in CLIENT_FILES:
        src = root / rel
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
        if src.parent.name == "proto":
            for pattern in PACKAGE_DATA:
                for extra in src.parent.glob(pattern):
                    shutil.copy2(extra, dest / rel.rsplit("/", 1)[0] / extra.name)
    (dest / "pyproject.toml").write_text(pyproject(root))


def build_wheel(out: Path, root: Path = ROOT) -> Path:
    """Check, stage and build the wheel into ``out`` with this interpreter's setuptools; its path."""
    problems = check_self_contained(build(root))
    if problems:
        raise SystemExit(f"{NAME} would not be self-contained:\n  " + "\n  ".join(problems))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vla-rl-client-") as tmp:
        stage(Path(tmp), root)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(out),
        ]
        subprocess.run([*cmd, tmp], check=True)
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    return out / f"{NAME.replace('-', '_')}-{version}-py3-none-any.whl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.build_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "dist", help="folder for the wheel (default: dist/)")
    p.add_argument("--check", action="store_true", help="only check that the package is self-contained")
    args = p.parse_args(argv)
    if args.check:
        problems = check_self_contained(build())
        print("\n".join(problems) or f"{NAME}: self-contained")
        return 1 if problems else 0
    print(build_wheel(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Imports go one way: no file-level import cycle, a bottom layer of contracts, a self-contained client.

The graph is read with ``ast`` by ``scripts/import_graph.py`` (every import anywhere in a file counts,
function-local and ``TYPE_CHECKING`` ones too); the checks are tried on a small fake tree first.
"""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from scripts.build_client import CLIENT_FILES, check_self_contained
from scripts.import_graph import Graph, build, cycles

# The bottom layer: what every side agrees on (robot spec, tensor codec, wire encoding and protos, episode
# types). It imports nothing of ours from above it.
CONTRACTS = (
    "vla_rl/spec.py",
    "server/codec.py",
    "server/proto/__init__.py",
    "server/proto/policy_service_pb2.py",
    "server/proto/policy_service_pb2_grpc.py",
    "fleet/proto/__init__.py",
    "fleet/proto/collector_pb2.py",
    "fleet/proto/collector_pb2_grpc.py",
    "fleet/meta.py",
    "fleet/wire.py",
)

# Packages below others: the fleet (collector, store, metadata DB, auto-flags) records what simulators and
# policies do and is imported by them (sim/fleet_runner.py), never the other way.
BELOW: dict[str, tuple[str, ...]] = {"fleet": ("sim", "policies")}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(dedent(text))
    return root


def _report(found: list) -> str:
    return "\n".join("import cycle:\n  " + "\n  ".join(map(str, cyc)) for cyc in found)


# ------------------------------------------------------------------------------------------ the checker
def test_checker_finds_cycles_through_every_kind_of_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a/__init__.py": "from a.top import T\n",  # a package re-export is no edge from its modules
            "a/top.py": "T = 1\n",
            "a/x.py": """
                def f():
                    from a import y  # function-local, `from pkg import module`
                    return y
            """,
            "a/y.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from .sub.z import Z  # relative
            """,
            "a/sub/__init__.py": "",
            "a/sub/z.py": "import a.x\nimport numpy\nZ = 0\n",
            "b/__init__.py": "",
            "b/w.py": "from a.top import T\nfrom ..a import x\n",  # out of a cycle
        },
    )
    g = build(root, ("a", "b"))
    assert g.targets("a/x.py") == {"a/y.py"}
    assert g.targets("a/sub/z.py") == {"a/x.py"} and g.external["a/sub/z.py"] == {"numpy"}
    found = cycles(g)
    assert len(found) == 1, _report(found)
    [cyc] = found
    assert [e.src for e in cyc] == ["a/sub/z.py", "a/x.py", "a/y.py"]
    assert [e.names for e in cyc] == [("a.x",), ("y",), ("Z",)]
    assert "a/y.py:4 -> a/sub/z.py (Z)" in _report(found)
    # cut the cycle: none left
    (root / "a/y.py").write_text("Y = 2\n")
    assert cycles(build(root, ("a", "b"))) == []


def test_checker_finds_what_a_client_would_be_missing(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "c/__init__.py": "import c.heavy\n",  # an __init__ that pulls in more than its package
            "c/light.py": "import json\nfrom c import spec\n",
            "c/spec.py": "import torch\n",
            "c/heavy.py": "",
        },
    )
    problems = check_self_contained(build(root, ("c",)), ("c/__init__.py", "c/light.py", "c/spec.py"))
    assert len(problems) == 2, problems
    assert problems[0].startswith("c/heavy.py is loaded but not in the package")
    assert problems[1] == "c/spec.py imports ['torch']: not a dependency of vla-rl-client"


# ------------------------------------------------------------------------------------------ this tree
def test_no_import_cycle(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, _report(found)


def test_contract_layer_imports_only_contracts(graph: Graph) -> None:
    assert set(CONTRACTS) <= set(graph.edges)
    wrong = [str(e) for f in CONTRACTS for e in graph.edges[f] if e.dst not in CONTRACTS]
    assert not wrong, "the contract layer imports from above it:\n" + "\n".join(wrong)


def test_lower_packages_do_not_import_upper_ones(graph: Graph) -> None:
    wrong = [
        str(e)
        for low, ups in BELOW.items()
        for f, es in graph.edges.items()
        if f.startswith(f"{low}/")
        for e in es
        if e.dst.split("/")[0] in ups
    ]
    assert any(f.startswith("fleet/") for f in graph.edges) and any(f.startswith("sim/") for f in graph.edges)
    assert not wrong, "a lower package imports from above it:\n" + "\n".join(wrong)


def test_client_package_is_self_contained(graph: Graph) -> None:
    problems = check_self_contained(graph)
    assert not problems, "\n".join(problems)
    assert {"fleet/robot_client.py", "server/client.py", "fleet/meta.py"} <= set(CLIENT_FILES)

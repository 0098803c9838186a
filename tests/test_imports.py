"""Imports go one way: no file-level import cycle, no import running up a floor or sideways between rooms,
and a client package that installs alone.

The graph is read with ``ast`` by ``scripts/import_graph.py`` (every import anywhere in a file counts,
function-local and ``TYPE_CHECKING`` ones too); the checks are tried on a small fake tree first. The
floors and rooms are ``scripts.import_graph.ROOMS`` (drawn in docs/architecture.md).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from textwrap import dedent

import pytest

from scripts.import_graph import (
    CLIENT_DEPENDENCIES,
    CLIENT_OPTIONAL,
    PACKAGES,
    ROOMS,
    ROOT,
    Graph,
    Room,
    build,
    client_problems,
    cycles,
    room_of,
    upward,
)


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


def test_checker_finds_imports_running_up_or_sideways(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "import json\n",
            "low/b.py": "from low import a\n",  # inside its own room: fine
            "mid/__init__.py": "",
            "mid/x.py": "from low.a import *\n",  # down a floor: fine
            "mid/y.py": "def f():\n    from side.z import Z\n",  # sideways, function-local
            "side/__init__.py": "",
            "side/z.py": "Z = 1\n",
            "top/__init__.py": "",
            "top/t.py": "import mid.x\n",
            "low/c.py": "from top import t\n",  # up two floors
        },
    )
    rooms = (
        Room("low", 0, ("low/",)),
        Room("mid", 1, ("mid/",)),
        Room("side", 1, ("side/",)),
        Room("top", 2, ("top/",)),
    )
    g = build(root, ("low", "mid", "side", "top"))
    wrong = sorted(map(str, upward(g, rooms)))
    assert wrong == ["low/c.py:1 -> top/t.py (t)", "mid/y.py:2 -> side/z.py (Z)"], wrong
    assert room_of("mid/x.py", rooms) == rooms[1] and room_of("else/q.py", rooms) is None


def test_checker_finds_what_the_client_would_be_missing(tmp_path: Path) -> None:
    client = "packages/vla-rl-client/vla_rl_client"
    root = _tree(
        tmp_path,
        {
            f"{client}/__init__.py": "",
            f"{client}/spec.py": "import numpy\nimport torch\n",  # torch: not a client dependency
            f"{client}/client.py": "import grpc\nfrom vla_rl_client import spec\nfrom app import heavy\n",
            "app/__init__.py": "",
            "app/heavy.py": "",
        },
    )
    problems = client_problems(build(root, (client, "app")))
    assert problems == [
        "app/__init__.py is loaded but not in vla-rl-client: a package __init__",
        f"app/heavy.py is loaded but not in vla-rl-client: {client}/client.py:3 -> app/heavy.py (heavy)",
        f"{client}/spec.py imports ['torch']: not a dependency of vla-rl-client",
    ], problems


# ------------------------------------------------------------------------------------------ this tree
def test_no_import_cycle(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, _report(found)


def test_every_file_is_in_a_room(graph: Graph) -> None:
    homeless = [f for f in graph.edges if room_of(f) is None]
    assert not homeless, "files in no room of scripts.import_graph.ROOMS:\n" + "\n".join(homeless)
    assert len(graph.edges) > 100 and {r.name for r in ROOMS} == {room_of(f).name for f in graph.edges}  # type: ignore[union-attr]


def test_no_import_runs_up_a_floor_or_sideways(graph: Graph) -> None:
    wrong = upward(graph)
    assert not wrong, "imports running up a floor or into a room beside their own:\n" + "\n".join(
        f"{e}  ({room_of(e.src).name} -> {room_of(e.dst).name})"  # type: ignore[union-attr]
        for e in wrong
    )


def test_ground_floor_imports_nothing_above_it(graph: Graph) -> None:
    """The contracts (vla-rl-client) import nothing of ours outside them; the runtime (vla_rl/core) only
    them: the direction rule spelled out for the bottom, where a slip would cost the most."""
    for room, allowed in (("client", {"client"}), ("core", {"client", "core"})):
        files = [f for f in graph.edges if room_of(f).name == room]  # type: ignore[union-attr]
        assert files
        out = {room_of(e.dst).name for f in files for e in graph.edges[f]}  # type: ignore[union-attr]
        assert out <= allowed, (room, out)


def test_client_package_installs_alone(graph: Graph) -> None:
    problems = client_problems(graph)
    assert not problems, "\n".join(problems)
    client = ROOT / "packages" / "vla-rl-client"
    meta = tomllib.loads((client / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in meta["dependencies"]}
    assert deps == set(CLIENT_DEPENDENCIES), deps
    extra = {d.split(">")[0].strip() for d in meta["optional-dependencies"]["health"]}
    assert extra == set(CLIENT_OPTIONAL)
    # the full distribution depends on exactly this version of it
    full = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"vla-rl-client=={meta['version']}" in full["dependencies"]
    import vla_rl_client

    assert vla_rl_client.__version__ == meta["version"]
    assert PACKAGES[0] == "packages/vla-rl-client/vla_rl_client"

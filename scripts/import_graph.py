"""The file-level import graph of our packages, read with ``ast`` (nothing is imported or run).

Every ``import`` / ``from ... import`` anywhere in a file counts: module level, inside functions, under
``if TYPE_CHECKING``. Relative imports are resolved; ``from pkg import name`` points at ``pkg/name.py``
when that is a module, else at ``pkg``'s own file; ``import a.b.c`` points at the deepest of ``a.b.c``,
``a.b``, ``a`` that is one of our files. Importing a package's submodule also runs the package's
``__init__.py``; that is not an edge here (it would make every package with re-exports a cycle), but
:func:`closure` adds it when asking "what does importing this file load".

``tests/test_imports.py`` checks the graph: no cycle, no import running up a floor or sideways between the
rooms of :data:`ROOMS`, and a client package (``packages/vla-rl-client``) that loads nothing of ours
outside it. ``python -m scripts.import_graph`` prints the cycles, the wrong-way imports and the arrows
between rooms of this checkout.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("packages/vla-rl-client/vla_rl_client", "vla_rl", "fleet", "sim", "policies", "server")
"""Our packages, as folders under the repo root (a package's module names start at its folder's parent)."""
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``names`` from ``dst`` (repo-relative file paths) at line ``line``."""

    src: str
    dst: str
    names: tuple[str, ...]
    line: int

    def __str__(self) -> str:
        return f"{self.src}:{self.line} -> {self.dst} ({', '.join(self.names)})"


@dataclass(frozen=True)
class Graph:
    modules: dict[str, str]  # dotted module name -> repo-relative file
    edges: dict[str, list[Edge]]  # file -> its imports of our files
    external: dict[str, set[str]]  # file -> top-level names of other distributions / the stdlib

    def targets(self, src: str) -> set[str]:
        return {e.dst for e in self.edges.get(src, ())}


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Dotted module name -> repo-relative path of every ``.py`` file under ``packages``."""
    out: dict[str, str] = {}
    for pkg in packages:
        base = (root / pkg).parent
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = rel.as_posix()
    return out


def _deepest(name: str, modules: Mapping[str, str]) -> str | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in modules:
            return cand
    return None


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from`` import reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def file_imports(
    root: Path, rel: str, module: str, modules: Mapping[str, str]
) -> tuple[list[Edge], set[str]]:
    """The edges from one file to our files, and the top-level names of everything else it imports."""
    tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=rel)
    is_package = rel.endswith("__init__.py")
    ours = {m.split(".")[0] for m in modules}
    names: dict[str, list[str]] = {}  # target file -> names imported from it
    first: dict[str, int] = {}  # target file -> first line importing it
    external: set[str] = set()

    def add(target: str, name: str, line: int) -> None:
        dst = modules[target]
        names.setdefault(dst, []).append(name)
        first[dst] = min(first.get(dst, line), line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _deepest(alias.name, modules)
                if target is None:
                    external.add(alias.name.split(".")[0])
                else:
                    add(target, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, module, is_package)
            if base.split(".")[0] not in ours:
                external.add(base.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _deepest(base, modules)
                if target is not None:
                    add(target, alias.name, node.lineno)
    edges = [Edge(rel, dst, tuple(names[dst]), first[dst]) for dst in sorted(names) if dst != rel]
    return edges, external - {"__future__"}


def build(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    modules = module_files(root, packages)
    edges: dict[str, list[Edge]] = {}
    external: dict[str, set[str]] = {}
    for module, rel in modules.items():
        edges[rel], external[rel] = file_imports(root, rel, module, modules)
    return Graph(modules, edges, external)


def cycles(graph: Graph) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected group of files that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.targets(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph.edges) + 100))
    try:
        for v in sorted(graph.edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(graph, set(g), g[0]) for g in sorted(groups)]


def _cycle_in(graph: Graph, group: set[str], start: str) -> list[Edge]:
    """The shortest path ``start -> ... -> start`` inside ``group`` (breadth first)."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in graph.edges[v]:
                if e.dst not in group or e.dst in came:
                    continue
                came[e.dst] = e
                if e.dst == start:
                    path = [e]
                    while path[0].src != start:
                        path.insert(0, came[path[0].src])
                    return path
                nxt.append(e.dst)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle of {sorted(group)}")


def closure(graph: Graph, files: Iterable[str]) -> set[str]:
    """Every file that importing ``files`` loads: their imports, and the ``__init__.py`` of each package
    a loaded file is in, recursively."""
    by_file = {rel: mod for mod, rel in graph.modules.items()}
    seen: set[str] = set()
    todo = list(files)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo.extend(graph.targets(rel))
        parts = by_file[rel].split(".")
        todo.extend(p for k in range(1, len(parts)) if (p := graph.modules.get(".".join(parts[:k]))))
    return seen


# ------------------------------------------------------------------------------------------------ layers
@dataclass(frozen=True)
class Room:
    """A set of files (path prefixes, repo-relative) on one floor of the house."""

    name: str
    floor: int
    prefixes: tuple[str, ...]

    def holds(self, rel: str) -> bool:
        return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in self.prefixes)


# The floors, bottom up. A file may import files of its own room and of any room on a lower floor; never a
# room beside it on the same floor, never one above. docs/architecture.md draws them and says what each owns.
ROOMS: tuple[Room, ...] = (
    Room("client", 0, ("packages/vla-rl-client/vla_rl_client/",)),  # contracts + robot-side clients
    Room("core", 1, ("vla_rl/core/",)),  # runtime every service shares
    Room("registry", 2, ("vla_rl/hub/",)),  # checkpoint format, Hub client, embedded Hub server
    Room("fleet", 3, ("fleet/",)),  # episode store, metadata DB, collector
    Room("policies", 3, ("policies/",)),  # flow-policy models, critics, loading a checkpoint
    Room("sim", 4, ("sim/",)),  # simulated robots, experts, operator, sim fleet (records into fleet/)
    Room("server", 5, ("server/",)),  # the policy server
    Room("training", 6, ("vla_rl/train/", "vla_rl/evaluation.py", "vla_rl/evaluation_offline.py")),
    Room(
        "rounds",
        7,
        (
            "vla_rl/rounds.py",
            "vla_rl/round_worker.py",
            "vla_rl/gate.py",
            "vla_rl/gate_stats.py",
            "vla_rl/gate_success.py",
            "vla_rl/canary.py",
        ),
    ),
    Room("dashboard", 8, ("vla_rl/dashboard/",)),
    Room("jobs", 9, ("vla_rl/up/", "vla_rl/demo.py")),
    Room("cli", 10, ("vla_rl/cli/", "vla_rl/__init__.py")),
)


def room_of(rel: str, rooms: Iterable[Room] = ROOMS) -> Room | None:
    """The room holding file ``rel`` (None: the file is in no room)."""
    return next((r for r in rooms if r.holds(rel)), None)


def upward(graph: Graph, rooms: tuple[Room, ...] = ROOMS) -> list[Edge]:
    """Every import that runs up a floor or sideways into a room beside its own."""
    wrong = []
    for src, es in graph.edges.items():
        a = room_of(src, rooms)
        for e in es:
            b = room_of(e.dst, rooms)
            if a is not None and b is not None and a != b and b.floor >= a.floor:
                wrong.append(e)
    return wrong


def room_arrows(graph: Graph, rooms: tuple[Room, ...] = ROOMS) -> dict[tuple[str, str], int]:
    """Room -> room import counts (edges between files of two different rooms)."""
    out: dict[tuple[str, str], int] = {}
    for src, es in graph.edges.items():
        a = room_of(src, rooms)
        for e in es:
            b = room_of(e.dst, rooms)
            if a is not None and b is not None and a != b:
                out[(a.name, b.name)] = out.get((a.name, b.name), 0) + 1
    return out


# ------------------------------------------------------------------------------------ the client package
CLIENT = "packages/vla-rl-client/vla_rl_client/"
# vla-rl-client's dependencies (distribution -> the top-level module it provides), and its [health] extra
CLIENT_DEPENDENCIES = {"numpy": "numpy", "grpcio": "grpc", "protobuf": "google", "Pillow": "PIL"}
CLIENT_OPTIONAL = {"grpcio-health-checking": "grpc_health"}


def client_problems(graph: Graph) -> list[str]:
    """What would keep vla-rl-client from installing alone: a file of ours outside it that importing it
    loads, or a module that is neither its dependency nor the standard library."""
    files = [f for f in graph.edges if f.startswith(CLIENT)]
    problems = []
    for f in sorted(closure(graph, files) - set(files)):
        why = [str(e) for src in files for e in graph.edges[src] if e.dst == f]
        problems.append(
            f"{f} is loaded but not in vla-rl-client: " + ("; ".join(why) or "a package __init__")
        )
    allowed = set(CLIENT_DEPENDENCIES.values()) | set(CLIENT_OPTIONAL.values())
    for f in files:
        extra = graph.external[f] - allowed - sys.stdlib_module_names
        if extra:
            problems.append(f"{f} imports {sorted(extra)}: not a dependency of vla-rl-client")
    return problems


def main() -> int:
    graph = build()
    found = cycles(graph)
    for cyc in found:
        print("cycle:\n  " + "\n  ".join(map(str, cyc)))
    wrong = upward(graph)
    for e in wrong:
        print(f"up or sideways: {e}  ({room_of(e.src).name} -> {room_of(e.dst).name})")  # type: ignore[union-attr]
    print("room arrows (imports):")
    for (a, b), n in sorted(room_arrows(graph).items()):
        print(f"  {a:>9} -> {b:<9} {n}")
    print(f"{len(found)} import cycle(s), {len(wrong)} import(s) running up or sideways")
    return 1 if found or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``vla-rl`` command line.

    vla-rl demo                       generate demonstrations and show what the store holds
    vla-rl sim list                   simulated tasks, observation modes and robot specs
    vla-rl sim demos --task T ...     record scripted-expert demonstrations into an episode store
    vla-rl store info PATH            episodes, frames, bytes, per-task success
    vla-rl store verify PATH          integrity check (exit code 1 on any inconsistency)

Every command takes ``--log-format json`` for structured logs and ``--help`` for its options.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vla_rl import __version__
from vla_rl.logs import setup_logging

log = logging.getLogger("vla_rl")

DEFAULT_STORE = Path("runs/demo/store")


class CliError(Exception):
    """A user-facing error: printed as one line with a hint, exit code 2."""


# ---------------------------------------------------------------------------- helpers
def _open_db(store_root: Path, url: str | None) -> Any:
    from fleet.db import MetadataDB

    return MetadataDB(url) if url else MetadataDB.for_store(store_root)


def _open_store(path: Path, create: bool = False, db_url: str | None = None) -> tuple[Any, Any]:
    from fleet.store import EpisodeStore

    try:
        store = EpisodeStore(path, create=create)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(f"{e}. Create one with: vla-rl sim demos --store {path} ...") from None
    return store, _open_db(store.root, db_url)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------------------- sim
def cmd_sim_list(args: argparse.Namespace) -> int:
    from sim.registry import list_tasks

    tasks = list_tasks()
    if args.json:
        print(json.dumps([t.__dict__ for t in tasks], indent=2))
        return 0
    rows = [
        [
            t.name,
            "state, rgb",
            f"{t.state_dim['state']} / {t.state_dim['rgb']}",
            f"{t.action_dim} (dx, dy, dz, gripper)",
            ", ".join(t.cameras),
            f"{t.control_hz:g} Hz",
            str(t.max_episode_steps),
            t.instruction,
        ]
        for t in tasks
    ]
    header = [
        "task",
        "obs",
        "state dim (state/rgb)",
        "action",
        "cameras (rgb)",
        "rate",
        "steps",
        "instruction",
    ]
    print(_table(rows, header))
    print("\nActions are float32 in [-1, 1]; gripper +1 opens, -1 closes. Images are uint8 HxWx3.")
    return 0


def cmd_sim_demos(args: argparse.Namespace) -> int:
    from sim.demos import record_demos
    from sim.registry import resolve_task

    try:
        task = resolve_task(args.task).name
    except ValueError as e:
        raise CliError(f"--task {e}. See: vla-rl sim list") from None
    store, db = _open_store(args.store, create=True, db_url=args.db)
    store.db = db
    report = record_demos(
        store,
        task,
        episodes=args.episodes,
        noise=args.noise,
        seed=args.seed,
        obs=args.obs,
        image_size=args.image_size,
        num_envs=args.num_envs,
        max_episode_steps=args.max_steps,
        progress=not args.no_progress,
    )
    print(
        f"recorded {report.episodes} episodes of {report.task} ({report.frames} frames) into {store.root}: "
        f"expert success {report.successes}/{report.episodes} ({report.success_rate:.0%}) "
        f"in {report.seconds:.1f} s"
    )
    return 0


# ---------------------------------------------------------------------------- store
def cmd_store_info(args: argparse.Namespace) -> int:
    store, _db = _open_store(args.path, db_url=args.db)
    info = store.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"store     {info['root']}")
    print(f"episodes  {info['episodes']} ({info['open_episodes']} open)")
    print(f"frames    {info['frames']}")
    print(f"on disk   {_human_bytes(info['bytes'])}")
    if info["tasks"]:
        rows = []
        for name, t in info["tasks"].items():
            rate = "-" if t["success_rate"] is None else f"{t['success_rate']:.0%}"
            rows.append([name, t["episodes"], t["frames"], f"{t['successes']}/{t['closed']}", rate])
        print()
        print(_table(rows, ["task", "episodes", "frames", "successes", "success rate"]))
    return 0


def cmd_store_verify(args: argparse.Namespace) -> int:
    store, db = _open_store(args.path, db_url=args.db)
    problems = store.verify(db=None if args.no_db else db)
    n = len(store.episode_ids())
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{len(problems)} problem(s) in {n} episodes of {store.root}")
        return 1
    print(f"ok: {n} episodes in {store.root} are consistent")
    return 0


# ---------------------------------------------------------------------------- main job
def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded main job. For now: demonstrations into a fresh store, then info and verify."""
    args.store.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        ns = argparse.Namespace(
            task=task,
            episodes=args.episodes,
            noise=args.noise,
            seed=args.seed,
            store=args.store,
            db=None,
            obs=args.obs,
            image_size=args.image_size,
            num_envs=args.num_envs,
            max_steps=None,
            no_progress=args.no_progress,
        )
        cmd_sim_demos(ns)
    print()
    cmd_store_info(argparse.Namespace(path=args.store, db=None, json=False))
    print()
    return cmd_store_verify(argparse.Namespace(path=args.store, db=None, no_db=False))


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="vla-rl",
        description="Improve robot VLA policies while they are deployed: simulated robots, an episode "
        "store for the fleet's data, and (coming) policy serving and post-training rounds.",
        epilog="Start with `vla-rl demo`, then `vla-rl store info runs/demo/store`.",
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"vla-rl {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one object per line")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        parent: Any, name: str, func: Callable[[argparse.Namespace], int], help_: str, desc: str = ""
    ) -> Any:
        sp = parent.add_parser(name, help=help_, description=desc or help_, formatter_class=fmt)
        sp.set_defaults(func=func)
        return sp

    def demo_options(sp: argparse.ArgumentParser, episodes: int) -> None:
        sp.add_argument(
            "--episodes", type=int, default=episodes, help="episodes to record (default %(default)s)"
        )
        sp.add_argument(
            "--noise",
            type=float,
            default=0.0,
            help="expert sloppiness in [0, 2]: 0 = clean demos; 0.3 still ~100%% success; "
            "1.0 leaves 15-65%% depending on the task (default %(default)s)",
        )
        sp.add_argument("--seed", type=int, default=0, help="first episode seed (default %(default)s)")
        sp.add_argument("--obs", choices=["state", "rgb"], default="state", help="observation mode")
        sp.add_argument("--image-size", type=int, default=128, help="camera height = width in rgb mode")
        sp.add_argument("--num-envs", type=int, default=1, help="simulator processes in parallel")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = add(
        sub,
        "demo",
        cmd_demo,
        "run the main job on embedded defaults",
        "Record scripted demonstrations for the default tasks into a local store, then show what the "
        "store holds and verify it. Re-running adds more episodes to the same store.",
    )
    d.add_argument("--tasks", nargs="+", default=["maniskill/PushCube-v1", "maniskill/PickCube-v1"])
    d.add_argument("--store", type=Path, default=DEFAULT_STORE, help="store directory (default %(default)s)")
    demo_options(d, episodes=10)

    sim_p = add(sub, "sim", lambda a: (sim_p.print_help(), 0)[1], "simulated robots")
    sim_sub = sim_p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sl = add(sim_sub, "list", cmd_sim_list, "list simulated tasks with their robot specs")
    sl.add_argument("--json", action="store_true", help="machine-readable output")
    sd = add(
        sim_sub,
        "demos",
        cmd_sim_demos,
        "record scripted-expert demonstrations into an episode store",
        "Run the privileged scripted expert for a task and write every frame (cameras, state, action, "
        "reward, flags, controller=scripted) to a Zarr episode store, with one row per episode in the "
        "metadata DB.\n\nexample:\n  vla-rl sim demos --task PickCube --episodes 50 --noise 0.5 "
        "--store runs/pick/store",
    )
    sd.add_argument("--task", required=True, help="task id or a unique part of it (see `vla-rl sim list`)")
    sd.add_argument("--store", type=Path, required=True, help="episode store directory (created if missing)")
    sd.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    sd.add_argument("--max-steps", type=int, default=None, help="episode length limit (default: the task's)")
    demo_options(sd, episodes=10)

    store_p = add(sub, "store", lambda a: (store_p.print_help(), 0)[1], "inspect and check episode stores")
    store_sub = store_p.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    si = add(store_sub, "info", cmd_store_info, "episodes, frames, bytes and per-task success of a store")
    si.add_argument("path", type=Path)
    si.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    si.add_argument("--json", action="store_true", help="machine-readable output")
    sv = add(
        store_sub,
        "verify",
        cmd_store_verify,
        "integrity check; exit code 1 on any inconsistency",
        "Check every episode's arrays against its committed length and spec, its controller, segment, "
        "revision and timestamp columns, and (unless --no-db) its row in the metadata DB.",
    )
    sv.add_argument("path", type=Path)
    sv.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    sv.add_argument("--no-db", action="store_true", help="check the Zarr store only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``vla-rl sim ...`` and ``vla-rl store ...``: simulated tasks, demonstrations, and the episode store."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tyro.conf import Positional

from sim.base import ObsMode
from vla_rl.cli.common import CliError, Command, open_store, task_arg, user_errors
from vla_rl.core.console import human_bytes, table

if TYPE_CHECKING:
    from vla_rl_client.meta import EpisodeMeta

    from fleet.store import EpisodeStore


# ---------------------------------------------------------------------------- sim
@dataclass
class SimList:
    """List the simulated tasks with their robot specs (observation and action layouts)."""

    json: bool = False
    """Machine-readable output."""


def sim_list(a: SimList) -> int:
    from sim.registry import list_tasks

    tasks = list_tasks()
    if a.json:
        print(json.dumps([asdict(t) for t in tasks], indent=2))
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
    print(table(rows, header))
    print("\nActions are float32 in [-1, 1]; gripper +1 opens, -1 closes. Images are uint8 HxWx3.")
    return 0


@dataclass
class SimDemos:
    """Record scripted-expert demonstrations into an episode store.

    The task's privileged scripted expert acts; every frame (cameras, state, action, reward, flags,
    controller=scripted) goes to a Zarr episode store, with one row per episode in the metadata DB.
    Example: vla-rl sim demos --task PickCube --episodes 50 --noise 0.5 --store runs/pick/store
    """

    task: str
    """Task id or a unique part of it (see `vla-rl sim list`)."""
    store: Path
    """Episode store directory (created if missing)."""
    episodes: int = 10
    """Episodes to record."""
    noise: float = 0.0
    """Expert sloppiness in [0, 2]: 0 = clean demos, larger = more perturbed actions and fewer successes
    (the expert's success per task and noise: docs/sim.md)."""
    seed: int = 0
    """First episode seed."""
    obs: ObsMode = "state"
    """Observation mode."""
    image_size: int = 128
    """Camera height = width in rgb mode."""
    num_envs: int = 1
    """Simulator processes in parallel."""
    ray: str | None = None
    """Run the simulators as Ray actors: 'auto' (this machine's Ray cluster, or a local head on 127.0.0.1)
    or a cluster address host:port; None = local processes. Same seed, same demos."""
    max_steps: int | None = None
    """Episode length limit; None = the task's."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file inside the store."""
    camera_codec: str = "lossless"
    """Camera codec in the store: lossless (zstd), jpeg or jpeg:QUALITY (1-100), per camera CAMERA=CODEC,
    comma-separated (e.g. jpeg:90,hand_camera=lossless). See docs/store.md."""
    replayable: bool = False
    """Clear each simulator's history at every reset (a slower reset: docs/sim.md) so every episode replays
    exactly from its seed: what a camera policy's trainers need for privileged inputs (value_input
    privileged, hindsight copies)."""
    progress: bool = True
    """Show a progress bar."""


def sim_demos(a: SimDemos) -> int:
    from fleet.codecs import CameraCodecs, CodecError
    from sim.demos import record_demos
    from sim.ray_workers import RayUnavailable, check_ray_address

    with user_errors(ValueError):
        ray = check_ray_address(a.ray, field="--ray")
    task = task_arg(a.task)
    with user_errors(CodecError):
        codecs = CameraCodecs.parse(a.camera_codec)  # before the simulator starts
    store, _db = open_store(a.store, create=True, db_url=a.db)
    with user_errors(CodecError, RayUnavailable):  # a camera the task does not have; no Ray cluster
        report = record_demos(
            store,
            task,
            episodes=a.episodes,
            noise=a.noise,
            seed=a.seed,
            obs=a.obs,
            image_size=a.image_size,
            num_envs=a.num_envs,
            max_episode_steps=a.max_steps,
            progress=a.progress,
            camera_codec=codecs,
            ray=ray,
            replayable=a.replayable,
        )
    print(
        f"recorded {report.episodes} episodes of {report.task} ({report.frames} frames) into {store.root}: "
        f"expert success {report.successes}/{report.episodes} ({report.success_rate:.0%}) "
        f"in {report.seconds:.1f} s"
    )
    return 0


# ---------------------------------------------------------------------------- store
@dataclass
class StoreInfo:
    """Summarise a store: episodes, frames and bytes on disk; success per task; and per robot the
    segments (autonomous / intervention / reset), episodes with a takeover, the fraction of frames under
    intervention (frames in intervention segments), and success. Successes count only episodes with a
    known outcome (successes/known); episodes whose outcome is unknown (e.g. imported without
    next.success) are counted apart, and a rate with no known outcome shows as n/a."""

    path: Positional[Path]
    """Episode store directory, or s3://BUCKET/PREFIX (credentials from the environment)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file inside the store (none for an s3:// store)."""
    json: bool = False
    """Machine-readable output."""


def store_info(a: StoreInfo) -> int:
    store, _db = open_store(a.path, db_url=a.db)
    info = store.info()
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"store     {info['root']}")
    print(f"episodes  {info['episodes']} ({info['open_episodes']} open)")
    print(f"frames    {info['frames']}")
    print(f"on disk   {human_bytes(info['bytes'])}")
    if info["tasks"]:
        rows = []
        for name, t in info["tasks"].items():
            rate = "n/a" if t["success_rate"] is None else f"{t['success_rate']:.0%}"
            rows.append([name, t["episodes"], t["frames"], _successes(t), t["unknown"], rate])
        print()
        print(table(rows, ["task", "episodes", "frames", "successes", "unknown outcome", "success rate"]))
    if info["robots"]:
        rows = []
        for name, r in info["robots"].items():
            rate = "n/a" if r["success_rate"] is None else f"{r['success_rate']:.0%}"
            irate = "-" if r["intervention_rate"] is None else f"{r['intervention_rate']:.1%}"
            seg = r["segments"]
            rows.append(
                [
                    name,
                    r["episodes"],
                    r["frames"],
                    f"{_successes(r)} ({rate})",
                    f"{seg['autonomous']} / {seg['intervention']} / {seg['reset']}",
                    f"{r['episodes_with_intervention']}/{r['episodes']}",
                    irate,
                ]
            )
        print()
        header = ["robot", "episodes", "frames", "success", "segments (auto / interv / reset)"]
        print(table(rows, [*header, "episodes w/ takeover", "intervention rate (frames)"]))
    return 0


def _successes(counts: dict[str, int]) -> str:
    """ "3/10", "3/10 (+6 unknown)", or "n/a (16 unknown)" when no closed episode's outcome is known."""
    unknown = f" (+{counts['unknown']} unknown)" if counts["unknown"] else ""
    if not counts["known"]:
        return f"n/a ({counts['unknown']} unknown)" if counts["unknown"] else "n/a"
    return f"{counts['successes']}/{counts['known']}{unknown}"


@dataclass
class StoreVerify:
    """Integrity check; exit code 1 on any inconsistency. Checks every episode's arrays against its
    committed length and spec, its controller, segment, revision and timestamp columns, and (unless
    --no-check-db) its row in the metadata DB."""

    path: Positional[Path]
    """Episode store directory, or s3://BUCKET/PREFIX (credentials from the environment)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file inside the store (an s3:// store needs it, or --no-check-db)."""
    check_db: bool = True
    """Also check the metadata DB's rows (--no-check-db: the Zarr store only)."""
    wal_dir: Path | None = None
    """The collector's write-ahead logs (its --wal-dir; default <store>/wal): acknowledged frames still
    only there are reported."""


def store_verify(a: StoreVerify) -> int:
    store, db = open_store(a.path, db_url=a.db)
    if a.check_db and db is None:
        raise CliError(
            f"--db: {store.root} is an object store with no SQLite file beside it: give the metadata DB's "
            "URL (--db postgresql://...), or check the Zarr store only (--no-check-db)"
        )
    problems = store.verify(db=db if a.check_db else None)
    n = len(store.episode_ids())
    pending = _log_pending(store, a.wal_dir)
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{len(problems)} problem(s) in {n} episodes of {store.root}{pending}")
        return 1
    print(f"ok: {n} episodes in {store.root} are consistent{pending}")
    return 0


def _log_pending(store: EpisodeStore, wal_dir: Path | None) -> str:
    """What a stopped collector left in its write-ahead log for the next start, as a clause of verify's
    last line ("" when nothing): the store alone would look complete without those frames."""
    from fleet.wal import WAL_DIR, log_backlog

    if wal_dir is None and store.remote is not None:
        return ""  # an object store's log is on the collector's machine: --wal-dir names it
    logs = wal_dir if wal_dir is not None else store.root / WAL_DIR
    if not logs.is_dir():
        return ""

    def committed(eid: str) -> EpisodeMeta | None:
        try:
            return store.read_metadata(eid)
        except (KeyError, ValueError, FileNotFoundError):
            return None

    b = log_backlog(logs, committed)
    if not (b.frames or b.ends):
        return ""
    ends = f" and {b.ends} episode end(s)" if b.ends else ""
    return (
        f", but {b.frames} acknowledged frames{ends} of {b.episodes} open episode(s) are pending in the log "
        f"({logs}); start the collector to apply them"
    )


@dataclass
class StoreExportLerobot:
    """Write a store's closed episodes (state, action, cameras, reward, done, success, and controller /
    intervention / segment columns) as a LeRobot v3 dataset on local disk. next.done is True on each
    episode's last frame; intervention marks the frames of intervention segments; episodes with an
    unknown outcome are not exported as failures (outcome_known column, or no next.success at all when
    no outcome is known)."""

    path: Positional[Path]
    """Episode store."""
    out: Positional[Path]
    """New dataset folder (must not exist or be empty)."""
    repo_id: str
    """Dataset name, e.g. fleet/pushcube."""
    task: str | None = None
    """Only this task's episodes."""
    videos: bool = True
    """Encode cameras as AV1 video, as LeRobot does (--no-videos: lossless PNG images, much bigger)."""
    db: str | None = None
    """Metadata DB URL whose labels travel with the data; None = the SQLite file inside the store."""


def store_export_lerobot(a: StoreExportLerobot) -> int:
    from fleet.lerobot import export_lerobot

    store, _db = open_store(a.path, db_url=a.db)
    with user_errors(FileExistsError, ValueError, prefix="store export-lerobot: "):
        out = export_lerobot(store, a.out, a.repo_id, task=a.task, use_videos=a.videos)
    print(
        f"LeRobot v3 dataset written to {out} (load it with LeRobotDataset({a.repo_id!r}, root={str(out)!r}))"
    )
    return 0


@dataclass
class StoreImportLerobot:
    """Bring a LeRobot v3 dataset from local disk into a store. Frames a human drives (intervention
    column True, or no intervention/controller column: a teleoperated demonstration) become intervention
    segments with controller human, the others autonomous ones; each episode's instruction is its
    LeRobot task string; without next.success the outcome is unknown (not a failure). Importing the same
    dataset twice is refused; a failed import leaves nothing behind (a store it created is removed)."""

    dataset: Positional[str]
    """Dataset root folder."""
    store: Positional[Path]
    """Episode store (created if missing)."""
    robot_id: str = "lerobot"
    """Robot id recorded for the imported episodes."""
    task: str | None = None
    """Task id to record; None = the dataset's robot type (robot_type in meta/info.json), or the repo id
    (local/<folder>) if it has none; our own exports keep their exported task."""
    default_controller: str = "human"
    """Who drove frames of a dataset without an intervention/controller column: human (teleoperated
    demonstrations, lerobot-record), policy (eval rollouts) or scripted."""
    allow_duplicate: bool = False
    """Import even if this dataset (same fingerprint) was imported into the store before."""
    camera_codec: str = "lossless"
    """Camera codec in the store: lossless (zstd: every decoded pixel kept), jpeg or jpeg:QUALITY (1-100;
    sizes per quality: docs/store.md), per camera CAMERA=CODEC, comma-separated (e.g. jpeg:90,wrist=lossless)."""
    db: str | None = None
    """Metadata DB URL the episodes and labels are recorded in; None = the SQLite file inside the store."""


def store_import_lerobot(a: StoreImportLerobot) -> int:
    from fleet.codecs import CameraCodecs, CodecError
    from fleet.lerobot import import_lerobot

    with user_errors(CodecError):
        CameraCodecs.parse(a.camera_codec)  # before anything is created
    root = Path(a.dataset)
    if root.is_dir() and not (root / "meta" / "info.json").is_file():
        raise CliError(
            f"{root}: not a LeRobot v3 dataset (no meta/info.json); give the dataset's root folder"
        )
    created = _created_by_opening(a.store)
    store, db = open_store(a.store, create=True, db_url=a.db)
    try:
        with user_errors(FileNotFoundError, ValueError, prefix="store import-lerobot: "):
            ids = import_lerobot(
                a.dataset,
                store,
                robot_id=a.robot_id,
                task=a.task,
                db=db,
                default_controller=a.default_controller,
                allow_duplicate=a.allow_duplicate,
                camera_codec=a.camera_codec,
            )
    except BaseException:
        db.close()
        _remove_created(created)
        raise
    print(f"imported {len(ids)} episodes into {store.root}")
    return 0


def _created_by_opening(path: Path) -> tuple[Path, frozenset[str] | None] | None:
    """What opening a store at ``path`` with create=True would create, so a failed import can remove it:
    None if a store is already there; (the topmost folder to be made, None) if ``path`` does not exist;
    (path, the names already in it) for an existing folder that is not yet a store."""
    path = Path(path).absolute()
    if (path / "zarr.json").exists():
        return None
    if path.is_dir():
        return path, frozenset(p.name for p in path.iterdir())
    top = path
    while not top.parent.exists():
        top = top.parent
    return top, None


def _remove_created(created: tuple[Path, frozenset[str] | None] | None) -> None:
    import shutil

    if created is None:
        return
    folder, kept = created
    if kept is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for p in folder.iterdir():
        if p.name not in kept:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


COMMANDS = [
    Command(("sim", "list"), "list simulated tasks with their robot specs", SimList, sim_list),
    Command(
        ("sim", "demos"), "record scripted-expert demonstrations into an episode store", SimDemos, sim_demos
    ),
    Command(
        ("store", "info"),
        "episodes, frames, bytes, per-task success, per-robot segments",
        StoreInfo,
        store_info,
    ),
    Command(
        ("store", "verify"), "integrity check; exit code 1 on any inconsistency", StoreVerify, store_verify
    ),
    Command(
        ("store", "export-lerobot"),
        "write episodes as a LeRobot v3 dataset",
        StoreExportLerobot,
        store_export_lerobot,
    ),
    Command(
        ("store", "import-lerobot"),
        "bring a LeRobot v3 dataset into a store",
        StoreImportLerobot,
        store_import_lerobot,
    ),
]

"""Import: a local LeRobot v3 dataset into our store (:func:`import_lerobot`), refusing a dataset
imported before, and leaving nothing behind when it fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.meta import TASK_RUNS_LABEL, Controller, EpisodeDB, EpisodeMeta
from vla_rl_client.spec import RobotSpec, SpecError

from fleet.codecs import CameraCodecs
from fleet.lerobot.images import read_images
from fleet.lerobot.plan import EpisodePlan, plan_episodes
from fleet.lerobot.schema import ACTION_KEY, STATE_KEY
from fleet.lerobot.source import (
    check_local_files,
    check_video_files,
    dataset_tasks,
    load_info,
    load_sidecar,
    optional_columns,
    resolve_dataset,
    restore_spec,
    select_cameras,
    vector_feature,
)
from fleet.store import EpisodeStore

log = logging.getLogger("fleet.lerobot_io")  # one logger for the whole package, as before the split


LABEL_KEY = "source"
TASKS_LABEL_KEY = TASK_RUNS_LABEL  # per-frame task runs; training reads them (fleet.dataset)
LABEL_AUTHOR = "fleet.lerobot_io"  # the module name before the split: labels in DBs carry it


def import_lerobot(
    root_or_repo_id: str | os.PathLike[str],
    store: EpisodeStore,
    *,
    robot_id: str = "lerobot",
    task: str | None = None,
    spec_name: str | None = None,
    db: EpisodeDB | None = None,
    camera_keys: Sequence[str] | None = None,
    default_controller: Controller | str | int = Controller.HUMAN,
    allow_duplicate: bool = False,
    camera_codec: str | CameraCodecs | None = None,
) -> list[str]:
    """Write every episode of a local LeRobot v3 dataset into ``store``; returns the new episode ids.

    ``root_or_repo_id`` is the dataset's directory, or a repo id already present under
    ``$HF_LEROBOT_HOME/<repo_id>``; nothing is ever downloaded (a local dataset with missing files is an
    error here, where LeRobot itself would fall back to the Hub).

    The robot spec comes from the features: ``observation.state`` / ``action`` dims and names, one camera
    per RGB image or video feature (``observation.images.<name>``, or ``observation.image`` as
    ``image``; depth maps are skipped) with its H x W, ``fps`` as ``control_hz``, the dataset's first
    task as the instruction, ``spec_name`` or the robot type as the name. For a dataset written by
    :func:`export_lerobot` the sidecar's spec, segments, outcomes and start times are restored where
    they still match the data. ``camera_keys`` picks cameras (feature keys or camera names).

    Per episode: the LeRobot task (the instruction string) of its first frame becomes the instruction;
    an episode whose frames carry several tasks also gets a ``lerobot_tasks`` label in the DB with
    every run ``[start, end, task]`` (the store has one instruction per episode; training conditions each
    frame on its run's task through that label, see :func:`vla_rl_client.meta.frame_instructions`). ``task`` (our store
    task) defaults to the exported one for our own exports, else the dataset's robot type
    (``robot_type`` in ``meta/info.json``), else the repo id (``local/<folder>`` for a folder). State and
    action are cast to float32 and copied as they are (LeRobot actions are usually raw joint targets,
    not our [-1, 1] range).

    Who drives: controllers come from a ``controller`` column, else from ``intervention`` (or HIL-SERL's
    ``complementary_info.is_intervention``): True = human, False = policy, as LeRobot's DAgger
    recording means it. Without either, every frame gets ``default_controller``, human by default,
    because ``lerobot-record`` datasets are teleoperated demonstrations (pass ``"policy"`` for eval
    rollouts). Human-driven frames (the intervention flag where there is one, else controller human)
    form ``intervention`` segments, all others ``autonomous`` ones; segments split where that (or an
    exported ``segment`` column) changes. So store info's intervention rate, the segment kinds and a
    re-export's ``intervention`` column agree: a teleoperated dataset is 100% human intervention.

    ``next.reward``, ``next.done`` / ``next.truncated`` fill reward, terminated and truncated (zero /
    False when absent); an episode whose last frame is not done (no ``next.done`` column, as
    ``lerobot-record`` writes) gets ``truncated`` there: it ended without a terminal state. The outcome
    is ``"success"`` / ``"failure"`` from ``next.success`` (success if any frame has it; failure only
    where an ``outcome_known`` column, if present, says so), else ``"unknown"``, which ``store info``
    shows as unknown, not as a failure (stored with ``success=False``, the store's closed-episode
    invariant).

    Importing a dataset whose fingerprint (a hash of ``meta/info.json``, ``meta/tasks.parquet``,
    ``meta/episodes/`` and the data and video file sizes) matches an earlier import into this store's
    DB raises :class:`DuplicateImportError` naming those episodes, unless ``allow_duplicate``.

    Every check on features and numeric columns runs before the first episode is created; images are
    read and checked per episode. A failure at any point removes the episodes this call created, and
    the DB rows and labels are written only once every episode is in the store, so a failed import
    leaves the store and its DB as they were. ``db`` (default: the store's) records the episodes and a
    ``source`` label pointing back at the LeRobot dataset, its fingerprint and episode.
    """
    root, repo_id = resolve_dataset(root_or_repo_id)
    info = load_info(root)
    features: dict[str, dict[str, Any]] = info["features"]
    state_dim, state_names = vector_feature(features, STATE_KEY, "float32 [S] joint/proprio state")
    action_dim, action_names = vector_feature(features, ACTION_KEY, "float32 [A] action")
    cameras = select_cameras(features, camera_keys)
    optional = optional_columns(features)
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
        raise SpecError("fps", "a positive frame rate in meta/info.json", repr(fps))
    ctrl_default = Controller.parse(default_controller)
    codecs = CameraCodecs.parse(camera_codec)
    if not isinstance(robot_id, str) or not robot_id:
        raise ValueError(f"robot_id must be a non-empty string, got {robot_id!r}")
    if int(info.get("total_episodes", 0)) == 0:
        log.warning("%s holds no episodes; nothing imported", root)
        return []
    check_local_files(root, info)

    from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    meta = LeRobotDatasetMetadata(repo_id, root=root)  # loads, never downloads: files checked above
    check_video_files(root, meta, cameras)
    ds = LeRobotDataset(repo_id, root=root, download_videos=False)

    label_db = db if db is not None else store.db
    fingerprint = dataset_fingerprint(root)
    if not allow_duplicate:
        _refuse_duplicate(store, label_db, root, fingerprint)
    sidecar = load_sidecar(root, int(info.get("total_frames", -1)))
    tasks = dataset_tasks(ds)
    robot_type = info.get("robot_type") if isinstance(info.get("robot_type"), str) else None
    built = RobotSpec(
        name=spec_name or robot_type or repo_id,
        state_dim=state_dim,
        action_dim=action_dim,
        control_hz=float(fps),
        instruction=tasks[0] if tasks else "",
        cameras=tuple(c.spec for c in cameras),
        action_names=action_names,
        state_names=state_names,
        extras={"lerobot": {"repo_id": repo_id, "root": str(root), "robot_type": info.get("robot_type")}},
        action_range=None,  # the dataset's own units (usually raw joint targets)
    )
    spec = restore_spec(built, sidecar, spec_name)
    codecs.check(spec.camera_names)
    default_task = task or robot_type or repo_id
    plans = plan_episodes(ds, optional, sidecar, ctrl_default, fps, default_task, task is not None)

    metas: list[EpisodeMeta] = []
    written: list[str] = []  # episode ids created so far, half-written ones too
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    safe_robot = re.sub(r"[^A-Za-z0-9_.-]", "_", robot_id)[:64]
    try:
        for plan in plans:
            images = read_images(ds, plan, cameras, fps)
            metas.append(
                _write_plan(store, spec, plan, images, robot_id, f"{stamp}-{safe_robot}", written, codecs)
            )
        if label_db is not None:  # only now: a failure above leaves no DB rows behind
            source = {
                "format": "lerobot-v3",
                "repo_id": repo_id,
                "root": str(root),
                "fingerprint": fingerprint,
            }
            _record_episodes(label_db, store, plans, metas, source)
    except BaseException as e:
        for eid in written:
            shutil.rmtree(store.episodes_dir / eid, ignore_errors=True)
        e.add_note(f"import_lerobot: nothing imported ({len(metas)} of {len(plans)} written, then removed)")
        raise
    ids = [m.episode_id for m in metas]
    log.info("imported %d episodes from %s into %s", len(ids), root, store.root)
    return ids


def _record_episodes(
    db: EpisodeDB,
    store: EpisodeStore,
    plans: Sequence[EpisodePlan],
    metas: Sequence[EpisodeMeta],
    source: Mapping[str, Any],
) -> None:
    """Record the imported episodes in ``db``, each with a ``source`` label (``source`` and its LeRobot
    episode index) and, where its frames switch task, the task runs label."""
    for plan, meta in zip(plans, metas, strict=True):
        db.record_episode_open(meta, str(store.root))
        db.record_episode_closed(meta)
        label = {**source, "episode_index": plan.episode_index}
        db.add_label(meta.episode_id, LABEL_KEY, label, author=LABEL_AUTHOR)
        if len(plan.task_runs) > 1:
            runs = [list(r) for r in plan.task_runs]
            db.add_label(meta.episode_id, TASKS_LABEL_KEY, runs, author=LABEL_AUTHOR)


class DuplicateImportError(ValueError):
    """The dataset was imported into this store before (same fingerprint)."""


def dataset_fingerprint(root: str | os.PathLike[str]) -> str:
    """sha256 over a LeRobot dataset's metadata files and the sizes of its data and video files.

    The same dataset copied elsewhere, or exported twice from the same episodes, has the same
    fingerprint (our sidecar, which holds the export time, is left out); a dataset with other
    frames has other per-episode stats in ``meta/episodes/`` and so another fingerprint.
    """
    root = Path(root)
    h = hashlib.sha256()
    meta_files = [root / "meta" / "info.json", root / "meta" / "tasks.parquet"]
    meta_files += sorted((root / "meta" / "episodes").rglob("*.parquet"))
    for f in meta_files:
        if f.is_file():
            h.update(f"{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    for sub in ("data", "videos"):
        for f in sorted((root / sub).rglob("*")):
            if f.is_file():
                h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0".encode())
    return h.hexdigest()


def _refuse_duplicate(store: EpisodeStore, db: EpisodeDB | None, root: Path, fingerprint: str) -> None:
    labels_of = getattr(db, "labels", None)
    if labels_of is None:
        log.warning("no metadata DB: cannot check whether %s was imported into %s before", root, store.root)
        return
    present = set(store.episode_ids())
    earlier = [
        lab
        for lab in labels_of(key=LABEL_KEY)
        if lab.episode_id in present
        and isinstance(lab.value, Mapping)
        and lab.value.get("fingerprint") == fingerprint
    ]
    if earlier:
        ids = sorted({lab.episode_id for lab in earlier})
        roots = sorted({str(lab.value.get("root")) for lab in earlier})
        shown = ", ".join(ids[:5]) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")
        raise DuplicateImportError(
            f"LeRobot dataset {root} was already imported into {store.root} (same fingerprint, "
            f"imported from {', '.join(roots)}) as {len(ids)} episodes: {shown}; "
            "pass allow_duplicate=True (--allow-duplicate) to import it again"
        )


def _write_plan(
    store: EpisodeStore,
    spec: RobotSpec,
    plan: EpisodePlan,
    images: Mapping[str, np.ndarray],
    robot_id: str,
    id_prefix: str,
    written: list[str],
    codecs: CameraCodecs | None = None,
) -> EpisodeMeta:
    """Create, fill and close one episode (no DB rows yet); ids sort in LeRobot episode order within one
    import. A failure removes the half-written episode."""
    episode_id = f"{id_prefix}-ep{plan.episode_index:06d}-{uuid.uuid4().hex[:6]}"
    writer = store.create_episode(
        spec,
        robot_id=robot_id,
        task=plan.task,
        instruction=plan.instruction,
        episode_id=episode_id,
        db=_NO_DB,
        camera_codec=codecs,
    )
    written.append(episode_id)  # the caller's rollback removes it, even if filling it fails
    timestamps = plan.start_time + plan.frame_time
    with writer:
        for seg in plan.segments:
            writer.begin_segment(seg.kind, seg.controller, seg.reason)
            a, b = seg.start, seg.end
            if b is None or b <= a:
                continue
            writer.add_frames(
                {
                    "cameras": {name: frames[a:b] for name, frames in images.items()},
                    "state": plan.state[a:b],
                    "action": plan.action[a:b],
                    "reward": plan.reward[a:b],
                    "terminated": plan.terminated[a:b],
                    "truncated": plan.truncated[a:b],
                    "controller": plan.controller[a:b],
                    "timestamp": timestamps[a:b],
                }
            )
        meta = writer.close(outcome=plan.outcome, success=plan.success)
    return meta


class _NoDB:
    """An :class:`EpisodeDB` that records nothing: imports record their episodes once all are written."""

    def record_episode_open(self, meta: EpisodeMeta, store_path: str) -> None:
        pass

    def record_episode_closed(self, meta: EpisodeMeta) -> None:
        pass

    def episode(self, episode_id: str) -> None:
        return None

    def add_label(
        self, episode_id: str, key: str, value: Any, *, author: str, segment_index: int | None = None
    ) -> int:
        return 0


_NO_DB = _NoDB()

"""LeRobot v3 dataset interop: export episodes of our store as a LeRobot dataset, import one into it.

LeRobot (0.6.1, dataset format ``v3.0``) is what most open robot-learning code trains on, so our episodes
should leave in its format and its datasets (teleoperated demos, DAgger recordings, eval rollouts) should
come into our store. Both directions go through LeRobot's own ``LeRobotDataset`` (``create`` /
``add_frame`` / ``save_episode`` / ``finalize`` to write, ``LeRobotDataset(repo_id, root=...)`` to read), so
what we write is what LeRobot itself reads and vice versa; everything happens on local disk.

Column mapping (ours -> LeRobot):

=====================================  =========================================================
``state`` float32 [S]                  ``observation.state`` (names = ``spec.state_names``)
``action`` float32 [A]                 ``action`` (names = ``spec.action_names``)
``cameras[c]`` uint8 [H, W, 3]         ``observation.images.<c>`` ("video", the default as in
                                       LeRobot: lossy AV1 mp4; "image" with ``use_videos=False``:
                                       lossless PNG inside the parquet)
``reward``                             ``next.reward`` float32
``terminated | truncated``             ``next.done`` bool: the episode ended at this frame (the
                                       meaning ``lerobot_eval`` gives it); always True on each
                                       episode's last frame
``truncated``                          ``next.truncated`` bool (so terminated = done & ~truncated); a
                                       last frame that is neither is exported as truncated
episode success (known outcomes)       ``next.success`` bool, True on the last frame of a success
outcome known                          ``outcome_known`` bool, False on every frame of an episode
                                       whose outcome is ``"unknown"`` (see below)
``controller``                         ``controller`` int64 (policy=0, human=1, scripted=2)
frame in an ``intervention`` segment   ``intervention`` bool, the column LeRobot's DAgger rollout
                                       strategy records: a human took over this frame
``segment``                            ``segment`` int64, index into the episode's segments
instruction                            the per-frame ``task`` string
``spec.control_hz``                    ``fps`` (LeRobot stores an integer)
=====================================  =========================================================

Unknown outcomes stay unknown. LeRobot has no null for a bool feature (``add_frame`` wants a bool
array on every frame, and its torch readers cannot batch nulls), so: when no exported episode has a
known outcome, ``next.success`` and ``outcome_known`` are left out altogether (a dataset without
``next.success`` is what ``lerobot-record`` writes: success unknown); otherwise ``next.success`` is
False on the frames of unknown-outcome episodes and ``outcome_known`` says they are not failures, and
the sidecar has ``"outcome": "unknown", "success": null`` for them. A reader's rule: episode e
succeeded iff ``any(next.success)``, failed iff not and ``all(outcome_known)``, else unknown.
:func:`import_lerobot` applies that rule, so import(export(x)) keeps unknown outcomes unknown.

Intervention is one thing in three places, by construction: a frame is under intervention iff it is
in a segment of kind ``intervention``. ``vla-rl store info`` counts those frames (intervention rate),
the export's ``intervention`` column is that per frame, and the import makes every frame a human
drives (``intervention`` / HIL-SERL flag True, ``controller`` 1, or no such column and the default
controller human) an ``intervention`` segment with controller human, and every other frame an
``autonomous`` one.

What LeRobot cannot hold per frame (segment kinds and reasons, outcomes, episode ids, the full robot
spec) goes into a sidecar, ``meta/vla_rl.json``. LeRobot ignores files it does not know, and
:func:`import_lerobot` uses the sidecar only where it still agrees with the data, so an export imported
back reproduces episodes exactly: frames bit for bit (images too, unless stored as video), segments,
outcomes and spec. Not carried: ``proposed_action``, ``uncertainty`` (an import has none: all NaN),
checkpoint ``revision`` and per-frame wall-clock ``timestamp`` (LeRobot timestamps are
``frame_index / fps``; an import restores each episode's start time from the sidecar, or uses the
import time, and spaces frames at ``1 / fps``).

LeRobot is imported lazily: it pulls in torch and takes seconds, and most users of :mod:`fleet` never
need it. LeRobot resolves ``HF_HOME`` / ``HF_LEROBOT_HOME`` when it is first imported, and reading a
dataset converts its parquet files to an Arrow cache under ``HF_HOME`` (``datasets``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from vla_rl_client.meta import TASK_RUNS_LABEL, Controller, EpisodeDB, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.codecs import CameraCodecs
from fleet.store import Episode, EpisodeStore, outcome_known
from vla_rl.core.scheduling import leave_realtime

if TYPE_CHECKING:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset


log = logging.getLogger(__name__)

STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGES_PREFIX = "observation.images."
SINGLE_IMAGE_KEY = "observation.image"
REWARD_KEY = "next.reward"
DONE_KEY = "next.done"
TRUNCATED_KEY = "next.truncated"
SUCCESS_KEY = "next.success"
OUTCOME_KNOWN_KEY = "outcome_known"
CONTROLLER_KEY = "controller"
INTERVENTION_KEY = "intervention"
HIL_INTERVENTION_KEY = "complementary_info.is_intervention"  # what LeRobot's HIL-SERL buffer writes
SEGMENT_KEY = "segment"
SIDECAR_PATH = "meta/vla_rl.json"
LABELS_PATH = "meta/vla_rl_labels.parquet"
LABEL_COLUMNS = (
    "episode_index",
    "episode_id",
    "label_id",
    "key",
    "value",
    "start",
    "end",
    "note",
    "author",
    "source",
    "created_at",
)
SIDECAR_FORMAT = "vla-rl-lerobot-export"
SIDECAR_VERSION = 1
LABEL_KEY = "source"
TASKS_LABEL_KEY = TASK_RUNS_LABEL  # per-frame task runs; training reads them (fleet.dataset)
LABEL_AUTHOR = "fleet.lerobot_io"

_FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
_INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
_IMAGE_NAMES = ["height", "width", "channels"]
# SVT-AV1 (libsvtav1, LeRobot's default encoder) dies with SIGFPE on some frames under 32 px a side
# (16x16 and 24x40 did, here); smaller cameras are exported as PNG images instead.
MIN_VIDEO_SIDE = 32
# Run as root, SVT-AV1 also raises the thread that opens an encoder to SCHED_FIFO 99 (svt_av1_enc_init_handle;
# one camera: this thread, several: LeRobot's pool processes, which exit). Set it back after every episode's
# encoding, before anything else runs or starts from this thread (vla_rl.core.scheduling). Debug level: expected.
_AFTER_ENCODER = "LeRobot video export (SVT-AV1 encoder as root)"


# ====================================================================== export
def export_lerobot(
    store: EpisodeStore,
    out_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    episode_ids: Sequence[str] | None = None,
    task: str | None = None,
    fps: int | float | None = None,
    use_videos: bool = True,
    db: Any = None,
) -> Path:
    """Write episodes of ``store`` as a LeRobot v3 dataset at ``out_dir``; returns its absolute path.

    ``episode_ids`` selects episodes (any status; an open one contributes its committed frames); by
    default every closed episode is exported. ``task`` keeps only episodes of that store task (our
    ``EpisodeMeta.task``, e.g. ``"maniskill/PickCube-v1"``; each frame's LeRobot ``task`` string is the
    episode's instruction). ``fps`` defaults to the spec's ``control_hz``, which must then be a whole
    number because LeRobot stores an integer frame rate. ``use_videos`` (default, as in LeRobot) stores
    cameras as AV1 videos (LeRobot's PyAV encoder, libsvtav1; lossy, much smaller; a camera under
    ``MIN_VIDEO_SIDE`` = 32 px a side, which that encoder crashes on, stays PNG); ``False`` stores
    lossless PNG images in the parquet files.

    All selected episodes must share state/action dims and cameras: a LeRobot dataset has one schema.
    Everything is checked before anything is written, and the dataset is built in a hidden sibling
    directory that is renamed to ``out_dir`` only once complete, so a failure (or a killed process)
    never leaves a half-written dataset where a reader would take it for a finished one.
    ``out_dir`` must not exist or be an empty directory.

    Labels travel with the data: with the metadata ``db`` (default: the store's own, ``store.db``), the
    current labels of the exported episodes (each episode key's latest value not undone, and every span
    not undone) go to ``meta/vla_rl_labels.parquet`` (:data:`LABEL_COLUMNS`: ``episode_index`` into this
    dataset, ``value`` as JSON text, ``start``/``end`` null for an episode label), and the sidecar's
    episode entries carry ``labels`` ``{key: value}``. A current ``outcome`` label overrides the
    recorded outcome in ``next.success`` and the sidecar (which keeps ``recorded_outcome``).
    """
    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id must be a non-empty string, got {repo_id!r}")
    out = Path(out_dir).absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory; pick a new out_dir")

    metas = _select_episodes(store, episode_ids, task)
    db = db if db is not None else getattr(store, "db", None)
    events: dict[str, list[Any]] = {}
    if db is not None and hasattr(db, "current_label_events"):
        events = db.current_label_events([m.episode_id for m in metas])
    recorded = {m.episode_id: (m.outcome, m.success) for m in metas}
    metas = [_with_outcome_label(m, events.get(m.episode_id, [])) for m in metas]
    spec = metas[0].spec
    for m in metas[1:]:
        _check_same_schema(spec, m)
    fps_int = _lerobot_fps(fps, spec, metas)
    if spec.state_dim < 1:
        raise SpecError(
            "state", "state_dim >= 1 (LeRobot cannot store an empty observation.state)", f"{spec.state_dim}"
        )
    with_success = any(outcome_known(m) for m in metas)
    features = _export_features(spec, use_videos, with_success)

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    ds: LeRobotDataset | None = None
    try:
        ds = LeRobotDataset.create(
            repo_id,
            fps=fps_int,
            features=features,
            root=tmp,
            robot_type=spec.name,
            use_videos=use_videos,
            # PNG encoding is the slow part of writing image datasets; threads overlap it with reading.
            image_writer_threads=min(8, 2 * len(spec.cameras)),
        )
        entries = []
        for index, meta in enumerate(metas):
            ep = store.read_episode(meta.episode_id)
            ep = dataclasses.replace(ep, meta=meta)  # the outcome an outcome label gives it
            end_flag_added = _write_episode(ds, ep, with_success)
            ds.save_episode()
            leave_realtime(_AFTER_ENCODER, logging.DEBUG)
            entry = _sidecar_entry(index, ep, end_flag_added)
            entry["labels"] = {
                lb.key: lb.value
                for lb in events.get(meta.episode_id, [])
                if lb.start is None and lb.segment_index is None
            }
            if recorded[meta.episode_id] != (meta.outcome, meta.success):
                entry["recorded_outcome"], entry["recorded_success"] = recorded[meta.episode_id]
            entries.append(entry)
        ds.finalize()
        leave_realtime(_AFTER_ENCODER, logging.DEBUG)
        if db is not None:
            _write_labels(tmp / LABELS_PATH, metas, events)
        sidecar = {
            "format": SIDECAR_FORMAT,
            "version": SIDECAR_VERSION,
            "exported": time.time(),
            "source_store": str(store.root),
            "total_frames": sum(e["length"] for e in entries),
            "spec": spec.to_dict(),
            "episodes": entries,
        }
        text = json.dumps(sidecar, indent=1, sort_keys=True, default=str)  # spec extras may hold anything
        (tmp / SIDECAR_PATH).write_text(text, encoding="utf-8")
        _remove_empty_dirs(tmp / "images")  # LeRobot leaves its emptied PNG staging folders behind
        os.rename(tmp, out)
    except BaseException:
        if ds is not None:
            with contextlib.suppress(Exception):
                ds.finalize()  # closes parquet writers and stops image threads before the folder goes
        leave_realtime(_AFTER_ENCODER, logging.DEBUG)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %d episodes (%d frames) to %s", len(entries), sidecar["total_frames"], out)
    return out


def _with_outcome_label(meta: EpisodeMeta, events: Sequence[Any]) -> EpisodeMeta:
    """The meta with a current ``outcome`` label's value as its outcome (``success`` -> success)."""
    from fleet.db import OUTCOME_KEY, effective_outcome

    labels = {lb.key: lb.value for lb in events if lb.start is None and lb.segment_index is None}
    if labels.get(OUTCOME_KEY) is None:
        return meta
    outcome, success = effective_outcome(meta.outcome, meta.success, labels)
    return dataclasses.replace(meta, outcome=outcome, success=success)


def _write_labels(path: Path, metas: Sequence[EpisodeMeta], events: Mapping[str, Sequence[Any]]) -> None:
    """The current labels as a parquet table (one row per label; :data:`LABEL_COLUMNS`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        (index, lb)
        for index, m in enumerate(metas)
        for lb in events.get(m.episode_id, [])
        if lb.start is not None or lb.segment_index is None
    ]
    table = pa.table(
        {
            "episode_index": pa.array([i for i, _ in rows], pa.int64()),
            "episode_id": pa.array([lb.episode_id for _, lb in rows], pa.string()),
            "label_id": pa.array([lb.id for _, lb in rows], pa.int64()),
            "key": pa.array([lb.key for _, lb in rows], pa.string()),
            "value": pa.array([json.dumps(lb.value) for _, lb in rows], pa.string()),
            "start": pa.array([lb.start for _, lb in rows], pa.int64()),
            "end": pa.array([lb.end for _, lb in rows], pa.int64()),
            "note": pa.array([lb.note for _, lb in rows], pa.string()),
            "author": pa.array([lb.author for _, lb in rows], pa.string()),
            "source": pa.array([lb.source for _, lb in rows], pa.string()),
            "created_at": pa.array([lb.created_at for _, lb in rows], pa.float64()),
        }
    )
    pq.write_table(table, path)


def read_exported_labels(dataset_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The labels an export carried (``meta/vla_rl_labels.parquet``) as dicts with ``value`` decoded;
    ``[]`` when the dataset has none."""
    path = Path(dataset_root) / LABELS_PATH
    if not path.is_file():
        return []
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for r in rows:
        r["value"] = json.loads(r["value"])
    return rows


def _select_episodes(
    store: EpisodeStore, episode_ids: Sequence[str] | None, task: str | None
) -> list[EpisodeMeta]:
    if episode_ids is None:
        metas = [store.read_metadata(eid) for eid in store.episode_ids()]
        metas = [m for m in metas if m.is_closed]
    else:
        if isinstance(episode_ids, str):
            raise TypeError("episode_ids must be a sequence of ids, not a single string")
        metas = [store.read_metadata(eid) for eid in episode_ids]  # KeyError names a missing one
    if task is not None:
        metas = [m for m in metas if m.task == task]
    empty = [m.episode_id for m in metas if m.length == 0]
    if empty:
        log.warning("skipping %d episodes without frames (LeRobot cannot store them): %s", len(empty), empty)
    metas = [m for m in metas if m.length > 0]
    if not metas:
        what = "closed episodes" if episode_ids is None else "episodes among those given"
        raise ValueError(f"nothing to export: no {what} with frames{f' for task {task!r}' if task else ''}")
    return metas


def _check_same_schema(spec: RobotSpec, meta: EpisodeMeta) -> None:
    """One LeRobot dataset has one schema: dims and cameras must agree (names may differ)."""
    other = meta.spec
    for name, mine, theirs in (
        ("state_dim", spec.state_dim, other.state_dim),
        ("action_dim", spec.action_dim, other.action_dim),
        (
            "cameras",
            [dataclasses.asdict(c) for c in spec.cameras],
            [dataclasses.asdict(c) for c in other.cameras],
        ),
    ):
        if mine != theirs:
            raise ValueError(
                f"episode {meta.episode_id} has {name} {theirs}, the first episode has {mine}: "
                "a LeRobot dataset needs one schema, export them separately"
            )


def _lerobot_fps(fps: float | None, spec: RobotSpec, metas: Sequence[EpisodeMeta]) -> int:
    if fps is None:
        rates = sorted({m.spec.control_hz for m in metas})
        if len(rates) > 1:
            raise ValueError(f"episodes were recorded at different control_hz {rates}; pass fps=")
        fps, what = spec.control_hz, "spec.control_hz"
    else:
        what = "fps"
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"{what} must be a positive number, got {fps!r}")
    if abs(fps - round(fps)) > 1e-9:
        raise ValueError(f"{what} is {fps}, but LeRobot stores an integer fps: pass fps=<int>")
    return round(fps)


def _export_features(spec: RobotSpec, use_videos: bool, with_success: bool) -> dict[str, dict[str, Any]]:
    def scalar(dtype: str) -> dict[str, Any]:
        return {"dtype": dtype, "shape": (1,), "names": None}

    features: dict[str, dict[str, Any]] = {
        STATE_KEY: {
            "dtype": "float32",
            "shape": (spec.state_dim,),
            "names": list(spec.state_names) or None,
        },
        ACTION_KEY: {
            "dtype": "float32",
            "shape": (spec.action_dim,),
            "names": list(spec.action_names) or None,
        },
    }
    for cam in spec.cameras:
        video = use_videos and min(cam.height, cam.width) >= MIN_VIDEO_SIDE
        if use_videos and not video:
            log.warning(
                "camera %s is %dx%d: stored as PNG images (LeRobot's AV1 encoder, SVT-AV1, crashes the "
                "process on frames under %d px)",
                cam.name,
                cam.height,
                cam.width,
                MIN_VIDEO_SIDE,
            )
        features[IMAGES_PREFIX + cam.name] = {
            "dtype": "video" if video else "image",
            "shape": cam.shape,
            "names": list(_IMAGE_NAMES),
        }
    features.update(
        {
            REWARD_KEY: scalar("float32"),
            DONE_KEY: scalar("bool"),
            TRUNCATED_KEY: scalar("bool"),
            CONTROLLER_KEY: scalar("int64"),
            INTERVENTION_KEY: scalar("bool"),
            SEGMENT_KEY: scalar("int64"),
        }
    )
    if with_success:
        features[SUCCESS_KEY] = scalar("bool")
        features[OUTCOME_KNOWN_KEY] = scalar("bool")
    return features


def intervention_frames(meta: EpisodeMeta, segment: np.ndarray) -> np.ndarray:
    """bool [T]: the frames in ``intervention`` segments, the ones ``store info`` counts as intervention."""
    kinds = np.array([s.kind == SegmentKind.INTERVENTION for s in meta.segments] or [False], bool)
    return kinds[np.clip(segment.astype(np.int64), 0, len(kinds) - 1)]


def _write_episode(ds: LeRobotDataset, ep: Episode, with_success: bool) -> bool:
    """Add the episode's frames; returns whether its last frame was marked truncated here (it had
    neither flag: every LeRobot episode ends with ``next.done``)."""
    n = ep.length
    truncated = ep.truncated.copy()
    end_flag_added = not (ep.terminated[-1] or truncated[-1])
    truncated[-1] |= end_flag_added
    done = ep.terminated | truncated
    known = outcome_known(ep.meta)
    success = np.zeros(n, bool)
    if known and ep.meta.success:
        success[-1] = True
    known_col = np.full(n, known)
    controller = ep.controller.astype(np.int64)
    intervention = intervention_frames(ep.meta, ep.segment)
    segment = ep.segment.astype(np.int64)
    for t in range(n):
        # add_frame pops "task" and may convert values in place: build a fresh dict per frame.
        frame: dict[str, Any] = {
            STATE_KEY: ep.state[t],
            ACTION_KEY: ep.action[t],
            REWARD_KEY: ep.reward[t : t + 1],
            DONE_KEY: done[t : t + 1],
            TRUNCATED_KEY: truncated[t : t + 1],
            CONTROLLER_KEY: controller[t : t + 1],
            INTERVENTION_KEY: intervention[t : t + 1],
            SEGMENT_KEY: segment[t : t + 1],
            "task": ep.meta.instruction,
        }
        if with_success:
            frame[SUCCESS_KEY] = success[t : t + 1]
            frame[OUTCOME_KNOWN_KEY] = known_col[t : t + 1]
        for name, frames in ep.cameras.items():
            frame[IMAGES_PREFIX + name] = frames[t]
        ds.add_frame(frame)
    return end_flag_added


def _sidecar_entry(index: int, ep: Episode, end_flag_added: bool) -> dict[str, Any]:
    m = ep.meta
    known = outcome_known(m)
    return {
        "episode_index": index,
        "episode_id": m.episode_id,
        "robot_id": m.robot_id,
        "task": m.task,
        "instruction": m.instruction,
        "length": m.length,
        "start_time": float(ep.timestamp[0]),
        "status": m.status,
        "outcome": m.outcome if known or not m.is_closed else "unknown",
        "success": m.success if known else None,
        "end_flag_added": end_flag_added,  # next.truncated on the last frame is ours, not the store's
        "segments": [s.to_dict() for s in m.segments],
    }


def _remove_empty_dirs(root: Path) -> None:
    if not root.is_dir():
        return
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()  # only succeeds when empty
    with contextlib.suppress(OSError):
        root.rmdir()


# ====================================================================== import
@dataclasses.dataclass(frozen=True)
class _Camera:
    key: str  # LeRobot feature key
    spec: CameraSpec
    video: bool


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One LeRobot episode, fully read and checked except for its images."""

    episode_index: int
    rows: np.ndarray  # rows of the HF dataset, in frame order
    instruction: str
    task_runs: tuple[tuple[int, int, str], ...]  # (start, end, LeRobot task) per run of frames
    task: str
    segments: tuple[Segment, ...]  # end always set
    outcome: str
    success: bool
    start_time: float
    state: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    controller: np.ndarray
    frame_time: np.ndarray  # seconds since the episode start (frame_index / fps)
    video_time: np.ndarray  # LeRobot's stored ``timestamp`` column, what its video decoder seeks by


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
    root, repo_id = _resolve_dataset(root_or_repo_id)
    info = _load_info(root)
    features: dict[str, dict[str, Any]] = info["features"]
    state_dim, state_names = _vector_feature(features, STATE_KEY, "float32 [S] joint/proprio state")
    action_dim, action_names = _vector_feature(features, ACTION_KEY, "float32 [A] action")
    cameras = _select_cameras(features, camera_keys)
    optional = _optional_columns(features)
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
    _check_local_files(root, info)

    from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    meta = LeRobotDatasetMetadata(repo_id, root=root)  # loads, never downloads: files checked above
    _check_video_files(root, meta, cameras)
    ds = LeRobotDataset(repo_id, root=root, download_videos=False)

    label_db = db if db is not None else store.db
    fingerprint = dataset_fingerprint(root)
    if not allow_duplicate:
        _refuse_duplicate(store, label_db, root, fingerprint)
    sidecar = _load_sidecar(root, int(info.get("total_frames", -1)))
    tasks = _task_names(ds)
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
    spec = _restore_spec(built, sidecar, spec_name)
    codecs.check(spec.camera_names)
    default_task = task or robot_type or repo_id
    plans = _plan_episodes(ds, optional, sidecar, ctrl_default, fps, default_task, task is not None)

    metas: list[EpisodeMeta] = []
    written: list[str] = []  # episode ids created so far, half-written ones too
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    safe_robot = re.sub(r"[^A-Za-z0-9_.-]", "_", robot_id)[:64]
    try:
        for plan in plans:
            images = _read_images(ds, plan, cameras, fps)
            metas.append(
                _write_plan(store, spec, plan, images, robot_id, f"{stamp}-{safe_robot}", written, codecs)
            )
        if label_db is not None:  # only now: a failure above leaves no DB rows behind
            for plan, meta in zip(plans, metas, strict=True):
                label_db.record_episode_open(meta, str(store.root))
                label_db.record_episode_closed(meta)
                source = {
                    "format": "lerobot-v3",
                    "repo_id": repo_id,
                    "root": str(root),
                    "fingerprint": fingerprint,
                    "episode_index": plan.episode_index,
                }
                label_db.add_label(meta.episode_id, LABEL_KEY, source, author=LABEL_AUTHOR)
                if len(plan.task_runs) > 1:
                    runs = [list(r) for r in plan.task_runs]
                    label_db.add_label(meta.episode_id, TASKS_LABEL_KEY, runs, author=LABEL_AUTHOR)
    except BaseException as e:
        for eid in written:
            shutil.rmtree(store.episodes_dir / eid, ignore_errors=True)
        e.add_note(f"import_lerobot: nothing imported ({len(metas)} of {len(plans)} written, then removed)")
        raise
    ids = [m.episode_id for m in metas]
    log.info("imported %d episodes from %s into %s", len(ids), root, store.root)
    return ids


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


def _resolve_dataset(root_or_repo_id: str | os.PathLike[str]) -> tuple[Path, str]:
    """(dataset root, repo id) for a directory or a repo id in the local LeRobot cache."""
    path = Path(root_or_repo_id).expanduser()
    if (path / "meta" / "info.json").is_file():
        root = path.absolute()
        return root, f"local/{root.name}"
    tried = [str(path.absolute())]
    text = str(root_or_repo_id)
    if re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", text) and not path.exists():
        from lerobot.utils.constants import HF_LEROBOT_HOME

        cached = Path(HF_LEROBOT_HOME) / text
        if (cached / "meta" / "info.json").is_file():
            return cached.absolute(), text
        tried.append(str(cached))
    what = "does not exist" if not path.exists() else "has no meta/info.json"
    raise FileNotFoundError(
        f"no LeRobot dataset at {root_or_repo_id!s}: {tried[0]} {what}"
        + (f" and nothing is cached at {tried[1]}" if len(tried) > 1 else "")
        + " (import_lerobot reads local datasets only; download with LeRobotDataset(repo_id) first)"
    )


def _load_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3"):
        raise ValueError(
            f"{root} is a LeRobot {version or 'unknown-version'} dataset; import_lerobot reads v3.x "
            "(convert it with LeRobot's convert_dataset_v21_to_v30)"
        )
    if not isinstance(info.get("features"), dict):
        raise SpecError("features", "a feature dict in meta/info.json", type(info.get("features")).__name__)
    return info


def _vector_feature(features: Mapping[str, Any], key: str, what: str) -> tuple[int, tuple[str, ...]]:
    """Dim and names of a 1-D float feature, or a SpecError naming the key."""
    ft = features.get(key)
    if not isinstance(ft, Mapping):
        raise SpecError(key, f"a {what} feature", f"no such feature (features: {sorted(features)})")
    dtype, shape = ft.get("dtype"), tuple(ft.get("shape") or ())
    if dtype not in _FLOAT_DTYPES:
        raise SpecError(key, f"a float dtype ({'/'.join(sorted(_FLOAT_DTYPES))}) for the {what}", f"{dtype}")
    if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
        raise SpecError(key, f"a 1-D shape [N>=1] for the {what}", f"shape {list(shape)}")
    names = ft.get("names")
    if isinstance(names, Mapping) and len(names) == 1:  # older layout: {"motors": [...]}
        names = next(iter(names.values()))
    if isinstance(names, list | tuple) and len(names) == shape[0] and all(isinstance(n, str) for n in names):
        return shape[0], tuple(names)
    return shape[0], ()


def _select_cameras(features: Mapping[str, Any], camera_keys: Sequence[str] | None) -> list[_Camera]:
    available: dict[str, str] = {}  # feature key -> camera name
    for key, ft in features.items():
        if not isinstance(ft, Mapping) or ft.get("dtype") not in ("image", "video"):
            continue
        info = ft.get("info") or {}
        if info.get("is_depth_map") or info.get("video.is_depth_map"):
            continue  # depth maps are not RGB cameras; our store has no depth modality
        if key.startswith(IMAGES_PREFIX):
            name = key[len(IMAGES_PREFIX) :]
        elif key == SINGLE_IMAGE_KEY:
            name = "image"
        else:
            name = key.removeprefix("observation.")
        available[key] = re.sub(r"[^A-Za-z0-9_]", "_", name) or "camera"
    if camera_keys is None:
        keys = list(available)
    else:
        if isinstance(camera_keys, str):
            raise TypeError("camera_keys must be a sequence of keys, not a single string")
        by_name = {name: key for key, name in available.items()}
        keys = []
        for k in camera_keys:
            key = k if k in available else by_name.get(k)
            if key is None:
                raise SpecError(
                    f"camera_keys.{k}",
                    f"one of the RGB camera features {sorted(available)}",
                    "no such camera",
                )
            keys.append(key)
    names = [available[k] for k in keys]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError("cameras", "camera features with distinct names", f"{dup} more than once in {keys}")
    return [
        _Camera(k, _camera_spec(k, available[k], features[k]), features[k]["dtype"] == "video") for k in keys
    ]


def _camera_spec(key: str, name: str, ft: Mapping[str, Any]) -> CameraSpec:
    shape = tuple(ft.get("shape") or ())
    names = ft.get("names")
    if len(shape) != 3:
        raise SpecError(key, "an image shape [H, W, C] or [C, H, W]", f"shape {list(shape)}")
    if isinstance(names, list | tuple) and len(names) == 3:
        low = [str(n).lower() for n in names]
        if "height" in low and "width" in low:
            return CameraSpec(name, int(shape[low.index("height")]), int(shape[low.index("width")]))
    if shape[-1] in (1, 3, 4):
        return CameraSpec(name, int(shape[0]), int(shape[1]))
    return CameraSpec(name, int(shape[1]), int(shape[2]))


@dataclasses.dataclass(frozen=True)
class _Optional:
    reward: bool
    done: bool
    truncated: bool
    success: bool
    outcome_known: bool
    controller: str | None  # the column controllers come from, if any
    intervention: str | None  # the column intervention flags come from, if any
    segment: bool


def _optional_columns(features: Mapping[str, Any]) -> _Optional:
    """Which optional columns are present; a present one with an unusable dtype is an error."""

    def has(key: str, dtypes: frozenset[str], what: str) -> bool:
        ft = features.get(key)
        if ft is None:
            return False
        dtype, shape = ft.get("dtype"), tuple(ft.get("shape") or ())
        if dtype not in dtypes or shape not in ((), (1,)):
            raise SpecError(key, f"{what} of shape [1]", f"{dtype} of shape {list(shape)}")
        return True

    numeric = _FLOAT_DTYPES | _INT_DTYPES
    bools = frozenset({"bool"})
    intervention = None
    if has(INTERVENTION_KEY, bools | numeric, "a bool intervention flag"):
        intervention = INTERVENTION_KEY
    elif has(HIL_INTERVENTION_KEY, bools | numeric, "a bool intervention flag"):
        intervention = HIL_INTERVENTION_KEY
    controller = intervention
    if has(CONTROLLER_KEY, _INT_DTYPES, "integer controller codes (policy=0, human=1, scripted=2)"):
        controller = CONTROLLER_KEY
    return _Optional(
        reward=has(REWARD_KEY, numeric, "a numeric reward"),
        done=has(DONE_KEY, bools, "a bool done flag"),
        truncated=has(TRUNCATED_KEY, bools, "a bool truncated flag"),
        success=has(SUCCESS_KEY, bools, "a bool success flag"),
        outcome_known=has(OUTCOME_KNOWN_KEY, bools, "a bool outcome-known flag"),
        controller=controller,
        intervention=intervention,
        segment=has(SEGMENT_KEY, _INT_DTYPES, "integer segment indices"),
    )


def _check_local_files(root: Path, info: Mapping[str, Any]) -> None:
    """Make sure LeRobot finds everything locally: where a file is missing it would go to the Hub."""
    missing = []
    if int(info.get("total_tasks", 0)) > 0 and not (root / "meta" / "tasks.parquet").is_file():
        missing.append("meta/tasks.parquet")
    if not any((root / "meta" / "episodes").glob("*/*.parquet")):
        missing.append("meta/episodes/*/*.parquet")
    if not any((root / "data").glob("*/*.parquet")):
        missing.append("data/*/*.parquet")
    if missing:
        raise FileNotFoundError(
            f"LeRobot dataset {root} is incomplete, missing {missing} (was finalize() called when it was written?)"
        )


def _check_video_files(root: Path, meta: Any, cameras: Sequence[_Camera]) -> None:
    for cam in cameras:
        if not cam.video:
            continue
        for ep in range(meta.total_episodes):
            path = root / meta.get_video_file_path(ep, cam.key)
            if not path.is_file():
                raise FileNotFoundError(f"LeRobot dataset {root}: video {path} of episode {ep} is missing")


def _load_sidecar(root: Path, total_frames: int) -> dict[str, Any] | None:
    """Our export's sidecar, if present and still describing this dataset (same frame count)."""
    path = root / SIDECAR_PATH
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        return None
    if data.get("version") != SIDECAR_VERSION or data.get("total_frames") != total_frames:
        log.warning("ignoring %s: it does not describe this dataset (version or frame count differs)", path)
        return None
    try:
        data["by_index"] = {int(e["episode_index"]): e for e in data.get("episodes", [])}
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring %s: malformed episode entries (%s)", path, e)
        return None
    return data


def _task_names(ds: LeRobotDataset) -> list[str]:
    """Task strings ordered by task_index."""
    tasks = ds.meta.tasks
    if tasks is None:
        return []
    by_index = {int(i): str(t) for t, i in tasks["task_index"].items()}
    return [by_index[i] for i in sorted(by_index)]


def _restore_spec(built: RobotSpec, sidecar: Mapping[str, Any] | None, spec_name: str | None) -> RobotSpec:
    """The exported spec when it agrees with the features (it has names, instruction, extras)."""
    if sidecar is None:
        return built
    try:
        exported = RobotSpec.from_dict(sidecar["spec"])
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring the sidecar spec: %s", e)
        return built
    same = (
        exported.state_dim == built.state_dim
        and exported.action_dim == built.action_dim
        and exported.cameras == built.cameras
        and exported.control_hz == built.control_hz
    )
    if not same:
        return built
    return dataclasses.replace(exported, name=spec_name) if spec_name else exported


def _column(cols: Mapping[str, np.ndarray], key: str, n: int) -> np.ndarray:
    """A column as [n, k]: HF gives shape-[1] features as [n] and vectors as [n, k]."""
    return np.asarray(cols[key]).reshape(n, -1)


def _plan_episodes(
    ds: LeRobotDataset,
    opt: _Optional,
    sidecar: Mapping[str, Any] | None,
    default_controller: Controller,
    fps: float,
    task: str,
    task_given: bool,
) -> list[_Plan]:
    """Read and check every non-image column of every episode, before anything is written."""
    keys = [STATE_KEY, ACTION_KEY, "episode_index", "frame_index", "timestamp", "task_index"]
    keys += [k for k, on in ((REWARD_KEY, opt.reward), (DONE_KEY, opt.done)) if on]
    keys += [k for k, on in ((TRUNCATED_KEY, opt.truncated), (SUCCESS_KEY, opt.success)) if on]
    keys += [OUTCOME_KNOWN_KEY] if opt.outcome_known else []
    keys += sorted({k for k in (opt.controller, opt.intervention) if k})
    keys += [SEGMENT_KEY] if opt.segment else []
    cols = ds.hf_dataset.select_columns(keys).with_format("numpy")[:]
    n = len(cols["episode_index"])
    state = _column(cols, STATE_KEY, n).astype(np.float32)
    action = _column(cols, ACTION_KEY, n).astype(np.float32)
    episode = _column(cols, "episode_index", n)[:, 0].astype(np.int64)
    frame = _column(cols, "frame_index", n)[:, 0].astype(np.int64)
    for key, arr in ((STATE_KEY, state), (ACTION_KEY, action)):
        _check_finite(key, arr, episode, frame)
    reward = np.zeros(n, np.float32)
    if opt.reward:
        reward = _column(cols, REWARD_KEY, n)[:, 0].astype(np.float32)
        _check_finite(REWARD_KEY, reward, episode, frame)
    done = _column(cols, DONE_KEY, n)[:, 0].astype(bool) if opt.done else np.zeros(n, bool)
    truncated = _column(cols, TRUNCATED_KEY, n)[:, 0].astype(bool) if opt.truncated else np.zeros(n, bool)
    success = _column(cols, SUCCESS_KEY, n)[:, 0].astype(bool) if opt.success else None
    known = _column(cols, OUTCOME_KNOWN_KEY, n)[:, 0].astype(bool) if opt.outcome_known else None
    segment = _column(cols, SEGMENT_KEY, n)[:, 0].astype(np.int64) if opt.segment else None
    if opt.controller == CONTROLLER_KEY:
        controller = _column(cols, CONTROLLER_KEY, n)[:, 0].astype(np.int64)
        bad = ~np.isin(controller, [int(c) for c in Controller])
        if bad.any():
            i = int(np.argmax(bad))
            raise SpecError(
                CONTROLLER_KEY,
                "codes policy=0, human=1, scripted=2",
                f"{controller[i]} at episode {episode[i]} frame {frame[i]}",
            )
    elif opt.controller is not None:
        flag = _column(cols, opt.controller, n)[:, 0].astype(bool)
        controller = np.where(flag, int(Controller.HUMAN), int(Controller.POLICY))
    else:
        controller = np.full(n, int(default_controller), np.int64)
    controller = controller.astype(np.uint8)
    if opt.intervention is not None:
        intervention = _column(cols, opt.intervention, n)[:, 0].astype(bool)
    else:
        intervention = controller == int(Controller.HUMAN)
    task_names = dict(enumerate(_task_names(ds)))
    task_index = _column(cols, "task_index", n)[:, 0].astype(np.int64)
    video_time = _column(cols, "timestamp", n)[:, 0].astype(np.float64)

    exported: dict[int, Mapping[str, Any]] = dict(sidecar["by_index"]) if sidecar is not None else {}
    now = time.time()
    plans = []
    for e in np.unique(episode):
        rows = np.flatnonzero(episode == e)
        rows = rows[np.argsort(frame[rows], kind="stable")]
        m = len(rows)
        seg_col = None if segment is None else segment[rows]
        ctrl = controller[rows]
        entry = exported.get(int(e))
        segments = _exported_segments(entry, m, seg_col) if entry is not None else None
        if segments is None:
            if entry is not None:
                log.warning("episode %d: exported segments no longer match its frames; re-derived", e)
            segments = _derive_segments(ctrl, intervention[rows], seg_col)
        ep_truncated = truncated[rows].copy()
        ep_done = done[rows] | ep_truncated
        if entry is not None and entry.get("end_flag_added") is True and ep_truncated[-1]:
            ep_truncated[-1] = ep_done[-1] = False  # the export added it; the store had neither flag
        elif entry is None and not ep_done[-1]:
            ep_truncated[-1] = True  # the episode ended here without a terminal state
        if entry is not None and entry.get("outcome") and entry.get("success") is not None:
            outcome, ok = str(entry["outcome"]), bool(entry["success"])
        elif entry is not None:  # exported while still open, or with an unknown outcome
            outcome, ok = "unknown", False
        elif success is not None and bool(success[rows].any()):
            outcome, ok = "success", True
        elif success is not None and (known is None or bool(known[rows].all())):
            outcome, ok = "failure", False
        else:
            outcome, ok = "unknown", False
        ep_tasks = task_index[rows]
        cuts = [0, *(np.flatnonzero(np.diff(ep_tasks) != 0) + 1).tolist(), m]
        runs = tuple((a, b, task_names.get(int(ep_tasks[a]), "")) for a, b in itertools.pairwise(cuts))
        instruction = runs[0][2]
        if len(runs) > 1:
            log.info("episode %d has %d task runs; instruction = the first, %r", e, len(runs), instruction)
        start = entry.get("start_time") if entry is not None else None
        ep_task = task if task_given or entry is None else str(entry.get("task") or task)
        plans.append(
            _Plan(
                episode_index=int(e),
                rows=rows,
                instruction=instruction,
                task_runs=runs,
                task=ep_task,
                segments=segments,
                outcome=outcome,
                success=ok,
                start_time=float(start) if isinstance(start, int | float) else now,
                state=state[rows],
                action=action[rows],
                reward=reward[rows],
                terminated=ep_done & ~ep_truncated,
                truncated=ep_truncated,
                controller=ctrl,
                frame_time=frame[rows] / float(fps),
                video_time=video_time[rows],
            )
        )
    return plans


def _check_finite(key: str, arr: np.ndarray, episode: np.ndarray, frame: np.ndarray) -> None:
    bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise SpecError(key, "finite values", f"NaN or inf at episode {episode[i]} frame {frame[i]}")


def _exported_segments(
    entry: Mapping[str, Any], n: int, seg_col: np.ndarray | None
) -> tuple[Segment, ...] | None:
    """The sidecar's segments for this episode, or None when they do not fit its frames."""
    try:
        segs = tuple(Segment.from_dict(s) for s in entry.get("segments", ()))
    except (KeyError, TypeError, ValueError):
        return None
    if int(entry.get("length", -1)) != n or not segs or segs[0].start != 0:
        return None
    for i, s in enumerate(segs):
        end = s.end if s.end is not None else n
        if s.index != i or not s.start <= end <= n or (i and segs[i - 1].end != s.start):
            return None
        if seg_col is not None and (seg_col[s.start : end] != i).any():
            return None
    if (segs[-1].end if segs[-1].end is not None else n) != n:
        return None
    return tuple(dataclasses.replace(s, end=n if s.end is None else s.end) for s in segs)


def _derive_segments(
    controller: np.ndarray, intervention: np.ndarray, seg_col: np.ndarray | None
) -> tuple[Segment, ...]:
    """Split where the segment column (if any) or else the controller or intervention flag changes;
    a segment whose first frame is under intervention is an ``intervention`` segment."""
    if seg_col is not None:
        cut = np.diff(seg_col) != 0
    else:
        cut = (np.diff(controller.astype(np.int64)) != 0) | (np.diff(intervention.astype(np.int8)) != 0)
    starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
    ends = [*starts[1:], len(controller)]
    segs = []
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        ctrl = Controller(int(controller[a]))
        kind = SegmentKind.INTERVENTION if intervention[a] else SegmentKind.AUTONOMOUS
        segs.append(Segment(i, kind, ctrl, a, b, None))
    return tuple(segs)


def _read_images(
    ds: LeRobotDataset, plan: _Plan, cameras: Sequence[_Camera], fps: float
) -> dict[str, np.ndarray]:
    """uint8 [T, H, W, 3] per camera name, checked against the spec's H x W."""
    out: dict[str, np.ndarray] = {}
    stills = [c.key for c in cameras if not c.video]
    raw: dict[str, list[Any]] = {}
    if stills:  # format None: HF's PIL images as stored, not LeRobot's float CHW tensors
        raw = ds.hf_dataset.with_format(None).select_columns(stills)[plan.rows.tolist()]
    for cam in cameras:
        if cam.video:
            frames = _decode_video(ds, plan, cam)
        else:
            frames = np.stack([_to_rgb(img) for img in raw[cam.key]])
        want = (len(plan.rows), *cam.spec.shape)
        if frames.shape != want:
            raise SpecError(
                cam.key,
                f"{cam.spec.height}x{cam.spec.width}x3 images as declared in meta/info.json",
                f"frames of shape {list(frames.shape[1:])} in episode {plan.episode_index}",
            )
        out[cam.spec.name] = frames
    return out


def _to_rgb(img: Any) -> np.ndarray:
    """A decoded HF image (PIL, or array HWC/CHW) as uint8 H x W x 3."""
    if hasattr(img, "convert"):
        return np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    arr = np.asarray(img)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    return _rgb_channels(arr if arr.dtype == np.uint8 else _float_to_uint8(arr))


def _float_to_uint8(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind == "f":
        return np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)
    return arr.astype(np.uint8)


def _rgb_channels(arr: np.ndarray) -> np.ndarray:
    if arr.shape[-1] == 1:
        return np.repeat(arr, 3, axis=-1)
    return arr[..., :3]


def _decode_video(ds: LeRobotDataset, plan: _Plan, cam: _Camera) -> np.ndarray:
    from lerobot.datasets.video_utils import decode_video_frames, get_safe_default_video_backend

    ep = ds.meta.episodes[plan.episode_index]
    offset = float(ep[f"videos/{cam.key}/from_timestamp"])
    path = ds.root / ds.meta.get_video_file_path(plan.episode_index, cam.key)
    frames = decode_video_frames(
        path,
        [offset + float(t) for t in plan.video_time],
        ds.tolerance_s,
        get_safe_default_video_backend(),
        return_uint8=True,
    )
    return _rgb_channels(_float_to_uint8(frames.numpy()).transpose(0, 2, 3, 1))


def _write_plan(
    store: EpisodeStore,
    spec: RobotSpec,
    plan: _Plan,
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

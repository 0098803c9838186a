"""Export: episodes of our store as a LeRobot v3 dataset (:func:`export_lerobot`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from vla_rl_client.meta import EpisodeMeta, SegmentKind
from vla_rl_client.spec import RobotSpec, SpecError

from fleet.lerobot.labels import LABELS_PATH, with_outcome_label, write_labels
from fleet.lerobot.schema import (
    ACTION_KEY,
    CONTROLLER_KEY,
    DONE_KEY,
    IMAGES_PREFIX,
    INTERVENTION_KEY,
    OUTCOME_KNOWN_KEY,
    REWARD_KEY,
    SEGMENT_KEY,
    SIDECAR_FORMAT,
    SIDECAR_PATH,
    SIDECAR_VERSION,
    STATE_KEY,
    SUCCESS_KEY,
    TRUNCATED_KEY,
)
from fleet.store import Episode, EpisodeStore, outcome_known
from vla_rl.core.scheduling import leave_realtime

if TYPE_CHECKING:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

log = logging.getLogger("fleet.lerobot_io")  # one logger for the whole package, as before the split


_IMAGE_NAMES = ["height", "width", "channels"]
# SVT-AV1 (libsvtav1, LeRobot's default encoder) dies with SIGFPE on some frames under 32 px a side
# (16x16 and 24x40 did, here); smaller cameras are exported as PNG images instead.
MIN_VIDEO_SIDE = 32
# Run as root, SVT-AV1 also raises the thread that opens an encoder to SCHED_FIFO 99 (svt_av1_enc_init_handle;
# one camera: this thread, several: LeRobot's pool processes, which exit). Set it back after every episode's
# encoding, before anything else runs or starts from this thread (vla_rl.core.scheduling). Debug level: expected.
_AFTER_ENCODER = "LeRobot video export (SVT-AV1 encoder as root)"


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
    metas = [with_outcome_label(m, events.get(m.episode_id, [])) for m in metas]
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
            write_labels(tmp / LABELS_PATH, metas, events)
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

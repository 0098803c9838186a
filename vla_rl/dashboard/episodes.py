"""Episode routes: one episode's metadata, its per-frame series, camera frames (JPEG) and videos (MP4),
and how many episodes / frames a selection (:mod:`fleet.selection`) selects. (The list and labels:
``labels.py``.)"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Query
from fastapi.responses import FileResponse, Response
from vla_rl_client.meta import Controller, EpisodeMeta, EpisodeRecord

from fleet.selection import Selection
from fleet.store_index import select_episodes
from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context
from vla_rl.dashboard.errors import ApiError

SERIES_DECIMALS = 5
"""Floats in the series endpoint are rounded to this many decimals (actions are in [-1, 1] units of
the task; 1e-5 is far below anything a plot shows) to keep the JSON compact."""


def read_meta(ctx: Context, episode_id: str) -> EpisodeMeta:
    """The episode's committed metadata (commit.json) or 404 / 422 naming the id."""
    store = ctx.res.store()
    try:
        return store.read_metadata(episode_id)
    except ValueError as e:
        raise ApiError(422, "episode_id", str(e), "an episode id ([A-Za-z0-9_.-], up to 128 chars)") from None
    except KeyError:
        raise ApiError(
            404, "episode_id", f"no episode {episode_id!r} in {store.root}", "an existing episode id"
        ) from None


def _camera(meta: EpisodeMeta, camera: str) -> str:
    names = list(meta.spec.camera_names)
    if camera not in names:
        raise ApiError(
            404, "camera", f"episode {meta.episode_id} has no camera {camera!r}", f"one of {names}"
        )
    return camera


def _cache_headers(meta: EpisodeMeta) -> dict[str, str]:
    # A closed episode's frames never change; an open one's committed frames do not either, but its
    # length does, so the video URL's content may: revalidate.
    return {"Cache-Control": "private, max-age=86400, immutable" if meta.is_closed else "private, no-cache"}


def _floats(a: np.ndarray) -> list[Any]:
    """float array -> nested lists, rounded; NaN -> null (a row of NaN -> null)."""
    a = np.asarray(a, dtype=np.float64).round(SERIES_DECIMALS)
    if a.ndim == 2:
        nan = np.isnan(a)
        if not nan.any():
            return a.tolist()
        out: list[Any] = []
        for row, bad in zip(a.tolist(), nan, strict=True):
            out.append(None if bad.all() else [None if b else v for v, b in zip(row, bad, strict=True)])
        return out
    nan = np.isnan(a)
    return [None if b else v for v, b in zip(a.tolist(), nan, strict=True)] if nan.any() else a.tolist()


def episode_json(meta: EpisodeMeta) -> dict[str, Any]:
    """The store's view of an episode (authoritative for frames, segments and length, open ones too)."""
    spec = meta.spec
    return {
        "id": meta.episode_id,
        "robot_id": meta.robot_id,
        "task": meta.task,
        "instruction": meta.instruction,
        "status": meta.status,
        "outcome": meta.outcome,
        "success": meta.success,
        "length": meta.length,
        "chunk_len": meta.chunk_len,
        "created_at": meta.created,
        "closed_at": meta.closed,
        "revisions": list(meta.revisions),
        "segments": [s.to_dict() for s in meta.segments],
        "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in spec.cameras],
        "control_hz": spec.control_hz,
        "action_dim": spec.action_dim,
        "state_dim": spec.state_dim,
        "action_names": list(spec.action_names),
        "state_names": list(spec.state_names),
    }


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))

    @r.get("/episodes/{episode_id}/series", summary="per-frame arrays for the plots")
    def series(episode_id: str, _: Principal = viewer) -> dict[str, Any]:
        meta = read_meta(ctx, episode_id)
        ep = ctx.res.store().read_episode(episode_id, cameras=False)
        return {
            "id": meta.episode_id,
            "length": ep.length,
            "control_hz": meta.spec.control_hz,
            "action_names": list(meta.spec.action_names),
            "state_names": list(meta.spec.state_names),
            "timestamp": np.asarray(ep.timestamp, dtype=np.float64).round(4).tolist(),
            "action": _floats(ep.action),
            "proposed_action": _floats(ep.proposed_action),
            "reward": _floats(ep.reward),
            "state": _floats(ep.state),
            "controller": ep.controller.astype(int).tolist(),
            "controllers": {str(int(c)): c.label for c in Controller},
            "segment": ep.segment.astype(int).tolist(),
            "revision": ep.revision.astype(int).tolist(),
            "revisions": list(ep.meta.revisions),
            "terminated": ep.terminated.astype(bool).tolist(),
            "truncated": ep.truncated.astype(bool).tolist(),
            # the policy's per-chunk score on each frame (null: not scored); None: not recorded
            "uncertainty": None if ep.uncertainty is None else _floats(ep.uncertainty),
            # the failure predictor's per-chunk score on each frame (null: not scored)
            "failure": None if ep.failure is None else _floats(ep.failure),
        }

    @r.get(
        "/episodes/{episode_id}/frames/{camera}/{t}.jpg",
        summary="one camera frame as JPEG",
        response_class=Response,
        responses={200: {"content": {"image/jpeg": {}}}},
    )
    def frame(
        episode_id: str,
        camera: str,
        t: int,
        quality: int = Query(85, ge=1, le=100, description="JPEG quality"),
        _: Principal = viewer,
    ) -> Response:
        meta = read_meta(ctx, episode_id)
        _camera(meta, camera)
        if not 0 <= t < meta.length:
            raise ApiError(
                404 if meta.length else 409,
                "t",
                f"episode {episode_id} has {meta.length} committed frames; no frame {t}",
                f"0..{meta.length - 1}" if meta.length else "a frame once one is committed",
            )
        jpeg = ctx.jpegs.get(ctx.reader(), meta, camera, t, quality)
        return Response(jpeg, media_type="image/jpeg", headers=_cache_headers(meta))

    @r.get(
        "/episodes/{episode_id}/video/{camera}.mp4",
        summary="the camera as H.264 MP4 (encoded on demand, cached)",
        response_class=FileResponse,
        responses={200: {"content": {"video/mp4": {}}}},
    )
    def video(episode_id: str, camera: str, _: Principal = viewer) -> FileResponse:
        meta = read_meta(ctx, episode_id)
        _camera(meta, camera)
        if meta.length == 0:
            raise ApiError(409, "episode_id", f"episode {episode_id} has no committed frames yet", "a frame")
        path = ctx.video().get(meta, camera)
        headers = _cache_headers(meta) | {"X-Frames": str(meta.length)}
        return FileResponse(path, media_type="video/mp4", headers=headers)

    @r.get("/selection", summary="how many episodes / frames a selection text selects")
    def selection(
        data: str = Query("", max_length=4096, description="selection text, e.g. robot=sim-0,success=false"),
        task: str | None = Query(
            None, max_length=256, description="the task (default: the store's only task)"
        ),
        _: Principal = viewer,
    ) -> dict[str, Any]:
        task = task or only_task(ctx)
        episodes = select(ctx, parse_selection(data, task))
        return {
            "task": task,
            "data": data,
            "episodes": len(episodes),
            "frames": sum(e.length for e in episodes),
        }

    return r


def only_task(ctx: Context) -> str:
    tasks = sorted({e.task for e in ctx.res.db().episodes()})
    if len(tasks) != 1:
        raise ApiError(422, "task", f"the store holds {len(tasks)} tasks; say which", f"one of {tasks}")
    return tasks[0]


SELECTION_KEYS = (
    "key=value pairs (task, robot, since, until, revision, round, success, outcome, label.<key>, intervention, "
    "flag, flagged, status, min_length, max_length, max, exclude), e.g. robot=sim-0|sim-1,success=false"
)


def parse_selection(data: str | None, task: str) -> Selection:
    """The selection text ``data`` for ``task``, or 422 naming ``data``."""
    try:
        return Selection.parse(data, task=task)
    except ValueError as e:
        raise ApiError(422, "data", f"data: {e}", f"selection text: {SELECTION_KEYS}") from None


def select(ctx: Context, selection: Selection) -> list[EpisodeRecord]:
    """The closed episodes ``selection`` selects (what a round would train on), oldest first, in SQL by
    the dashboard's metadata DB (:func:`fleet.store_index.select_episodes`); 422 naming ``data`` for a
    round the DB does not hold."""
    try:
        return select_episodes(ctx.res.store(), selection, ctx.res.db())
    except ValueError as e:
        raise ApiError(422, "data", f"data: {e}", f"selection text: {SELECTION_KEYS}") from None

"""Episode list, one episode (with its labels and flags), the label schema, and writing labels.

(Interim: filters run over the DB's episode rows in Python until the DB's EpisodeQuery lands.)"""

from __future__ import annotations

import tomllib
from typing import Any

from fastapi import APIRouter, Depends, Query

from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context, jsonable
from vla_rl.dashboard.episodes import episode_json, read_meta
from vla_rl.dashboard.errors import ApiError
from vla_rl.dashboard.resources import labels_path

MAX_PER_PAGE = 500


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))

    @r.get("/label-schema", summary="the label schema (keys, allowed values, shortcuts)")
    def label_schema(_: Principal = viewer) -> dict[str, Any]:
        path = labels_path(ctx.cfg)
        try:
            return tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ApiError(
                503, "labels", f"the label schema {path} cannot be read ({e}); check --labels", "a TOML file"
            ) from None

    @r.get("/episodes", summary="filtered, sorted, paged episode list")
    def episode_list(
        task: str | None = Query(None, max_length=256),
        robot: str | None = Query(None, max_length=128),
        page: int = Query(1, ge=1, le=1_000_000),
        per_page: int = Query(50, ge=1, le=MAX_PER_PAGE),
        _: Principal = viewer,
    ) -> dict[str, Any]:
        rows = [e for e in ctx.res.db().episodes(task=task) if robot is None or e.robot_id == robot]
        rows.sort(key=lambda e: e.created_at, reverse=True)
        items = rows[(page - 1) * per_page : page * per_page]
        return {
            "total": len(rows),
            "page": page,
            "per_page": per_page,
            "items": [
                {
                    "id": e.id,
                    "robot_id": e.robot_id,
                    "task": e.task,
                    "instruction": e.instruction,
                    "status": e.status,
                    "outcome": e.outcome,
                    "success": e.success,
                    "length": e.length,
                    "created_at": e.created_at,
                    "closed_at": e.closed_at,
                    "revisions": list(e.revisions),
                    "takeovers": sum(1 for g in e.segments if g.kind.value == "intervention"),
                    "labels": {},
                    "flags": {},
                }
                for e in items
            ],
        }

    @r.get(
        "/episodes/{episode_id}", summary="one episode: metadata, segments, cameras, labels, history, flags"
    )
    def episode(episode_id: str, _: Principal = viewer) -> dict[str, Any]:
        meta = read_meta(ctx, episode_id)
        history = [jsonable(vars(lb)) for lb in ctx.res.db().labels(episode_id)]
        return episode_json(meta) | {"labels": {}, "history": history, "flags": {}}

    return r

"""The episode list (filtered, sorted and paged in SQL), one episode with its labels, history and
flags, the label schema, and writing labels (one episode, many, or every match of a filter) and undoing
them. Every label is checked against the schema (``fleet.labels.LabelSchema``) and written in one
transaction (``MetadataDB.add_labels``): a refused request writes nothing. The author is the token's
name; the source is ``human``."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

import fleet.flags
from fleet.db import effective_outcome
from fleet.labels import LabelSchema
from fleet.selection import EpisodeQuery
from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context
from vla_rl.dashboard.episodes import episode_json, read_meta
from vla_rl.dashboard.errors import ApiError, SafeJSONResponse
from vla_rl.dashboard.fields import FRAME_MAX, JSON_TEXT, Line, RowId, Text
from vla_rl.dashboard.resources import labels_path
from vla_rl.dashboard.startup import PhaseTimer

MAX_BULK = 10_000
"""Most episodes one POST /labels may label (listed, or matched by its filter)."""
MAX_VALUE_CHARS = 2000
"""Longest label value (as JSON) and note."""


class LabelRequest(BaseModel):
    """Label one or many episodes (or a frame span of them): POST /api/v1/labels. Every text is checked
    (:mod:`vla_rl.dashboard.fields`: valid Unicode, no control characters) before anything else."""

    model_config = ConfigDict(extra="forbid")
    episode_ids: list[Line] | None = Field(
        None, min_length=1, max_length=MAX_BULK, description="the episodes"
    )
    filter: dict[str, str | int | float | bool | list[str]] | None = Field(
        None,
        max_length=32,
        description="instead of episode_ids: an episode-list query, every match is labelled",
    )
    key: Line = Field(..., min_length=1, max_length=128)
    value: Annotated[Any, JSON_TEXT] = Field(
        ..., description="one of the key's values (or text for a free-text key)"
    )
    start: int | None = Field(None, ge=0, le=FRAME_MAX, description="span labels: first frame")
    end: int | None = Field(
        None, ge=1, le=FRAME_MAX, description="span labels: frame after the last (end exclusive)"
    )
    note: Text | None = Field(None, max_length=MAX_VALUE_CHARS)


class UndoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    note: Text | None = Field(None, max_length=MAX_VALUE_CHARS)


def _field_of(message: str, default: str) -> str:
    head, sep, _ = message.partition(":")
    head = head.strip()
    if not sep or " " in head:
        return default
    return "start" if head == "start/end" else head


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))
    labeller = Depends(ctx.require("labeller"))

    def schema() -> LabelSchema:
        try:
            return LabelSchema.load(labels_path(ctx.cfg))
        except ValueError as e:
            raise ApiError(
                503, "labels", f"{e}; fix the file or the dashboard's --labels", "a valid label schema"
            ) from None

    def query(params: Any) -> EpisodeQuery:
        try:
            return EpisodeQuery.from_params(params)
        except ValueError as e:
            raise ApiError(422, _field_of(str(e), "query"), str(e), None) from None

    unreadable = ctx.startup.unreadable  # episodes whose frames are not in the store: flagged never

    def refresh_flags(ids: list[str]) -> bool:
        """Compute the auto-flags of these closed episodes if they lack them (lazily, cached in the DB)."""
        if not ids:
            return False
        return bool(fleet.flags.refresh_flags(ctx.res.store(), ctx.res.db(), ids, unreadable=unreadable))

    @r.get("/label-schema", summary="the label schema (keys, allowed values, shortcuts, digits)")
    def label_schema(_: Principal = viewer) -> dict[str, Any]:
        return schema().to_dict()

    @r.get(
        "/episodes",
        summary="filtered, sorted, paged episode list (docs/dashboard.md for the parameters)",
        response_class=SafeJSONResponse,
    )
    def episode_list(request: Request, _: Principal = viewer) -> Response:
        timer = PhaseTimer()
        q = query(request.query_params)
        db = ctx.res.db()
        sync = ctx.startup.progress.to_dict()
        try:
            items, total = db.query_episodes(q)
            timer.lap("query")
            # while the start-up sync runs it computes the flags (with every length recorded), in the
            # background: the page shows what the DB has now instead of waiting for its own
            lazy = not sync["running"]
            if lazy and refresh_flags([i.id for i in items if i.status == "closed"]):
                flags = db.flags([i.id for i in items])
                out = [
                    i.to_dict() | {"flags": {n: f.to_dict() for n, f in flags[i.id].items()}} for i in items
                ]
            else:
                out = [i.to_dict() for i in items]
            timer.lap("flags")
        except ValueError as e:  # a round that does not exist
            raise ApiError(422, _field_of(str(e), "query"), str(e), None) from None
        # JSON types already: rendered as is (no pass through FastAPI's encoder and response model)
        res = SafeJSONResponse(
            {"total": total, "page": q.page, "per_page": q.per_page, "items": out, "sync": sync}
        )
        timer.lap("json")
        res.headers["Server-Timing"] = timer.header()
        return res

    @r.get("/selection/from-filter", summary="an episode-list filter as selection text, and its counts")
    def selection_from_filter(request: Request, _: Principal = viewer) -> dict[str, Any]:
        from vla_rl.dashboard.episodes import only_task, select

        names = {k for k in request.query_params if k not in ("page", "per_page", "sort")}
        q = query({k: request.query_params.getlist(k) for k in names}).filters()
        task = q.task or only_task(ctx)
        episodes = select(ctx, dataclasses.replace(q, task=task))
        return {
            "task": task,
            "data": q.to_text(),
            "episodes": len(episodes),
            "frames": sum(e.length for e in episodes),
        }

    @r.get(
        "/episodes/{episode_id}", summary="one episode: metadata, segments, cameras, labels, history, flags"
    )
    def episode(episode_id: str, _: Principal = viewer) -> dict[str, Any]:
        meta = read_meta(ctx, episode_id)
        db = ctx.res.db()
        current = db.current_label_events([episode_id])[episode_id]
        labels = {lb.key: lb.value for lb in current if not lb.is_span}
        if meta.is_closed:
            refresh_flags([episode_id])
        outcome, success = effective_outcome(meta.outcome, meta.success, labels)
        return episode_json(meta) | {
            "outcome": outcome,
            "success": success,
            "recorded_outcome": meta.outcome,
            "recorded_success": meta.success,
            "labels": labels,
            "label_events": {lb.key: lb.to_dict() for lb in current if not lb.is_span},
            "spans": [lb.to_dict() for lb in current if lb.is_span],
            "history": [lb.to_dict() for lb in db.labels(episode_id)],
            "flags": {n: f.to_dict() for n, f in db.flags([episode_id])[episode_id].items()},
            "in_db": db.episode(episode_id) is not None,
        }

    @r.post(
        "/labels",
        status_code=201,
        summary="label one or many episodes (or a span); returns the new label ids",
    )
    def add_labels(body: LabelRequest, who: Principal = labeller) -> dict[str, Any]:
        if (body.episode_ids is None) == (body.filter is None):
            raise ApiError(
                422,
                "episode_ids",
                "episode_ids: give either episode_ids or filter (not both)",
                "a list of episode ids, or filter = an episode-list query",
            )
        if (body.start is None) != (body.end is None):
            raise ApiError(
                422,
                "end" if body.end is None else "start",
                "start/end: a span needs both",
                "both start and end (end exclusive), or neither",
            )
        if len(json.dumps(body.value)) > MAX_VALUE_CHARS:
            raise ApiError(
                422, "value", f"value: longer than {MAX_VALUE_CHARS} characters", f"<= {MAX_VALUE_CHARS}"
            )
        span = (body.start, body.end) if body.start is not None and body.end is not None else None
        try:
            schema().validate(body.key, body.value, span)
        except ValueError as e:
            raise ApiError(422, _field_of(str(e), "key"), str(e), None) from None
        db = ctx.res.db()
        if body.filter is not None:
            params = {
                k: (
                    [str(x) for x in v]
                    if isinstance(v, list)
                    else str(v).lower()
                    if isinstance(v, bool)
                    else str(v)
                )
                for k, v in body.filter.items()
                if k not in ("page", "per_page")
            }
            try:
                ids = db.query_episode_ids(EpisodeQuery.from_params(params), limit=MAX_BULK + 1)
            except ValueError as e:
                raise ApiError(422, f"filter.{_field_of(str(e), 'query')}", f"filter.{e}", None) from None
            if len(ids) > MAX_BULK:
                raise ApiError(
                    422,
                    "filter",
                    f"filter: matches more than {MAX_BULK} episodes; narrow it",
                    f"<= {MAX_BULK} episodes",
                )
            if not ids:
                raise ApiError(422, "filter", "filter: matches no episodes", "a filter that matches some")
        else:
            ids = list(body.episode_ids or [])
        try:
            label_ids = db.add_labels(
                ids,
                body.key,
                body.value,
                author=who.name,
                start=body.start,
                end=body.end,
                note=body.note,
                source="human",
            )
        except KeyError as e:
            raise ApiError(
                404, "episode_ids", str(e.args[0] if e.args else e), "episodes in the metadata DB"
            ) from None
        except ValueError as e:
            raise ApiError(422, _field_of(str(e), "episode_ids"), str(e), None) from None
        return {
            "ids": label_ids,
            "episodes": len(dict.fromkeys(ids)),
            "author": who.name,
            "key": body.key,
            "value": body.value,
        }

    @r.post("/labels/{label_id}/undo", status_code=201, summary="retract a label (appends an undo event)")
    def undo(label_id: RowId, body: UndoRequest | None = None, who: Principal = labeller) -> dict[str, Any]:
        db = ctx.res.db()
        try:
            uid = db.undo_label(label_id, author=who.name, note=body.note if body else None)
        except KeyError as e:
            raise ApiError(404, "label_id", str(e.args[0] if e.args else e), "an existing label id") from None
        except ValueError as e:
            raise ApiError(409, "label_id", str(e), "a label in force") from None
        lb = db.label(uid)
        return {"id": uid, "undoes": label_id, "author": who.name, "label": lb.to_dict() if lb else None}

    return r

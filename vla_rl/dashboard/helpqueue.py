"""Help-queue routes: the robots that asked for an operator (:mod:`fleet.db.help`), and taking one.

``GET /help`` lists open and claimed requests (most urgent first, then oldest) with how long each robot
has waited, and the ones closed last (``recent``: who took them, how they ended); the page polls it. Requests nobody claimed within ``--help-expire-s`` are expired first.
``POST /help/claim`` takes the next request (or the one named) for the caller: one conditional update in
the DB, so of two people clicking at once exactly one gets it and the other a 409 naming who has it.
``POST /help/{id}/resolve`` closes a request the caller claimed. Both writes need the operator role.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from fleet.db import HelpConflict, HelpRequest
from fleet.selection import MAX_DB_INT
from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context
from vla_rl.dashboard.errors import ApiError
from vla_rl.dashboard.fields import Line, RowId

log = logging.getLogger("vla_rl.dashboard")

MAX_LISTED = 200
"""Most requests one answer lists (a queue longer than that is a fleet on fire; the count says so)."""
RECENT = 10
"""Closed requests ``GET /help`` sends along (``recent``, newest close first)."""


class ClaimRequest(BaseModel):
    """Take a help request (POST /api/v1/help/claim); no id = the next one (most urgent, then oldest)."""

    model_config = ConfigDict(extra="forbid")
    request_id: int | None = Field(None, ge=1, le=MAX_DB_INT, description="the request to take; none = next")


class ResolveRequest(BaseModel):
    """Close a help request you claimed (POST /api/v1/help/{id}/resolve)."""

    model_config = ConfigDict(extra="forbid")
    note: Line = Field("", max_length=256, description="what was done (one line)")


def request_view(r: HelpRequest, now: float) -> dict[str, Any]:
    """A request as the page shows it: its fields, how long the robot has waited, its episode's page."""
    return r.to_dict(now) | {"episode_url": f"/episodes/{r.episode_id}"}


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))
    operator = Depends(ctx.require("operator"))

    @r.get("/help", summary="robots waiting for an operator: open, then claimed; by urgency, then age")
    def queue(
        closed: bool = Query(False, description="also list resolved and expired requests"),
        _: Principal = viewer,
    ) -> dict[str, Any]:
        db = ctx.res.db()
        now = time.time()
        db.expire_help(ctx.cfg.help_expire_s, now=now)
        statuses = ("open", "claimed", "resolved", "expired") if closed else ("open", "claimed")
        items = db.help_queue(statuses=statuses, limit=MAX_LISTED)
        return {
            "requests": [request_view(x, now) for x in items],
            "recent": [request_view(x, now) for x in db.recently_closed_help(RECENT)],
            "open": sum(x.status == "open" for x in items),
            "expire_s": ctx.cfg.help_expire_s,
            "now": now,
        }

    @r.post("/help/claim", summary="take the next help request (or the one named): one person per request")
    def claim(body: ClaimRequest | None = None, who: Principal = operator) -> dict[str, Any]:
        rid = body.request_id if body is not None else None
        try:
            got = ctx.res.db().claim_help(who.name, rid)
        except KeyError:
            raise ApiError(404, "request_id", f"no help request {rid}", "an id from GET /help") from None
        except HelpConflict as e:
            raise ApiError(409, "request_id", str(e), "an open help request") from None
        log.info("help request claimed", extra={"request": got.id, "robot": got.robot_id, "by": who.name})
        return request_view(got, time.time())

    @r.post("/help/{request_id}/resolve", summary="close a help request you claimed")
    def resolve(
        request_id: RowId, body: ResolveRequest | None = None, who: Principal = operator
    ) -> dict[str, Any]:
        note = body.note if body is not None else ""
        try:
            got = ctx.res.db().resolve_help(request_id, by=who.name, note=note)
        except KeyError:
            raise ApiError(
                404, "request_id", f"no help request {request_id}", "an id from GET /help"
            ) from None
        except HelpConflict as e:
            raise ApiError(409, "request_id", str(e), "a help request you claimed") from None
        return request_view(got, time.time())

    return r

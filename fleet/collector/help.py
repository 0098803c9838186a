"""The collector's help-queue calls (``RequestHelp``, ``GetHelp``): a robot opens a help request in the
metadata DB (:mod:`fleet.db.help`), polls it to learn an operator claimed it, and withdraws it when it no
longer needs help. A per-robot credential speaks only for its own robot and its own requests."""

from __future__ import annotations

import grpc
from vla_rl_client.proto import collector_pb2 as pb

from fleet.db import HelpConflict, HelpRequest, MetadataDB
from fleet.selection import MAX_DB_INT
from vla_rl.core.rpc import RequestError

SC = grpc.StatusCode


def help_state(r: HelpRequest) -> pb.HelpState:
    return pb.HelpState(
        request_id=r.id,
        status=r.status,
        claimed_by=r.claimed_by or "",
        claimed_at=r.claimed_at or 0.0,
        note=r.note or "",
    )


def _may_speak_for(robot_id: str, identity: str | None, allowed: frozenset[str] | None, field: str) -> None:
    if identity is not None and robot_id != identity:
        raise RequestError(
            SC.PERMISSION_DENIED, f"{field}: this credential is robot {identity!r}'s, not {robot_id!r}'s"
        )
    if allowed is not None and robot_id not in allowed:
        raise RequestError(
            SC.PERMISSION_DENIED, f"{field}: {robot_id!r} is not a known robot of this collector"
        )


def request_help(
    db: MetadataDB, ask: pb.HelpAsk, identity: str | None, allowed: frozenset[str] | None
) -> pb.HelpState:
    """Open (or find again) the robot's request for its episode. INVALID_ARGUMENT names a field out of
    bounds; RESOURCE_EXHAUSTED: the robot holds too many requests already."""
    _may_speak_for(ask.robot_id, identity, allowed, "robot_id")
    try:
        got = db.open_help(ask.robot_id, ask.episode_id, ask.reason, ask.urgency)
    except ValueError as e:
        raise RequestError(SC.INVALID_ARGUMENT, str(e)) from None
    except HelpConflict as e:
        raise RequestError(SC.RESOURCE_EXHAUSTED, str(e)) from None
    return help_state(got)


def get_help(
    db: MetadataDB, query: pb.HelpQuery, identity: str | None, allowed: frozenset[str] | None
) -> pb.HelpState:
    """Where a request stands; with ``withdraw``, resolve it first (by the robot; a request already
    closed is returned as it is). NOT_FOUND: no such request; PERMISSION_DENIED: another robot's."""
    if not 1 <= query.request_id <= MAX_DB_INT:
        raise RequestError(
            SC.INVALID_ARGUMENT, f"request_id: expected 1 .. {MAX_DB_INT}, got {query.request_id}"
        )
    got = db.help_request(query.request_id)
    if got is None:
        raise RequestError(SC.NOT_FOUND, f"request_id: no help request {query.request_id}")
    _may_speak_for(got.robot_id, identity, allowed, "request_id")
    if query.withdraw and got.status in ("open", "claimed"):
        try:
            got = db.resolve_help(got.id, by=got.robot_id, note="withdrawn by the robot")
        except HelpConflict:
            got = db.help_request(query.request_id) or got  # closed meanwhile: say how
    return help_state(got)

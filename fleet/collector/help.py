"""The collector's help-queue calls: a robot opens a help request in the metadata DB (:mod:`fleet.db.help`,
``RequestHelp``), polls it to learn an operator claimed it, and withdraws it when it no longer needs help
(``GetHelp``); an operator takes one (``ClaimHelp``: the next, most urgent, or the one named) and closes it
once the robot is back under its policy (``ResolveHelp``), the same conditional DB updates the dashboard's
help queue makes for a person. A per-robot credential speaks only for its own robot and its own requests,
and never as an operator: claiming and resolving need the collector's shared credential."""

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
        robot_id=r.robot_id,
        episode_id=r.episode_id,
        urgency=r.urgency,
        created_at=r.created_at,
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


def _as_operator(identity: str | None) -> None:
    if identity is not None:
        raise RequestError(
            SC.PERMISSION_DENIED,
            f"operator: this credential is robot {identity!r}'s; claiming and resolving help requests needs "
            "the collector's shared credential",
        )


def _request_id(rid: int, *, zero_ok: bool) -> int | None:
    if (rid == 0 and zero_ok) or 1 <= rid <= MAX_DB_INT:
        return rid or None
    low = 0 if zero_ok else 1
    raise RequestError(SC.INVALID_ARGUMENT, f"request_id: expected {low} .. {MAX_DB_INT}, got {rid}")


def claim_help(db: MetadataDB, claim: pb.HelpClaim, identity: str | None) -> pb.HelpState:
    """The operator takes the named request, or the next one (``request_id`` 0). NOT_FOUND: no such request,
    or nothing open to take next; FAILED_PRECONDITION: the named one is not open (the message names who has
    it); INVALID_ARGUMENT: ``operator`` out of bounds."""
    _as_operator(identity)
    rid = _request_id(claim.request_id, zero_ok=True)
    try:
        return help_state(db.claim_help(claim.operator, rid))
    except ValueError as e:
        raise RequestError(SC.INVALID_ARGUMENT, str(e)) from None
    except KeyError:
        raise RequestError(SC.NOT_FOUND, f"request_id: no help request {rid}") from None
    except HelpConflict as e:
        code = SC.NOT_FOUND if rid is None else SC.FAILED_PRECONDITION
        raise RequestError(code, f"request_id: {e}") from None


def resolve_help(db: MetadataDB, done: pb.HelpResolve, identity: str | None) -> pb.HelpState:
    """The operator who claimed the request closes it. NOT_FOUND: no such request; FAILED_PRECONDITION:
    already closed, or claimed by someone else; INVALID_ARGUMENT: ``operator`` or ``note`` out of bounds."""
    _as_operator(identity)
    rid = _request_id(done.request_id, zero_ok=False)
    got = db.help_request(rid)  # type: ignore[arg-type]
    if got is None:
        raise RequestError(SC.NOT_FOUND, f"request_id: no help request {rid}")
    if done.operator == got.robot_id:  # resolving as the robot is GetHelp(withdraw), not an operator's call
        raise RequestError(SC.INVALID_ARGUMENT, f"operator: {done.operator!r} is the robot that asked")
    try:
        return help_state(db.resolve_help(got.id, by=done.operator, note=done.note))
    except ValueError as e:
        raise RequestError(SC.INVALID_ARGUMENT, str(e)) from None
    except HelpConflict as e:
        raise RequestError(SC.FAILED_PRECONDITION, f"request_id: {e}") from None

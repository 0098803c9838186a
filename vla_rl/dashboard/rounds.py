"""Round routes: list, detail, live progress (Server-Sent Events), queue, cancel, promote, roll back.

Queuing goes through :func:`vla_rl.rounds.queue_round` with a :class:`~vla_rl.rounds.RoundConfig` built
from the algorithm, preset, base ref, selection text and margin the page sent; everything is
checked first (unknown algorithm or preset, a base that does not resolve, a selection that selects
nothing), so a refused request writes nothing. A ``vla-rl round worker`` runs the round, never this
process.

Promotion and rollback move the followed ref (``--promote-ref``, default ``prod``) with
:func:`vla_rl.hub.registry.move_ref`. Each move is recorded in the round's ``metrics["promotions"]``
(append-only: ``{"action": "promote"|"rollback", "ref", "repo", "from", "to", "by", "at"}``), so a
rollback knows the commit the ref pointed at before, and who did what is in the rounds table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from fleet.db import FINISHED_STATUSES, RoundRecord
from vla_rl.core.secrets import shown_url
from vla_rl.dashboard import hub
from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context, jsonable
from vla_rl.dashboard.errors import ApiError
from vla_rl.dashboard.fields import JSON_LINES, Line, RowId, movable_ref

log = logging.getLogger("vla_rl.dashboard")

SSE_POLL_S = 0.5
"""How often the event stream looks at the round's row (the worker reports phases into it)."""
SSE_KEEPALIVE_S = 15.0
MAX_OPTIONS = 64
"""Most knobs one round request may set."""
# Set by the dashboard, not by the page: where a round reads and writes, and whether it shows a bar.
_RESERVED = ("base", "store", "out", "data", "task", "db_url", "progress", "round_index")


class RoundRequest(BaseModel):
    """Queue a round (POST /api/v1/rounds). Every text is checked (:mod:`vla_rl.dashboard.fields`: valid
    Unicode, no control characters, bounded) before anything else."""

    model_config = ConfigDict(extra="forbid")
    algo: Line | None = Field(
        None, max_length=32, description="algorithm (sft, awr, recap, qam, ...); default: the preset's"
    )
    preset: Line | None = Field(None, max_length=64, description="a named recipe (vla_rl.train.presets)")
    base: Line = Field(..., min_length=1, max_length=512, description="base checkpoint: hub://org/name@rev")
    data: Line | None = Field(
        None, max_length=4096, description="selection text (None = every closed episode)"
    )
    margin: float | None = Field(
        None, description="promote only if success beats the base's by more (a fraction)"
    )
    task: Line | None = Field(None, max_length=256, description="task; default: the base checkpoint's")
    options: Annotated[dict[str, Any], JSON_LINES] = Field(
        default_factory=dict, max_length=MAX_OPTIONS, description="other trainer / round knobs"
    )


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: Line | None = Field(None, max_length=128, description="the ref to move (default: --promote-ref)")


def round_summary(r: RoundRecord) -> dict[str, Any]:
    m, cfg = r.metrics, r.config
    train = cfg.get("train", {}) if isinstance(cfg, dict) else {}
    return jsonable(
        {
            "id": r.id,
            "algo": r.algo,
            "preset": cfg.get("preset"),
            "task": r.task,
            "status": r.status,
            "base_ref": r.base_ref,
            "base_revision": r.base_revision,
            "data": train.get("data"),
            "margin": cfg.get("margin"),
            "checkpoint_ref": r.checkpoint_ref,
            "checkpoint_revision": r.checkpoint_revision,
            "promoted": r.promoted,
            "success": m.get("success"),
            "ci95": m.get("ci95"),
            "base_success": m.get("base_success"),
            "base_ci95": m.get("base_ci95"),
            "delta": m.get("delta"),
            "p_value": m.get("p_value"),
            "gate_alpha": m.get("gate_alpha"),
            "reported_success": m.get("reported_success"),
            "reported_ci95": m.get("reported_ci95"),
            "report_episodes": m.get("report_episodes"),
            "action_mse": m.get("action_mse"),
            "base_action_mse": m.get("base_action_mse"),
            "estimated_success": m.get("estimated_success"),
            "estimated_success_ci95": m.get("estimated_success_ci95"),
            "base_estimated_success": m.get("base_estimated_success"),
            "gate": m.get("gate"),
            "error": r.error,
            "created_at": r.created_at,
            "finished_at": r.finished_at,
            "worker": r.worker,
            "attempts": r.attempts,
            "cancel_requested": r.cancel_requested,
            "progress": r.progress or {},
        }
    )


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
    """A round's config as a viewer sees it: a DB URL's password masked (a round queued before configs
    were stored without one may still hold it)."""
    out = jsonable(config)
    train = out.get("train") if isinstance(out, dict) else None
    if isinstance(train, dict) and isinstance(train.get("db_url"), str):
        train["db_url"] = shown_url(train["db_url"])
    return out


def _round(ctx: Context, n: int) -> RoundRecord:
    rec = ctx.res.db().round(n)
    if rec is None:
        raise ApiError(404, "round", f"no round {n} in {ctx.res.db_shown}", "an existing round number")
    return rec


def _field_error(e: Exception, default: str) -> ApiError:
    """A ValueError whose message starts with ``field: ...`` (the configs' convention) -> 422 on it."""
    msg = str(e)
    head, sep, _ = msg.partition(":")
    field = head.strip() if sep and head.strip().replace("_", "").isalnum() else default
    return ApiError(422, field, msg, None)


def build_round(ctx: Context, body: RoundRequest, who: Principal) -> Any:
    """A validated RoundConfig for ``body`` (422 naming the field otherwise). Touches nothing."""
    from vla_rl.rounds import RoundConfig, RoundOptions
    from vla_rl.train.algorithms import ALGORITHMS, get_algorithm
    from vla_rl.train.presets import PRESETS, get_preset

    preset_values: dict[str, Any] = {}
    algo = body.algo
    if body.preset is not None:
        if body.preset not in PRESETS:
            raise ApiError(422, "preset", f"preset: no preset {body.preset!r}", f"one of {sorted(PRESETS)}")
        p = get_preset(body.preset)
        if algo is not None and algo != p.algorithm:
            raise ApiError(
                422,
                "preset",
                f"preset: {body.preset} is a recipe for {p.algorithm}, not {algo}",
                f"a {algo} preset",
            )
        algo, preset_values = p.algorithm, dict(p.values)
    if algo is None or algo not in ALGORITHMS:
        raise ApiError(
            422,
            "algo",
            f"algo: expected one of {', '.join(ALGORITHMS)}, got {algo!r}",
            f"one of {sorted(ALGORITHMS)}",
        )
    alg = get_algorithm(algo)
    if body.margin is not None and not -1.0 < body.margin < 1.0:
        raise ApiError(
            422, "margin", f"margin: expected a fraction in (-1, 1), got {body.margin}", "-1 < margin < 1"
        )
    reserved = sorted(set(body.options) & set(_RESERVED))
    if reserved:
        raise ApiError(
            422,
            f"options.{reserved[0]}",
            f"options.{reserved[0]}: set by the dashboard (or a top-level field)",
            "another knob",
        )
    round_fields = {f.name for f in dataclasses.fields(RoundOptions)} - {"margin", "promote_ref"}
    round_opts = {k: v for k, v in body.options.items() if k in round_fields}
    train_opts = {k: v for k, v in body.options.items() if k not in round_fields}
    train_names = {f.name for f in dataclasses.fields(alg.config_class())}
    unknown = sorted(set(train_opts) - train_names)
    if unknown:
        raise ApiError(
            422,
            f"options.{unknown[0]}",
            f"options.{unknown[0]}: not a knob of {algo} rounds",
            f"one of {sorted((train_names | round_fields) - set(_RESERVED))}",
        )

    commit = hub.resolve_ref(body.base, "base")
    spec_task = hub.robot_spec_name(body.base, commit, "base")
    task = body.task or spec_task
    if task != spec_task:
        raise ApiError(
            422, "task", f"task: the base checkpoint is for {spec_task!r}, not {task!r}", spec_task
        )
    from vla_rl.dashboard.episodes import parse_selection, select

    episodes = select(ctx, parse_selection(body.data, task))
    if not episodes:
        raise ApiError(
            422,
            "data",
            f"data: {body.data or '(everything)'} selects no closed {task} episodes in {ctx.cfg.store}",
            "a selection that matches at least one closed episode",
        )
    out = (ctx.cfg.workdir / "rounds").resolve()
    values = {
        **preset_values,
        **train_opts,
        "base": body.base,
        "store": ctx.cfg.store if isinstance(ctx.cfg.store, str) else Path(ctx.cfg.store).resolve(),
        "out": out,
        "data": body.data or None,
        "task": task,
        # no URL (its password is a secret a viewer would read back): the worker that claims the round
        # from this DB trains against the same DB (vla_rl.rounds.training_db_url)
        "db_url": None,
        "progress": False,
    }
    try:
        train = alg.make_config(**values)
        kw: dict[str, Any] = {"promote_ref": ctx.cfg.promote_ref, **round_opts}
        if body.margin is not None:
            kw["margin"] = body.margin
        if ctx.cfg.repo and "repo" not in kw:
            kw["repo"] = ctx.cfg.repo
        cfg = RoundConfig(train=train, preset=body.preset, **kw)
        from vla_rl.rounds import config_from_json, config_to_json

        config_from_json(config_to_json(cfg))  # what the worker will do with the row: fail here instead
    except (TypeError, ValueError) as e:
        raise _field_error(e, "options") from None
    return cfg, len(episodes)


def _knob_value(v: Any) -> Any:
    """A config default as JSON (paths and other objects as text)."""
    v = jsonable(v)
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_knob_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _knob_value(x) for k, x in v.items()}
    return str(v)


def _knobs(cls: type, skip: set[str]) -> list[dict[str, Any]]:
    """The settable fields of dataclass ``cls`` but ``skip``: ``{"name", "type", "default"}``."""
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append({"name": f.name, "type": str(f.type), "default": _knob_value(default)})
    return out


@functools.cache
def algorithm_catalogue() -> dict[str, Any]:
    """``GET /api/v1/algorithms``: every algorithm of :data:`vla_rl.train.algorithms.ALGORITHMS` (name,
    summary, ``offline`` = learns from the episode store, ``online`` = can collect its own experience in
    simulation (its config has ``env_steps``), ``needs_base``, the fields its name fixes, its knobs with
    their defaults) with its presets (:data:`vla_rl.train.presets.PRESETS`: name, summary, knob values),
    and the round's own knobs (:class:`vla_rl.rounds.RoundOptions`) that ``options`` may also set."""
    from vla_rl.rounds import RoundOptions
    from vla_rl.train.algorithms import ALGORITHMS
    from vla_rl.train.presets import PRESETS

    algos = []
    for a in ALGORITHMS.values():
        cls = a.config_class()
        names = {f.name for f in dataclasses.fields(cls)}
        algos.append(
            {
                "name": a.name,
                "summary": a.summary,
                "offline": bool(cls.needs_store),
                "online": "env_steps" in names,
                "needs_base": bool(cls.needs_base),
                "fixed": {k: _knob_value(v) for k, v in a.fixed.items()},
                "knobs": _knobs(cls, set(_RESERVED) | set(a.fixed)),
                "presets": [
                    {
                        "name": p.name,
                        "summary": p.summary,
                        "values": {k: _knob_value(v) for k, v in p.values.items()},
                    }
                    for p in PRESETS.values()
                    if p.algorithm == a.name
                ],
            }
        )
    return {"algorithms": algos, "round_knobs": _knobs(RoundOptions, {"margin", "promote_ref"})}


def _events(rec: RoundRecord) -> list[dict[str, Any]]:
    return list(rec.metrics.get("promotions") or [])


def _record_event(ctx: Context, rec: RoundRecord, event: dict[str, Any], promoted: bool) -> RoundRecord:
    db = ctx.res.db()
    fresh = db.round(rec.id) or rec
    metrics = {**fresh.metrics, "promotions": [*_events(fresh), event]}
    return db.update_round(rec.id, metrics=metrics, promoted=promoted)


def _repo_of(ref: str | None) -> str | None:
    from vla_rl.hub.registry import is_hub_ref, parse_ref

    if ref and is_hub_ref(ref):
        try:
            return parse_ref(ref).repo_id
        except ValueError:
            return None
    return None


def policy_repo(ctx: Context) -> str:
    """--repo, else the newest round's checkpoint (or base) repo; 422 when neither says."""
    if ctx.cfg.repo:
        return ctx.cfg.repo
    for r in reversed(ctx.res.db().rounds()):
        repo = _repo_of(r.checkpoint_ref) or _repo_of(r.base_ref)
        if repo:
            return repo
    raise ApiError(
        422,
        "repo",
        "repo: no policy repo known yet (no round names one); start the dashboard with --repo ORG/NAME",
        "--repo ORG/NAME",
    )


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))
    operator = Depends(ctx.require("operator"))

    @r.get("/algorithms", summary="the algorithms and presets a round can use, with their knobs")
    def algorithms(_: Principal = viewer) -> dict[str, Any]:
        return algorithm_catalogue()

    @r.get("/rounds", summary="rounds, newest first")
    def rounds(_: Principal = viewer) -> dict[str, Any]:
        return {"rounds": [round_summary(x) for x in reversed(ctx.res.db().rounds())]}

    @r.get("/rounds/{n}", summary="one round with its progress")
    def round_detail(n: RowId, _: Principal = viewer) -> dict[str, Any]:
        rec = _round(ctx, n)
        return round_summary(rec) | {
            "live_curve": ctx.curves.curve(rec),
            "config": shown_config(rec.config),
            "metrics": jsonable(rec.metrics),
            "data_snapshot": jsonable(rec.data),
        }

    @r.get(
        "/rounds/{n}/events",
        summary="Server-Sent Events: `progress` (the round's summary) until `done`",
        response_class=StreamingResponse,
    )
    async def round_events(n: RowId, request: Request, _: Principal = viewer) -> StreamingResponse:
        first = await run_in_threadpool(_round, ctx, n)

        async def stream() -> AsyncIterator[bytes]:
            last: str | None = None
            rec, quiet_since = first, time.monotonic()
            yield b"retry: 2000\n\n"
            while True:
                payload = round_summary(rec)
                if rec.status == "running":
                    payload["live_curve"] = await run_in_threadpool(ctx.curves.curve, rec)
                data = json.dumps(payload, separators=(",", ":"))
                if data != last:
                    yield f"event: progress\ndata: {data}\n\n".encode()
                    last, quiet_since = data, time.monotonic()
                elif time.monotonic() - quiet_since > SSE_KEEPALIVE_S:
                    yield b": keep-alive\n\n"
                    quiet_since = time.monotonic()
                if rec.status in FINISHED_STATUSES:
                    yield f"event: done\ndata: {json.dumps({'id': rec.id, 'status': rec.status})}\n\n".encode()
                    return
                await asyncio.sleep(SSE_POLL_S)
                if await request.is_disconnected():
                    return
                try:
                    rec = await run_in_threadpool(_round, ctx, n)
                except ApiError as e:  # the DB went away: say so and end the stream (the page retries)
                    yield f"event: error\ndata: {json.dumps(e.body()['detail'])}\n\n".encode()
                    return

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @r.post("/rounds", status_code=201, summary="queue a round for a round worker")
    def queue(body: RoundRequest, who: Principal = operator) -> dict[str, Any]:
        from vla_rl.rounds import queue_round

        cfg, n_episodes = build_round(ctx, body, who)
        db = ctx.res.db()
        rid = queue_round(cfg, db)
        log.info("round queued from the dashboard", extra={"round": rid, "by": who.name, "algo": cfg.algo})
        rec = db.round(rid)
        assert rec is not None
        return round_summary(rec) | {"episodes": n_episodes, "queued_by": who.name}

    @r.post("/rounds/{n}/cancel", summary="cancel a queued or running round")
    def cancel(n: RowId, who: Principal = operator) -> dict[str, Any]:
        _round(ctx, n)
        try:
            rec = ctx.res.db().cancel_round(n)
        except ValueError as e:
            raise ApiError(409, "round", str(e), "a queued or running round") from None
        return round_summary(rec) | {"cancelled_by": who.name}

    @r.post("/rounds/{n}/promote", summary="move the followed ref to the round's checkpoint")
    def promote(n: RowId, body: PromoteRequest | None = None, who: Principal = operator) -> dict[str, Any]:
        rec = _round(ctx, n)
        ref = movable_ref((body.ref if body and body.ref else None) or ctx.cfg.promote_ref)
        repo = _repo_of(rec.checkpoint_ref)
        if rec.status != "succeeded" or not rec.checkpoint_revision or repo is None:
            raise ApiError(
                409,
                "round",
                f"round {n} is {rec.status} and has no pushed checkpoint to promote",
                "a succeeded round that pushed its checkpoint",
            )
        before = hub.current_commit(repo, ref)
        to = hub.move(repo, ref, rec.checkpoint_revision)
        event = {
            "action": "promote",
            "ref": ref,
            "repo": repo,
            "from": before,
            "to": to,
            "by": who.name,
            "at": time.time(),
        }
        out = _record_event(ctx, rec, event, promoted=True)
        return {"round": n, **event, "promoted": out.promoted}

    @r.post("/refs/{ref}/rollback", summary="move the ref back to the commit it pointed at before")
    def rollback(ref: str, who: Principal = operator) -> dict[str, Any]:
        movable_ref(ref)
        repo = policy_repo(ctx)
        current = hub.current_commit(repo, ref)
        if current is None:
            raise ApiError(404, "ref", f"{repo} has no ref {ref!r}", "an existing tag or branch")
        db = ctx.res.db()
        rounds = db.rounds()
        events = sorted(
            ((e, x) for x in rounds for e in _events(x) if e.get("ref") == ref and e.get("repo") == repo),
            key=lambda p: p[0].get("at", 0),
        )
        stack: list[tuple[dict[str, Any], RoundRecord]] = []
        for e, x in events:
            if e["action"] == "promote":
                stack.append((e, x))
            elif stack and stack[-1][0]["to"] == e.get("from"):
                stack.pop()
        target, owner = None, None
        if stack and stack[-1][0]["to"] == current:
            target, owner = stack[-1][0].get("from"), stack[-1][1]
        else:  # a round that promoted itself (its gate passed): back to the base it was compared with
            for x in reversed(rounds):
                if x.promoted and x.checkpoint_revision == current and _repo_of(x.checkpoint_ref) == repo:
                    target, owner = x.base_revision, x
                    break
        if target is None or owner is None:
            raise ApiError(
                409,
                "ref",
                f"{ref} of {repo} points at {current[:12]}, and no promotion recorded in "
                "the rounds table says where it pointed before",
                "a ref moved by a promotion",
            )
        to = hub.move(repo, ref, target)
        event = {
            "action": "rollback",
            "ref": ref,
            "repo": repo,
            "from": current,
            "to": to,
            "by": who.name,
            "at": time.time(),
        }
        _record_event(ctx, owner, event, promoted=False)
        return {"round": owner.id, **event}

    @r.get("/refs", summary="the registry's refs and tags of the policy repo")
    def refs(_: Principal = viewer) -> dict[str, Any]:
        repo = policy_repo(ctx)
        return {"repo": repo, "promote_ref": ctx.cfg.promote_ref, "refs": hub.list_refs(repo)}

    return r

"""The fleet page's data: robots (the collector's GetStats merged with the DB's per-robot numbers),
per-revision success and intervention rates and their timeline, each policy server's GetInfo, and the
round lineage. Remote calls time out after ``RPC_TIMEOUT_S``; an unreachable one shows as ``ok: false``
with its error instead of failing the page."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any

from fastapi import APIRouter, Depends, Query

from vla_rl.core.secrets import env_secret
from vla_rl.dashboard.auth import Principal
from vla_rl.dashboard.context import Context

RPC_TIMEOUT_S = 1.0


def _rpc_error(e: Exception) -> str:
    """One line for a failed remote call: "CODE: details" for a gRPC error, else the exception's type
    and text."""
    import grpc
    from vla_rl_client.policy_client import PolicyError

    if isinstance(e, PolicyError):
        return str(e)  # "CODE: message"
    if isinstance(e, grpc.RpcError):
        code = e.code()  # type: ignore[attr-defined]
        return f"{code.name if code else 'UNKNOWN'}: {e.details()}"  # type: ignore[attr-defined]
    return f"{type(e).__name__}: {e}"


def server_info(address: str) -> dict[str, Any]:
    """GetInfo of one policy server, one row per served model (``ok: false`` + error when unreachable).
    One call, not retried: an unreachable server costs the page at most ``RPC_TIMEOUT_S``."""
    from vla_rl_client.policy_client import PolicyClient

    try:
        with PolicyClient(address, timeout_s=RPC_TIMEOUT_S, backoff=None) as client:
            resp = client.get_info()
    except Exception as e:  # PolicyError mostly; a bad address raises other things
        return {"address": address, "ok": False, "error": _rpc_error(e), "models": []}
    models = [
        {
            "model_id": m.model_id,
            "commit": m.commit,
            "ref": m.ref,
            "followed_ref": m.followed_ref,
            "previous_commit": m.previous_commit,
            "served": m.served,
            "requests_per_s": m.requests_per_s,
            "p50_ms": m.latency_p50_ms,
            "p99_ms": m.latency_p99_ms,
            "active_clients": m.active_clients,
            "device": m.device,
            "last_load_error": m.last_load_error,
        }
        for m in resp.models
    ]
    first = models[0] if models else {}
    return {
        "address": address,
        "ok": True,
        "error": None,
        "version": resp.server_version,
        **{
            k: first.get(k)
            for k in ("commit", "followed_ref", "served", "requests_per_s", "p50_ms", "p99_ms")
        },
        "models": models,
    }


def collector_stats(address: str) -> tuple[dict[str, dict[str, Any]], str | None]:
    """robot id -> the collector's counters, and the error when it could not be asked."""
    import grpc
    from vla_rl_client.proto import collector_pb2 as cpb
    from vla_rl_client.proto import collector_pb2_grpc as cpb_grpc

    token = env_secret("VLA_RL_COLLECTOR_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        with grpc.insecure_channel(address) as ch:
            resp = cpb_grpc.CollectorStub(ch).GetStats(
                cpb.StatsRequest(), timeout=RPC_TIMEOUT_S, metadata=metadata
            )
    except Exception as e:
        return {}, _rpc_error(e)
    return {
        r.robot_id: {
            "connected": r.connected,
            "frames_received": r.frames_received,
            "frames_committed": r.frames_committed,
            "frames_stored": r.frames_stored,
            "frames_rejected": r.frames_rejected,
            "episodes_closed": r.episodes_closed,
        }
        for r in resp.robots
    }, None


def lineage(ctx: Context) -> list[dict[str, Any]]:
    out = []
    for r in ctx.res.db().rounds():
        tag = r.checkpoint_ref.rpartition("@")[2] if r.checkpoint_ref and "@" in r.checkpoint_ref else None
        out.append(
            {
                "round": r.id,
                "algo": r.algo,
                "base_ref": r.base_ref,
                "base_revision": r.base_revision,
                "checkpoint_revision": r.checkpoint_revision,
                "tag": tag,
                "promoted": r.promoted,
                "status": r.status,
            }
        )
    return out


def make_router(ctx: Context) -> APIRouter:
    r = APIRouter()
    viewer = Depends(ctx.require("viewer"))

    @r.get("/fleet", summary="robots, windows, per-revision stats, servers, lineage")
    def fleet(
        bucket_s: float = Query(3600.0, ge=60.0, le=7 * 86400.0, description="timeline bucket (seconds)"),
        _: Principal = viewer,
    ) -> dict[str, Any]:
        db = ctx.res.db()
        now = time.time()
        with futures.ThreadPoolExecutor(max_workers=min(16, len(ctx.cfg.server) + 1)) as pool:
            servers = pool.map(server_info, ctx.cfg.server)
            stats_f = pool.submit(collector_stats, ctx.cfg.collector) if ctx.cfg.collector else None
            by_robot = {x.robot_id: x.to_dict() for x in db.robot_stats(now)}
            revisions = [x.to_dict() for x in db.revision_stats()]
            timeline = [x.to_dict() for x in db.revision_timeline(bucket_s)]
            servers_list = list(servers)
            stats, stats_error = stats_f.result() if stats_f else ({}, None)
        robots = []
        for rid in sorted(set(by_robot) | set(stats)):
            a = by_robot.get(rid, {})
            s = stats.get(rid, {})
            robots.append(
                {
                    "robot_id": rid,
                    "connected": s.get("connected", False),
                    "frames_received": s.get("frames_received"),
                    "frames_stored": s.get("frames_stored"),
                    "episodes": a.get("episodes", 0),
                    "episodes_hour": a.get("episodes_hour", 0),
                    "success_hour": a.get("success_hour"),
                    "episodes_day": a.get("episodes_day", 0),
                    "success_day": a.get("success_day"),
                    "intervention_rate": a.get("intervention_rate"),
                    "revision": a.get("revision"),
                }
            )
        return {
            "robots": robots,
            "collector": {
                "address": ctx.cfg.collector,
                "ok": ctx.cfg.collector is not None and stats_error is None,
                "error": stats_error,
            },
            "revisions": revisions,
            "timeline": timeline,
            "servers": servers_list,
            "lineage": lineage(ctx),
            "now": now,
        }

    return r

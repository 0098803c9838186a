"""Large files: the git-LFS batch API (upload only), the signed upload URLs it hands out, and verify.

The client sends no ``Authorization`` header on the upload PUTs (it treats them as pre-signed storage URLs),
so the batch answer signs each URL with an HMAC of ``oid:size:expires`` under the server's secret. Xet, the
client's other transfer protocol, is refused with advice (it needs a CAS service this server does not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.naming import SHA256_HEX
from vla_rl.hub.routes.auth import WritableLfsRepo
from vla_rl.hub.routes.bodies import base_url, parse_uint, read_json
from vla_rl.hub.routes.errors import NotImplementedHere
from vla_rl.hub.routes.state import Hub, HubDep
from vla_rl.hub.storage import BadRequest, HubError, RepoNotFound

router = APIRouter()

UPLOAD_URL_TTL_S = 24 * 3600
WRITE_BUFFER = 8 * 1024 * 1024


@router.api_route("/api/models/{org}/{name}/xet-write-token/{rev}", methods=["GET", "POST"])
@router.api_route("/api/models/{org}/{name}/xet-read-token/{rev}", methods=["GET", "POST"])
def xet_token(org: str, name: str, rev: str) -> None:
    raise NotImplementedHere(
        "this server does not speak Xet: set HF_HUB_DISABLE_XET=1 before importing huggingface_hub "
        "(vla_rl.hub.registry.configure_hub does it)"
    )


def _sign(hub: Hub, oid: str, size: int, expires: int) -> str:
    msg = f"{oid}:{size}:{expires}".encode()
    return hmac.new(hub.settings.secret, msg, hashlib.sha256).hexdigest()


def _valid_object(oid: Any, size: Any) -> bool:
    return isinstance(oid, str) and bool(SHA256_HEX.fullmatch(oid)) and isinstance(size, int) and size >= 0


@router.post("/{org}/{repo_git}/info/lfs/objects/batch")
async def lfs_batch(request: Request, hub: HubDep, repo_id: WritableLfsRepo) -> Response:
    body = await read_json(request)
    if not isinstance(body, dict) or body.get("operation") != "upload":
        raise BadRequest("only the 'upload' operation of the LFS batch API is supported")
    if not isinstance(body.get("objects"), list):
        raise BadRequest("expected 'objects': [{'oid', 'size'}, ...]")
    return JSONResponse(
        await run_in_threadpool(_batch_answer, hub, repo_id, body["objects"], base_url(request)),
        media_type="application/vnd.git-lfs+json",
    )


def _batch_answer(hub: Hub, repo_id: str, objects_in: list[Any], base: str) -> dict[str, Any]:
    if not hub.storage.repo_exists(repo_id):
        raise RepoNotFound.of(repo_id)
    expires = int(time.time()) + UPLOAD_URL_TTL_S
    objects = []
    for obj in objects_in:
        oid = obj.get("oid") if isinstance(obj, dict) else None
        size = obj.get("size") if isinstance(obj, dict) else None
        if not _valid_object(oid, size):
            objects.append(
                {
                    "oid": str(oid),
                    "size": size if isinstance(size, int) else 0,
                    "error": {"code": 422, "message": "oid must be 64 lowercase hex, size an int >= 0"},
                }
            )
            continue
        item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
        if hub.storage.blob_size(oid) != size:
            sig = _sign(hub, oid, size, expires)
            item["actions"] = {
                "upload": {
                    "href": f"{base}/api/lfs/objects/{oid}?size={size}&expires={expires}&sig={sig}",
                    "expires_in": UPLOAD_URL_TTL_S,
                },
                "verify": {"href": f"{base}/{repo_id}.git/info/lfs/objects/verify", "expires_in": 3600},
            }
        objects.append(item)
    return {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}


@router.put("/api/lfs/objects/{oid}")
async def lfs_upload(request: Request, hub: HubDep, oid: str) -> dict[str, Any]:
    q = request.query_params
    if not SHA256_HEX.fullmatch(oid):
        raise BadRequest("malformed upload URL: ask the LFS batch endpoint for one")
    size, expires = parse_uint(q.get("size", ""), "size"), parse_uint(q.get("expires", ""), "expires")
    sig = q.get("sig", "")
    if not hmac.compare_digest(sig.encode(), _sign(hub, oid, size, expires).encode()):
        raise HubError("upload URL signature is invalid", status=403)
    if expires < time.time():
        raise HubError("upload URL has expired: ask the LFS batch endpoint for a new one", status=403)
    declared = request.headers.get("content-length")
    if declared is not None and parse_uint(declared, "Content-Length") != size:
        raise BadRequest(f"Content-Length {declared} does not match the announced size {size}")
    writer = await run_in_threadpool(hub.storage.blob_writer, oid, size)
    # Double-buffered: one buffer is hashed and written in a worker thread while the next one is received,
    # so disk and hashing overlap the network instead of adding to it.
    pending: asyncio.Future[None] | None = None
    try:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) >= WRITE_BUFFER:
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(run_in_threadpool(writer.write, buf))
                buf = bytearray()
        if pending is not None:
            await pending
            pending = None
        if buf:
            await run_in_threadpool(writer.write, buf)
        await run_in_threadpool(writer.finish)
    except BaseException:
        if pending is not None:  # let the worker finish with the file before it is removed
            with contextlib.suppress(BaseException):
                await asyncio.shield(pending)
        writer.abort()
        raise
    return {"oid": oid, "size": size}


@router.post("/{org}/{repo_git}/info/lfs/objects/verify")
async def lfs_verify(request: Request, hub: HubDep, repo_id: WritableLfsRepo) -> dict[str, Any]:
    body = await read_json(request)
    oid, size = (body.get("oid"), body.get("size")) if isinstance(body, dict) else (None, None)
    if not isinstance(oid, str) or not SHA256_HEX.fullmatch(oid) or not isinstance(size, int):
        raise BadRequest("expected {'oid': <sha256 hex>, 'size': <int>}")
    stored = await run_in_threadpool(hub.storage.blob_size, oid)
    if stored is None:
        raise HubError(f"object {oid} was not uploaded", status=404)
    if stored != size:
        raise HubError(f"object {oid} has {stored} bytes, not {size}", status=422)
    return {"oid": oid, "size": size}

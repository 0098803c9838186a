"""Repos: create, delete, and model info (at ``main`` or at a revision)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.routes.auth import ReadableRepo, WriteAccess, repo_id_of
from vla_rl.hub.routes.bodies import base_url, read_json, truthy
from vla_rl.hub.routes.state import Hub, HubDep
from vla_rl.hub.storage import BadRequest

log = logging.getLogger("vla_rl.hub.server")

router = APIRouter()

# Namespaces that would make the Hub's URL scheme ambiguous (``/api/...``, ``/datasets/...``).
RESERVED_NAMESPACES = frozenset({"api", "datasets", "spaces", "models", "buckets", "kernels", "docs"})


@router.post("/api/repos/create", dependencies=[WriteAccess])
async def create_repo(request: Request, hub: HubDep) -> Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    repo_type = body.get("type") or "model"
    if repo_type != "model":
        raise BadRequest(f"only model repos are supported by this server, not {repo_type!r}")
    org, name = _org_and_name(body)
    repo_id = repo_id_of(org, name)
    if str(org).lower() in RESERVED_NAMESPACES:
        raise BadRequest(f"namespace {org!r} is reserved")
    private = bool(body.get("private")) or body.get("visibility") == "private"
    url = f"{base_url(request)}/{repo_id}"
    created = await run_in_threadpool(
        hub.storage.create_repo, repo_id, private=private, author=hub.settings.user
    )
    if not created:
        return JSONResponse({"error": "You already created this model repo", "url": url}, status_code=409)
    log.info("created repo", extra={"repo": repo_id, "private": private})
    return JSONResponse({"url": url, "name": repo_id, "id": repo_id})


@router.delete("/api/repos/delete", dependencies=[WriteAccess])
async def delete_repo(request: Request, hub: HubDep) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict) or (body.get("type") or "model") != "model":
        raise BadRequest("expected {'name': ..., 'organization': ..., 'type': 'model'}")
    repo_id = repo_id_of(*_org_and_name(body))
    await run_in_threadpool(hub.storage.delete_repo, repo_id)
    log.info("deleted repo", extra={"repo": repo_id})
    return {}


def _org_and_name(body: dict[str, Any]) -> tuple[str, str]:
    """``(organization, name)`` of a create/delete body: ``name`` is 'org/name', or 'name' plus 'organization'."""
    name, org = body.get("name"), body.get("organization")
    if isinstance(name, str) and "/" in name and org is None:
        org, name = name.split("/", 1)
    if not isinstance(name, str) or not isinstance(org, str) or not org:
        raise BadRequest("expected the repo id as 'name': 'org/name' (or 'name' plus 'organization' strings)")
    return org, name


@router.get("/api/models/{org}/{name}")
def get_model(request: Request, hub: HubDep, repo_id: ReadableRepo, org: str) -> dict[str, Any]:
    return _model_info(request, hub, repo_id, org, "main")


@router.get("/api/models/{org}/{name}/revision/{rev}")
def get_model_revision(
    request: Request, hub: HubDep, repo_id: ReadableRepo, org: str, rev: str
) -> dict[str, Any]:
    return _model_info(request, hub, repo_id, org, rev)


def _model_info(request: Request, hub: Hub, repo_id: str, org: str, rev: str) -> dict[str, Any]:
    storage = hub.storage
    meta = storage.repo_meta(repo_id)
    sha = storage.resolve(repo_id, rev)
    commit = storage.commit(repo_id, sha)
    blobs = truthy(request.query_params.get("blobs"))
    siblings = []
    for path in sorted(commit.files):
        sib: dict[str, Any] = {"rfilename": path}
        if blobs:
            e = commit.files[path]
            sib.update(size=e.size, blobId=e.blob_id)
            if e.lfs:
                sib["lfs"] = {"size": e.size, "sha256": e.sha256, "pointerSize": e.pointer_size}
        siblings.append(sib)
    return {
        "_id": hashlib.sha1(repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": org,
        "sha": sha,
        "lastModified": commit.date,
        "createdAt": meta["created_at"],
        "private": bool(meta.get("private")),
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
        "usedStorage": sum(e.size for e in commit.files.values()),
    }

"""Refs: list branches and tags, create and delete them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.routes.auth import ReadableRepo, WritableRepo
from vla_rl.hub.routes.bodies import read_json
from vla_rl.hub.routes.state import HubDep
from vla_rl.hub.storage import BadRequest

log = logging.getLogger("vla_rl.hub.server")

router = APIRouter()


def _ref_json(kind: str, name: str, sha: str) -> dict[str, str]:
    return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": sha}


@router.get("/api/models/{org}/{name}/refs")
def list_refs(hub: HubDep, repo_id: ReadableRepo) -> dict[str, Any]:
    refs = hub.storage.refs(repo_id)
    return {
        "branches": [_ref_json("heads", n, s) for n, s in sorted(refs.branches.items())],
        "tags": [_ref_json("tags", n, s) for n, s in sorted(refs.tags.items())],
        "converts": [],
        "pullRequests": [],
    }


@router.post("/api/models/{org}/{name}/tag/{rev}")
async def create_tag(request: Request, hub: HubDep, repo_id: WritableRepo, rev: str) -> dict[str, Any]:
    body = await read_json(request)
    tag = body.get("tag") if isinstance(body, dict) else None
    if not isinstance(tag, str):
        raise BadRequest("expected {'tag': <name>}")
    move = body.get("move", False)  # our extension: move an existing tag atomically (promotion)
    if not isinstance(move, bool):
        raise BadRequest("move: expected true or false")
    sha = await run_in_threadpool(hub.storage.create_tag, repo_id, tag, rev, move)
    log.info("tag", extra={"repo": repo_id, "tag": tag, "commit": sha})
    return _ref_json("tags", tag, sha)


@router.delete("/api/models/{org}/{name}/tag/{tag}")
def delete_tag(hub: HubDep, repo_id: WritableRepo, tag: str) -> dict[str, Any]:
    hub.storage.delete_tag(repo_id, tag)
    log.info("deleted tag", extra={"repo": repo_id, "tag": tag})
    return {}


@router.post("/api/models/{org}/{name}/branch/{branch}")
async def create_branch(request: Request, hub: HubDep, repo_id: WritableRepo, branch: str) -> dict[str, Any]:
    body = await read_json(request)
    start = body.get("startingPoint") if isinstance(body, dict) else None
    if start is not None and not isinstance(start, str):
        raise BadRequest("'startingPoint' must be a revision string")
    sha = await run_in_threadpool(hub.storage.create_branch, repo_id, branch, start)
    log.info("branch", extra={"repo": repo_id, "branch": branch, "commit": sha})
    return _ref_json("heads", branch, sha)


@router.delete("/api/models/{org}/{name}/branch/{branch}")
def delete_branch(hub: HubDep, repo_id: WritableRepo, branch: str) -> dict[str, Any]:
    hub.storage.delete_branch(repo_id, branch)
    log.info("deleted branch", extra={"repo": repo_id, "branch": branch})
    return {}

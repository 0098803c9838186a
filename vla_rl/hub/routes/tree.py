"""Listing a revision: the tree (one folder or recursive) and paths-info for given paths."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.routes.auth import ReadableRepo
from vla_rl.hub.routes.bodies import loads, page_of, page_response, read_body, truthy
from vla_rl.hub.routes.state import HubDep
from vla_rl.hub.storage import BadRequest, Commit, EntryNotFound, FileEntry, HubStorage, check_path

router = APIRouter()

TREE_PAGE = 1000
TREE_PAGE_EXPANDED = 50


@router.get("/api/models/{org}/{name}/tree/{rev}")
def tree_root(request: Request, hub: HubDep, repo_id: ReadableRepo, rev: str) -> Response:
    return _tree(request, hub.storage, repo_id, rev, "")


@router.get("/api/models/{org}/{name}/tree/{rev}/{path:path}")
def tree(request: Request, hub: HubDep, repo_id: ReadableRepo, rev: str, path: str) -> Response:
    return _tree(request, hub.storage, repo_id, rev, path)


def _tree(request: Request, storage: HubStorage, repo_id: str, rev: str, path: str) -> Response:
    path = path.strip("/")
    if path:
        check_path(path)
    sha = storage.resolve(repo_id, rev)
    files = storage.commit(repo_id, sha).files
    prefix = path + "/" if path else ""
    under = [p for p in files if p.startswith(prefix)]
    if path and not under:
        raise EntryNotFound(f"{path} does not exist (or is not a folder) at {rev}")
    folders = _folders_of(p[len(prefix) :] for p in under)
    if truthy(request.query_params.get("recursive")):
        paths = sorted(prefix + f for f in folders) + sorted(under)
    else:
        top_files = [p for p in under if "/" not in p[len(prefix) :]]
        paths = sorted(prefix + f for f in folders if "/" not in f) + sorted(top_files)
    expand = truthy(request.query_params.get("expand"))
    # Only the page is described: with expand, each entry's last commit is a walk of the history.
    size = TREE_PAGE_EXPANDED if expand else TREE_PAGE
    page = page_of(request)
    window = paths[page * size : (page + 1) * size]
    more = (page + 1) * size < len(paths)
    return page_response(request, _describe(storage, repo_id, sha, window, expand), page, more)


@router.post("/api/models/{org}/{name}/paths-info/{rev}")
async def paths_info(request: Request, hub: HubDep, repo_id: ReadableRepo, rev: str) -> list[dict[str, Any]]:
    raw = await read_body(request)
    is_json = request.headers.get("content-type", "").startswith("application/json")
    storage = hub.storage

    def work() -> list[dict[str, Any]]:
        if is_json:
            body = loads(raw or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("expected a JSON object {'paths': [...], 'expand': bool}")
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:  # the client sends a form: paths=a&paths=b&expand=False
            form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
            paths, expand = form.get("paths", []), truthy((form.get("expand") or ["false"])[0])
        if not isinstance(paths, list):
            raise BadRequest("'paths' must be a list of paths")
        paths = [check_path(p.strip("/")) if isinstance(p, str) else check_path(p) for p in paths]
        sha = storage.resolve(repo_id, rev)
        files = storage.commit(repo_id, sha).files
        folders = _folders_of(files)
        present = [p for p in dict.fromkeys(paths) if p in files or p in folders]
        return _describe(storage, repo_id, sha, present, expand)

    return await run_in_threadpool(work)


def _describe(
    storage: HubStorage, repo_id: str, sha: str, paths: list[str], expand: bool
) -> list[dict[str, Any]]:
    """Tree entries of ``paths`` (files or folders) at commit ``sha``; ``expand`` adds each one's last commit."""
    commit = storage.commit(repo_id, sha)
    last = storage.last_commits(repo_id, sha, paths) if expand else {}
    return [
        _file_json(p, commit.files[p], last.get(p))
        if p in commit.files
        else _folder_json(p, commit.files, last.get(p))
        for p in paths
    ]


def _last_commit_json(last: Commit) -> dict[str, Any]:
    return {"id": last.id, "title": last.summary, "date": last.date}


def _file_json(path: str, e: FileEntry, last: Commit | None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "file", "oid": e.blob_id, "size": e.size, "path": path}
    if e.lfs:
        out["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": e.pointer_size}
    if last is not None:
        out["lastCommit"] = _last_commit_json(last)
    return out


def _folder_json(path: str, files: dict[str, FileEntry], last: Commit | None) -> dict[str, Any]:
    prefix = path + "/"
    listing = sorted((p[len(prefix) :], e.blob_id) for p, e in files.items() if p.startswith(prefix))
    tree_id = hashlib.sha1(json.dumps(listing).encode(), usedforsecurity=False).hexdigest()
    out: dict[str, Any] = {"type": "directory", "oid": tree_id, "path": path}
    if last is not None:
        out["lastCommit"] = _last_commit_json(last)
    return out


def _folders_of(files: Iterable[str]) -> set[str]:
    """Every folder that holds one of ``files`` (paths relative to the same root), at any depth."""
    out: set[str] = set()
    for p in files:
        parts = p.split("/")
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]))
    return out

"""Commits: the history of a revision, the preupload check, and the NDJSON commit itself."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.naming import COMMIT_SHA
from vla_rl.hub.routes.auth import ReadableRepo, WritableRepo
from vla_rl.hub.routes.bodies import base_url, paginated, read_body, read_json, truthy
from vla_rl.hub.routes.state import HubDep
from vla_rl.hub.storage import (
    LFS_THRESHOLD,
    AddFile,
    BadRequest,
    Commit,
    DeleteFile,
    DeleteFolder,
    FileEntry,
    HubError,
    HubStorage,
    Operation,
    check_path,
    git_blob_sha1,
    lfs_pointer,
    wants_lfs,
)

log = logging.getLogger("vla_rl.hub.server")

router = APIRouter()

COMMITS_PAGE = 50
# A commit carries regular files (each <= 10 MiB, base64-encoded) inline; LFS contents come separately.
MAX_COMMIT_BYTES = 1024 * 1024 * 1024


def _no_pull_requests(request: Request) -> None:
    if truthy(request.query_params.get("create_pr")):
        raise BadRequest("pull requests are not supported by this server")


@router.get("/api/models/{org}/{name}/commits/{rev}")
def list_commits(request: Request, hub: HubDep, repo_id: ReadableRepo, rev: str) -> Response:
    sha = hub.storage.resolve(repo_id, rev)
    items = [
        {
            "id": c.id,
            "title": c.summary,
            "message": c.description,
            "authors": [{"user": c.author}],
            "date": c.date,
            "parents": [c.parent] if c.parent else [],
        }
        for c in hub.storage.history(repo_id, sha)
    ]
    return paginated(request, items, COMMITS_PAGE)


@router.post("/api/models/{org}/{name}/preupload/{rev}")
async def preupload(request: Request, hub: HubDep, repo_id: WritableRepo, rev: str) -> dict[str, Any]:
    _no_pull_requests(request)
    body = await read_json(request)
    files_in = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files_in, list):
        raise BadRequest("expected {'files': [{'path', 'size', 'sample'}, ...]}")
    sha = await run_in_threadpool(hub.storage.resolve, repo_id, rev)
    current = (await run_in_threadpool(hub.storage.commit, repo_id, sha)).files
    out = []
    for f in files_in:
        if not isinstance(f, dict) or not isinstance(f.get("size"), int) or f["size"] < 0:
            raise BadRequest("each file needs 'path' (str), 'size' (int >= 0) and 'sample' (base64)")
        path = check_path(f.get("path"))
        try:
            sample = base64.b64decode(f.get("sample") or "", validate=True)[:512]
        except (binascii.Error, ValueError):
            raise BadRequest(f"'sample' of {path!r} is not valid base64") from None
        existing = current.get(path)
        oid = None if existing is None else (existing.sha256 if existing.lfs else existing.blob_id)
        mode = "lfs" if wants_lfs(path, f["size"], sample) else "regular"
        out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
    return {"files": out, "commitOid": sha}


@router.post("/api/models/{org}/{name}/commit/{rev}")
async def commit(request: Request, hub: HubDep, repo_id: WritableRepo, rev: str) -> dict[str, Any]:
    _no_pull_requests(request)
    header, items = _parse_ndjson(await read_body(request, MAX_COMMIT_BYTES))
    summary = header.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        raise BadRequest("the commit header needs a non-empty 'summary'")
    description = header.get("description") or ""
    parent = header.get("parentCommit")
    if parent is not None and (not isinstance(parent, str) or not COMMIT_SHA.fullmatch(parent)):
        raise BadRequest("'parentCommit' must be a 40-hex commit sha")

    def work() -> Commit:
        return hub.storage.apply_commit(
            repo_id,
            rev,
            _operations(hub.storage, items),
            summary=summary.strip(),
            description=str(description),
            parent_commit=parent,
            author=hub.settings.user,
        )

    c = await run_in_threadpool(work)
    log.info("commit", extra={"repo": repo_id, "branch": rev, "commit": c.id, "operations": len(items)})
    return {
        "success": True,
        "commitOid": c.id,
        "commitUrl": f"{base_url(request)}/{repo_id}/commit/{c.id}",
        "hookOutput": "",
        "pullRequestUrl": None,
    }


def _parse_ndjson(raw: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header's value and the operation lines of a commit payload."""
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    del raw
    if not lines:
        raise BadRequest("empty commit payload: expected NDJSON starting with a 'header' line")
    try:
        items = [json.loads(ln) for ln in lines]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"commit payload is not valid NDJSON: {e}") from None
    del lines
    if not all(isinstance(i, dict) and isinstance(i.get("value"), dict) for i in items):
        raise BadRequest("each NDJSON line must be {'key': ..., 'value': {...}}")
    if items[0].get("key") != "header":
        raise BadRequest("the first NDJSON line must be the 'header'")
    return items[0]["value"], items[1:]


def _operations(storage: HubStorage, items: list[dict[str, Any]]) -> list[Operation]:
    """The commit's operations; inline file contents are stored on the way (this does disk I/O)."""
    ops: list[Operation] = []
    for item in items:
        key, value = item.get("key"), item["value"]
        raw_path = value.get("path")
        if key == "deletedFolder" and isinstance(raw_path, str) and raw_path.endswith("/"):
            raw_path = raw_path[:-1]  # the client marks folders with a trailing '/'
        path = check_path(raw_path)
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise BadRequest(f"{path!r}: only base64 file content is supported")
            try:
                data = base64.b64decode(value.get("content") or "", validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(f"{path!r}: content is not valid base64") from None
            if len(data) > LFS_THRESHOLD:
                raise BadRequest(f"{path!r}: files over {LFS_THRESHOLD} bytes must be uploaded with LFS")
            sha = storage.put_bytes(data)
            ops.append(AddFile(path, FileEntry(sha, len(data), False, git_blob_sha1(data))))
        elif key == "lfsFile":
            oid = value.get("oid")
            if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str):
                raise BadRequest(f"{path!r}: expected 'algo': 'sha256' and an 'oid'")
            stored = storage.blob_size(oid)
            if stored is None:
                raise HubError(f"{path!r}: LFS object {oid} has not been uploaded", status=422)
            if value.get("size") is not None and value["size"] != stored:
                raise BadRequest(f"{path!r}: size {value['size']} does not match the stored {stored}")
            blob_id = git_blob_sha1(lfs_pointer(oid, stored))
            ops.append(AddFile(path, FileEntry(oid, stored, True, blob_id)))
        elif key == "deletedFile":
            ops.append(DeleteFile(path))
        elif key == "deletedFolder":
            ops.append(DeleteFolder(path))
        else:
            raise BadRequest(f"unsupported commit operation {key!r}")
    return ops

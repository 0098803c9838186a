"""Commits: the history of a revision, the preupload check, and the NDJSON commit itself."""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.limits import Limits
from vla_rl.hub.naming import COMMIT_SHA
from vla_rl.hub.routes.auth import ReadableRepo, WritableRepo
from vla_rl.hub.routes.bodies import (
    base_url,
    loads,
    page_of,
    page_response,
    read_json,
    stream_lines,
    too_large,
    truthy,
)
from vla_rl.hub.routes.state import HubDep
from vla_rl.hub.storage import (
    AddFile,
    BadRequest,
    BlobWriter,
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
COMMIT_BATCH_BYTES = 1024 * 1024
MAX_MESSAGE_CHARS = 64 * 1024


def _no_pull_requests(request: Request) -> None:
    if truthy(request.query_params.get("create_pr")):
        raise BadRequest("pull requests are not supported by this server")


@router.get("/api/models/{org}/{name}/commits/{rev}")
def list_commits(request: Request, hub: HubDep, repo_id: ReadableRepo, rev: str) -> Response:
    """Page ``p`` of the history of ``rev``. The ``Link`` to the next page carries a ``cursor`` (the first
    commit of that page), so following the links reads each commit once: a page costs its own size, however
    deep it is. A bare ``p`` without a cursor walks from the head (bounded by the history's length)."""
    storage = hub.storage
    head = storage.resolve(repo_id, rev)
    page = page_of(request)
    cursor = request.query_params.get("cursor")
    if cursor is not None:
        if not COMMIT_SHA.fullmatch(cursor):
            raise BadRequest("'cursor' must be a 40-hex commit sha (take it from the Link header)")
        walk, skip = storage.history(repo_id, cursor), 0
    else:
        walk, skip = storage.history(repo_id, head), page * COMMITS_PAGE
    for _ in itertools.islice(walk, skip):
        pass
    chunk = list(itertools.islice(walk, COMMITS_PAGE + 1))
    more = len(chunk) > COMMITS_PAGE
    items = [
        {
            "id": c.id,
            "title": c.summary,
            "message": c.description,
            "authors": [{"user": c.author}],
            "date": c.date,
            "parents": [c.parent] if c.parent else [],
        }
        for c in chunk[:COMMITS_PAGE]
    ]
    return page_response(request, items, page, more, **({"cursor": chunk[-1].id} if more else {}))


@router.post("/api/models/{org}/{name}/preupload/{rev}")
async def preupload(request: Request, hub: HubDep, repo_id: WritableRepo, rev: str) -> dict[str, Any]:
    _no_pull_requests(request)
    body = await read_json(request)
    files_in = body.get("files") if isinstance(body, dict) else None
    inline_max = hub.settings.limits.max_inline_file_bytes  # larger files are sent to LFS, so commits fit
    if not isinstance(files_in, list):
        raise BadRequest("expected {'files': [{'path', 'size', 'sample'}, ...]}")

    def work() -> dict[str, Any]:
        sha = hub.storage.resolve(repo_id, rev)
        current = hub.storage.commit(repo_id, sha).files
        out = []
        for f in files_in:
            if not isinstance(f, dict) or type(f.get("size")) is not int or f["size"] < 0:
                raise BadRequest("each file needs 'path' (str), 'size' (int >= 0) and 'sample' (base64)")
            path = check_path(f.get("path"))
            sample = _b64decode(f.get("sample") or "", f"'sample' of {path!r}")[:512]
            existing = current.get(path)
            oid = None if existing is None else (existing.sha256 if existing.lfs else existing.blob_id)
            mode = "lfs" if wants_lfs(path, f["size"], sample, inline_max) else "regular"
            out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return {"files": out, "commitOid": sha}

    return await run_in_threadpool(work)


@router.post("/api/models/{org}/{name}/commit/{rev}")
async def commit(request: Request, hub: HubDep, repo_id: WritableRepo, rev: str) -> dict[str, Any]:
    """The NDJSON commit, parsed as it arrives: about 1 MiB of lines (or one long line) is held at a time, and
    parsing, decoding, hashing and disk writes run in the threadpool. Inline files are staged in ``tmp/`` and
    become blobs only once the whole payload parsed, so a payload refused while parsing leaves nothing; one
    refused when applied (stale parent, missing file) leaves at most content-addressed blobs, never a commit
    or a ref."""
    _no_pull_requests(request)
    storage, limits = hub.storage, hub.settings.limits
    await run_in_threadpool(storage.resolve, repo_id, rev)  # a missing repo or revision fails before the body
    header: dict[str, Any] | None = None
    ops: list[Operation] = []
    staged: list[BlobWriter] = []
    lines = stream_lines(
        request,
        limits.max_commit_bytes,
        "max_commit_bytes",
        limits.max_commit_line_bytes,
        "max_inline_file_bytes",
    )
    batch: list[bytes] = []
    batch_bytes = 0

    def parse(lines: list[bytes]) -> None:
        nonlocal header
        for line in lines:
            if header is None:
                header = _header(line)
            elif len(ops) >= limits.max_commit_operations:
                what = "commit with more than {limit} operations"
                raise too_large(limits.max_commit_operations, "max_commit_operations", what)
            else:
                ops.append(_operation(storage, line, limits, staged))

    try:
        # Lines go to the threadpool in batches (one hop per ~1 MiB, not per line), so many small operations
        # cost little and a big one is parsed alone; the batch is all the body that is held at a time.
        async for line in lines:
            batch.append(line)
            batch_bytes += len(line)
            if batch_bytes >= COMMIT_BATCH_BYTES:
                await run_in_threadpool(parse, batch)
                batch, batch_bytes = [], 0
        await run_in_threadpool(parse, batch)
        del batch
        if header is None:
            raise BadRequest("empty commit payload: expected NDJSON starting with a 'header' line")
        summary, description, parent = _header_fields(header)

        def work() -> Commit:
            for writer in staged:
                writer.publish()
            return storage.apply_commit(
                repo_id,
                rev,
                ops,
                summary=summary,
                description=description,
                parent_commit=parent,
                author=hub.settings.user,
            )

        c = await run_in_threadpool(work)
    finally:
        if staged:
            await run_in_threadpool(_discard, staged)
    log.info("commit", extra={"repo": repo_id, "branch": rev, "commit": c.id, "operations": len(ops)})
    return {
        "success": True,
        "commitOid": c.id,
        "commitUrl": f"{base_url(request)}/{repo_id}/commit/{c.id}",
        "hookOutput": "",
        "pullRequestUrl": None,
    }


def _discard(staged: list[BlobWriter]) -> None:
    for writer in staged:
        writer.abort()


def _b64decode(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{what} is not valid base64") from None


def _item(line: bytes) -> tuple[Any, dict[str, Any]]:
    """One NDJSON line: its ``key`` and ``value``."""
    item = loads(line, "commit payload line")
    if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
        raise BadRequest("each NDJSON line must be {'key': ..., 'value': {...}}")
    return item.get("key"), item["value"]


def _header(line: bytes) -> dict[str, Any]:
    key, value = _item(line)
    if key != "header":
        raise BadRequest("the first NDJSON line must be the 'header'")
    return value


def _header_fields(header: dict[str, Any]) -> tuple[str, str, str | None]:
    summary = header.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        raise BadRequest("the commit header needs a non-empty 'summary'")
    description = str(header.get("description") or "")
    if len(summary) + len(description) > MAX_MESSAGE_CHARS:
        # Every history page repeats the message: a multi-megabyte one would make each page that large.
        raise BadRequest(f"the commit message is over {MAX_MESSAGE_CHARS} characters")
    parent = header.get("parentCommit")
    if parent is not None and (not isinstance(parent, str) or not COMMIT_SHA.fullmatch(parent)):
        raise BadRequest("'parentCommit' must be a 40-hex commit sha")
    return summary.strip(), description, parent


def _operation(storage: HubStorage, line: bytes, limits: Limits, staged: list[BlobWriter]) -> Operation:
    """One operation line of a commit; an inline file's content is staged on the way (disk I/O)."""
    key, value = _item(line)
    del line
    raw_path = value.get("path")
    if key == "deletedFolder" and isinstance(raw_path, str) and raw_path.endswith("/"):
        raw_path = raw_path[:-1]  # the client marks folders with a trailing '/'
    path = check_path(raw_path)
    if key == "file":
        if value.get("encoding", "base64") != "base64":
            raise BadRequest(f"{path!r}: only base64 file content is supported")
        content = value.get("content") or ""
        if isinstance(content, str) and len(content) > 4 * -(-limits.max_inline_file_bytes // 3):
            raise too_large(limits.max_inline_file_bytes, "max_inline_file_bytes")
        data = _b64decode(content, f"{path!r}: content")
        del value, content
        if len(data) > limits.max_inline_file_bytes:
            raise too_large(limits.max_inline_file_bytes, "max_inline_file_bytes")
        writer = storage.stage_bytes(data)
        staged.append(writer)
        assert writer.digest is not None
        return AddFile(path, FileEntry(writer.digest, len(data), False, git_blob_sha1(data)))
    if key == "lfsFile":
        oid, size = value.get("oid"), value.get("size")
        if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str):
            raise BadRequest(f"{path!r}: expected 'algo': 'sha256' and an 'oid'")
        stored = storage.blob_size(oid)
        if stored is None:
            raise HubError(f"{path!r}: LFS object {oid} has not been uploaded", status=422)
        if size is not None and size != stored:
            raise BadRequest(f"{path!r}: size {size!r} does not match the stored {stored}")
        return AddFile(path, FileEntry(oid, stored, True, git_blob_sha1(lfs_pointer(oid, stored))))
    if key == "deletedFile":
        return DeleteFile(path)
    if key == "deletedFolder":
        return DeleteFolder(path)
    raise BadRequest(f"unsupported commit operation {str(key)[:100]!r}")

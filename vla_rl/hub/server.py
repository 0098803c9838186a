"""A small Hugging Face Hub-compatible server, so the real ``huggingface_hub`` client can push and pull
checkpoints on one machine (the real Hub is not always reachable, and no installable server does writes).

It implements exactly the routes the client (1.x, classic LFS transfer) uses for a round trip: create repo,
model info, preupload, the LFS batch API with upload URLs pointing back here, the NDJSON commit, tags,
branches, refs, commits, tree, paths-info and ``resolve`` downloads with the headers the client checks
(``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``/``X-Linked-Size``, ranges). Payload shapes were taken from the
client's own source. Storage lives in :mod:`vla_rl.hub.storage`.

Clients must disable Xet (``HF_HUB_DISABLE_XET=1``, see :func:`vla_rl.hub.registry.configure_hub`): Xet
uploads need a CAS service this server does not have (``/xet-write-token`` answers 501 with that advice).

Security model: one shared token. When the server has one, every write (create, preupload, LFS batch and
verify, commit, tag, branch, delete) needs ``Authorization: Bearer <token>``; reads are public unless
``private``. LFS upload URLs carry an HMAC signature instead of the token because the client sends no
``Authorization`` header on those PUTs (it treats them as pre-signed storage URLs). Repo ids and every file
path are validated before use, and file paths never touch the filesystem (contents are stored by hash).
Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from vla_rl.hub.naming import COMMIT_SHA, SHA256_HEX, validate_repo_id
from vla_rl.hub.storage import (
    LFS_THRESHOLD,
    AddFile,
    BadRequest,
    Commit,
    DeleteFile,
    DeleteFolder,
    EntryNotFound,
    FileEntry,
    HubError,
    HubStorage,
    Operation,
    RepoNotFound,
    check_path,
    git_blob_sha1,
    lfs_pointer,
    wants_lfs,
)

log = logging.getLogger("vla_rl.hub.server")

DEFAULT_PORT = 8808
MAX_JSON_BYTES = 16 * 1024 * 1024
# A commit carries regular files (each <= 10 MiB, base64-encoded) inline; LFS contents come separately.
MAX_COMMIT_BYTES = 1024 * 1024 * 1024
UPLOAD_URL_TTL_S = 24 * 3600
WRITE_BUFFER = 8 * 1024 * 1024
TREE_PAGE = 1000
TREE_PAGE_EXPANDED = 50
COMMITS_PAGE = 50
# Namespaces that would make the Hub's URL scheme ambiguous (``/api/...``, ``/datasets/...``).
RESERVED_NAMESPACES = frozenset({"api", "datasets", "spaces", "models", "buckets", "kernels", "docs"})
# The client maps a 401 on a repo URL to "repository not found" unless X-Error-Message is exactly this string.
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


class Unauthorized(HubError):
    status = 401


class _NotImplemented(HubError):
    status = 501


def _ascii_header(text: str) -> str:
    return " ".join(text.encode("ascii", "replace").decode().split())[:500]


def _error_response(
    status: int, message: str, code: str | None = None, extra: dict[str, str] | None = None
) -> JSONResponse:
    headers = {"X-Error-Message": _ascii_header(message)}
    if status == 401:
        headers["X-Error-Message"] = INVALID_CREDENTIALS
        headers["WWW-Authenticate"] = 'Bearer realm="vla-rl hub"'
    if code:
        headers["X-Error-Code"] = code
    headers.update(extra or {})
    return JSONResponse({"error": message}, status_code=status, headers=headers)


@dataclass(frozen=True)
class _Settings:
    token: str | None
    private: bool
    user: str
    secret: bytes


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def create_app(
    data_dir: str | os.PathLike[str],
    *,
    token: str | None = None,
    private: bool = False,
    user: str = "local",
) -> FastAPI:
    """Build the FastAPI app serving the repos under ``data_dir`` (created if missing)."""
    storage = HubStorage(data_dir)
    settings = _Settings(token=token or None, private=private, user=user, secret=storage.secret())
    app = FastAPI(title="vla-rl local hub", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.storage = storage

    class _BigFileResponse(FileResponse):
        chunk_size = 1024 * 1024  # 64 KiB (the default) caps loopback downloads well below disk speed

    # ----- errors --------------------------------------------------------------------------------------------
    @app.exception_handler(HubError)
    async def _hub_error(request: Request, exc: HubError) -> Response:
        return _error_response(exc.status, exc.message, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(400, f"invalid request: {exc.errors()}")

    # ----- helpers -------------------------------------------------------------------------------------------
    def bearer(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None

    def require_write(request: Request) -> None:
        if settings.token is None:
            return
        given = bearer(request)
        if given is None:
            raise Unauthorized("a token is required to write: send 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.encode(), settings.token.encode()):
            raise Unauthorized("invalid token")

    def require_read(request: Request) -> None:
        if settings.private:
            require_write(request)

    def repo_id_of(org: str, name: str) -> str:
        repo_id = f"{org}/{name}"
        try:
            validate_repo_id(repo_id)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return repo_id

    def base_url(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    async def read_body(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HubError(f"request body over {limit} bytes", status=413)
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise HubError(f"request body over {limit} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(request: Request) -> Any:
        raw = await read_body(request, MAX_JSON_BYTES)
        try:
            return json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None

    def file_json(path: str, e: FileEntry, last: Commit | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "oid": e.blob_id, "size": e.size, "path": path}
        if e.lfs:
            out["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": e.pointer_size}
        if last is not None:
            out["lastCommit"] = {"id": last.id, "title": last.summary, "date": last.date}
        return out

    def folder_json(path: str, files: dict[str, FileEntry], last: Commit | None = None) -> dict[str, Any]:
        prefix = path + "/"
        listing = sorted((p[len(prefix) :], e.blob_id) for p, e in files.items() if p.startswith(prefix))
        tree_id = hashlib.sha1(json.dumps(listing).encode(), usedforsecurity=False).hexdigest()
        out: dict[str, Any] = {"type": "directory", "oid": tree_id, "path": path}
        if last is not None:
            out["lastCommit"] = {"id": last.id, "title": last.summary, "date": last.date}
        return out

    def folders_of(files: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for p in files:
            parts = p.split("/")
            for i in range(1, len(parts)):
                out.add("/".join(parts[:i]))
        return out

    def describe(repo_id: str, sha: str, paths: list[str], expand: bool) -> list[dict[str, Any]]:
        commit = storage.commit(repo_id, sha)
        last = storage.last_commits(repo_id, sha, paths) if expand else {}
        return [
            file_json(p, commit.files[p], last.get(p))
            if p in commit.files
            else folder_json(p, commit.files, last.get(p))
            for p in paths
        ]

    def paginated(request: Request, items: list[Any], page_size: int) -> Response:
        raw_page = request.query_params.get("p", "0")
        page = int(raw_page) if raw_page.isdigit() else 0
        chunk = items[page * page_size : (page + 1) * page_size]
        headers = {}
        if (page + 1) * page_size < len(items):
            headers["Link"] = f'<{request.url.include_query_params(p=page + 1)}>; rel="next"'
        return JSONResponse(chunk, headers=headers)

    # ----- service routes ------------------------------------------------------------------------------------
    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    # Not served on purpose: GET /api/agent-harnesses. The client fetches it from its *global* endpoint to tag
    # its user-agent and caches the answer for a day in the user's HF_HOME; answering would plant our empty
    # registry there for the real Hub too. A 404 is swallowed by the client.

    @app.get("/api/whoami-v2")
    def whoami(request: Request) -> dict[str, Any]:
        if settings.token is not None:
            require_write(request)
        elif bearer(request) is None:
            raise Unauthorized("no token sent")
        return {
            "type": "user",
            "id": hashlib.sha1(settings.user.encode(), usedforsecurity=False).hexdigest()[:24],
            "name": settings.user,
            "fullname": settings.user,
            "email": None,
            "emailVerified": False,
            "isPro": False,
            "orgs": [],
            "auth": {
                "type": "access_token",
                "accessToken": {"displayName": "vla-rl local hub", "role": "write"},
            },
        }

    @app.post("/api/validate-yaml")
    async def validate_yaml(request: Request) -> dict[str, Any]:
        # The client calls this before committing a README.md; model cards are not checked here.
        await read_body(request, MAX_JSON_BYTES)
        return {"errors": [], "warnings": []}

    @app.post("/api/repos/create")
    async def create_repo(request: Request) -> Response:
        require_write(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("expected a JSON object")
        repo_type = body.get("type") or "model"
        if repo_type != "model":
            raise BadRequest(f"only model repos are supported by this server, not {repo_type!r}")
        name, org = body.get("name"), body.get("organization")
        if isinstance(name, str) and "/" in name and org is None:
            org, name = name.split("/", 1)
        if not org:
            raise BadRequest("repo id must include a namespace, as in 'org/name'")
        repo_id = repo_id_of(str(org), str(name))
        if str(org).lower() in RESERVED_NAMESPACES:
            raise BadRequest(f"namespace {org!r} is reserved")
        private = bool(body.get("private")) or body.get("visibility") == "private"
        url = f"{base_url(request)}/{repo_id}"
        created = await run_in_threadpool(storage.create_repo, repo_id, private=private, author=settings.user)
        if not created:
            return JSONResponse({"error": "You already created this model repo", "url": url}, status_code=409)
        log.info("created repo", extra={"repo": repo_id, "private": private})
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    @app.delete("/api/repos/delete")
    async def delete_repo(request: Request) -> dict[str, Any]:
        require_write(request)
        body = await read_json(request)
        if not isinstance(body, dict) or (body.get("type") or "model") != "model":
            raise BadRequest("expected {'name': ..., 'organization': ..., 'type': 'model'}")
        repo_id = repo_id_of(str(body.get("organization")), str(body.get("name")))
        await run_in_threadpool(storage.delete_repo, repo_id)
        log.info("deleted repo", extra={"repo": repo_id})
        return {}

    @app.api_route("/api/models/{org}/{name}/xet-write-token/{rev}", methods=["GET", "POST"])
    @app.api_route("/api/models/{org}/{name}/xet-read-token/{rev}", methods=["GET", "POST"])
    def xet_token(org: str, name: str, rev: str) -> None:
        raise _NotImplemented(
            "this server does not speak Xet: set HF_HUB_DISABLE_XET=1 before importing huggingface_hub "
            "(vla_rl.hub.registry.configure_hub does it)"
        )

    # ----- read routes ---------------------------------------------------------------------------------------
    def model_info(request: Request, org: str, name: str, rev: str) -> dict[str, Any]:
        require_read(request)
        repo_id = repo_id_of(org, name)
        meta = storage.repo_meta(repo_id)
        sha = storage.resolve(repo_id, rev)
        commit = storage.commit(repo_id, sha)
        blobs = _truthy(request.query_params.get("blobs"))
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

    @app.get("/api/models/{org}/{name}")
    def get_model(request: Request, org: str, name: str) -> dict[str, Any]:
        return model_info(request, org, name, "main")

    @app.get("/api/models/{org}/{name}/revision/{rev}")
    def get_model_revision(request: Request, org: str, name: str, rev: str) -> dict[str, Any]:
        return model_info(request, org, name, rev)

    @app.get("/api/models/{org}/{name}/refs")
    def list_refs(request: Request, org: str, name: str) -> dict[str, Any]:
        require_read(request)
        refs = storage.refs(repo_id_of(org, name))

        def fmt(kind: str, items: dict[str, str]) -> list[dict[str, str]]:
            return [
                {"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": s} for n, s in sorted(items.items())
            ]

        return {
            "branches": fmt("heads", refs.branches),
            "tags": fmt("tags", refs.tags),
            "converts": [],
            "pullRequests": [],
        }

    @app.get("/api/models/{org}/{name}/commits/{rev}")
    def list_commits(request: Request, org: str, name: str, rev: str) -> Response:
        require_read(request)
        repo_id = repo_id_of(org, name)
        sha = storage.resolve(repo_id, rev)
        items = [
            {
                "id": c.id,
                "title": c.summary,
                "message": c.description,
                "authors": [{"user": c.author}],
                "date": c.date,
                "parents": [c.parent] if c.parent else [],
            }
            for c in storage.history(repo_id, sha)
        ]
        return paginated(request, items, COMMITS_PAGE)

    @app.get("/api/models/{org}/{name}/tree/{rev}")
    def tree_root(request: Request, org: str, name: str, rev: str) -> Response:
        return tree(request, org, name, rev, "")

    @app.get("/api/models/{org}/{name}/tree/{rev}/{path:path}")
    def tree(request: Request, org: str, name: str, rev: str, path: str) -> Response:
        require_read(request)
        repo_id = repo_id_of(org, name)
        path = path.strip("/")
        if path:
            check_path(path)
        sha = storage.resolve(repo_id, rev)
        files = storage.commit(repo_id, sha).files
        prefix = path + "/" if path else ""
        under = [p for p in files if p.startswith(prefix)]
        if path and not under:
            raise EntryNotFound(f"{path} does not exist (or is not a folder) at {rev}")
        folders = folders_of(p[len(prefix) :] for p in under)
        if _truthy(request.query_params.get("recursive")):
            paths = sorted(prefix + f for f in folders) + sorted(under)
        else:
            top_files = [p for p in under if "/" not in p[len(prefix) :]]
            paths = sorted(prefix + f for f in folders if "/" not in f) + sorted(top_files)
        expand = _truthy(request.query_params.get("expand"))
        return paginated(
            request, describe(repo_id, sha, paths, expand), TREE_PAGE_EXPANDED if expand else TREE_PAGE
        )

    @app.post("/api/models/{org}/{name}/paths-info/{rev}")
    async def paths_info(request: Request, org: str, name: str, rev: str) -> list[dict[str, Any]]:
        require_read(request)
        repo_id = repo_id_of(org, name)
        raw = await read_body(request, MAX_JSON_BYTES)
        if request.headers.get("content-type", "").startswith("application/json"):
            body = json.loads(raw or b"{}")
            paths, expand = body.get("paths", []), bool(body.get("expand"))
        else:  # the client sends a form: paths=a&paths=b&expand=False
            form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
            paths, expand = form.get("paths", []), _truthy((form.get("expand") or ["false"])[0])
        if not isinstance(paths, list):
            raise BadRequest("'paths' must be a list of paths")
        paths = [check_path(p.strip("/")) if isinstance(p, str) else check_path(p) for p in paths]

        def work() -> list[dict[str, Any]]:
            sha = storage.resolve(repo_id, rev)
            files = storage.commit(repo_id, sha).files
            folders = folders_of(files)
            present = [p for p in dict.fromkeys(paths) if p in files or p in folders]
            return describe(repo_id, sha, present, expand)

        return await run_in_threadpool(work)

    @app.api_route("/{org}/{name}/resolve/{rev}/{path:path}", methods=["GET", "HEAD"])
    def resolve_file(request: Request, org: str, name: str, rev: str, path: str) -> Response:
        require_read(request)
        repo_id = repo_id_of(org, name)
        check_path(path)
        sha = storage.resolve(repo_id, rev)
        entry = storage.commit(repo_id, sha).files.get(path)
        if entry is None:
            # X-Repo-Commit lets the client cache the miss for this commit.
            raise EntryNotFound(f"{path} does not exist at {rev}", headers={"X-Repo-Commit": sha})
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{entry.etag}"',
            "Accept-Ranges": "bytes",
            "Cache-Control": "private, max-age=0"
            if not COMMIT_SHA.fullmatch(rev)
            else "public, max-age=31536000",
        }
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        filename = path.rsplit("/", 1)[-1]
        headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(filename)}"
        return _BigFileResponse(
            storage.blob_path(entry.sha256), headers=headers, media_type="application/octet-stream"
        )

    # ----- upload routes -------------------------------------------------------------------------------------
    @app.post("/api/models/{org}/{name}/preupload/{rev}")
    async def preupload(request: Request, org: str, name: str, rev: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        if _truthy(request.query_params.get("create_pr")):
            raise BadRequest("pull requests are not supported by this server")
        body = await read_json(request)
        files_in = body.get("files") if isinstance(body, dict) else None
        if not isinstance(files_in, list):
            raise BadRequest("expected {'files': [{'path', 'size', 'sample'}, ...]}")
        sha = await run_in_threadpool(storage.resolve, repo_id, rev)
        current = (await run_in_threadpool(storage.commit, repo_id, sha)).files
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

    def lfs_repo(org: str, repo_git: str) -> str:
        if not repo_git.endswith(".git"):
            raise HubError("Not Found", status=404)
        return repo_id_of(org, repo_git[: -len(".git")])

    def sign(oid: str, size: int, expires: int) -> str:
        msg = f"{oid}:{size}:{expires}".encode()
        return hmac.new(settings.secret, msg, hashlib.sha256).hexdigest()

    @app.post("/{org}/{repo_git}/info/lfs/objects/batch")
    async def lfs_batch(request: Request, org: str, repo_git: str) -> Response:
        require_write(request)
        repo_id = lfs_repo(org, repo_git)
        body = await read_json(request)
        if not isinstance(body, dict) or body.get("operation") != "upload":
            raise BadRequest("only the 'upload' operation of the LFS batch API is supported")
        if not isinstance(body.get("objects"), list):
            raise BadRequest("expected 'objects': [{'oid', 'size'}, ...]")
        if not storage.repo_exists(repo_id):
            raise RepoNotFound(f"Repository not found: {repo_id}")
        base = base_url(request)
        expires = int(time.time()) + UPLOAD_URL_TTL_S
        objects = []
        for obj in body["objects"]:
            oid = obj.get("oid") if isinstance(obj, dict) else None
            size = obj.get("size") if isinstance(obj, dict) else None
            if (
                not isinstance(oid, str)
                or not SHA256_HEX.fullmatch(oid)
                or not isinstance(size, int)
                or size < 0
            ):
                objects.append(
                    {
                        "oid": str(oid),
                        "size": size if isinstance(size, int) else 0,
                        "error": {"code": 422, "message": "oid must be 64 lowercase hex, size an int >= 0"},
                    }
                )
                continue
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if storage.blob_size(oid) != size:
                href = f"{base}/api/lfs/objects/{oid}?size={size}&expires={expires}&sig={sign(oid, size, expires)}"
                item["actions"] = {
                    "upload": {"href": href, "expires_in": UPLOAD_URL_TTL_S},
                    "verify": {"href": f"{base}/{repo_id}.git/info/lfs/objects/verify", "expires_in": 3600},
                }
            objects.append(item)
        return JSONResponse(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            media_type="application/vnd.git-lfs+json",
        )

    @app.put("/api/lfs/objects/{oid}")
    async def lfs_upload(request: Request, oid: str) -> dict[str, Any]:
        q = request.query_params
        size_s, expires_s, sig = q.get("size", ""), q.get("expires", ""), q.get("sig", "")
        if not (SHA256_HEX.fullmatch(oid) and size_s.isdigit() and expires_s.isdigit()):
            raise BadRequest("malformed upload URL: ask the LFS batch endpoint for one")
        size, expires = int(size_s), int(expires_s)
        if not hmac.compare_digest(sig, sign(oid, size, expires)):
            raise HubError("upload URL signature is invalid", status=403)
        if expires < time.time():
            raise HubError("upload URL has expired: ask the LFS batch endpoint for a new one", status=403)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) != size:
            raise BadRequest(f"Content-Length {declared} does not match the announced size {size}")
        writer = await run_in_threadpool(storage.blob_writer, oid, size)
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

    @app.post("/{org}/{repo_git}/info/lfs/objects/verify")
    async def lfs_verify(request: Request, org: str, repo_git: str) -> dict[str, Any]:
        require_write(request)
        lfs_repo(org, repo_git)
        body = await read_json(request)
        oid, size = body.get("oid"), body.get("size")
        if not isinstance(oid, str) or not SHA256_HEX.fullmatch(oid) or not isinstance(size, int):
            raise BadRequest("expected {'oid': <sha256 hex>, 'size': <int>}")
        stored = storage.blob_size(oid)
        if stored is None:
            raise HubError(f"object {oid} was not uploaded", status=404)
        if stored != size:
            raise HubError(f"object {oid} has {stored} bytes, not {size}", status=422)
        return {"oid": oid, "size": size}

    @app.post("/api/models/{org}/{name}/commit/{rev}")
    async def commit(request: Request, org: str, name: str, rev: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        if _truthy(request.query_params.get("create_pr")):
            raise BadRequest("pull requests are not supported by this server")
        raw = await read_body(request, MAX_COMMIT_BYTES)
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
        header = items[0]["value"]
        summary = header.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise BadRequest("the commit header needs a non-empty 'summary'")
        description = header.get("description") or ""
        parent = header.get("parentCommit")
        if parent is not None and (not isinstance(parent, str) or not COMMIT_SHA.fullmatch(parent)):
            raise BadRequest("'parentCommit' must be a 40-hex commit sha")

        def build_operations() -> list[Operation]:
            ops: list[Operation] = []
            for item in items[1:]:
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
                        raise BadRequest(
                            f"{path!r}: files over {LFS_THRESHOLD} bytes must be uploaded with LFS"
                        )
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

        def work() -> Commit:
            ops = build_operations()
            return storage.apply_commit(
                repo_id,
                rev,
                ops,
                summary=summary.strip(),
                description=str(description),
                parent_commit=parent,
                author=settings.user,
            )

        c = await run_in_threadpool(work)
        log.info(
            "commit",
            extra={"repo": repo_id, "branch": rev, "commit": c.id, "operations": len(items) - 1},
        )
        return {
            "success": True,
            "commitOid": c.id,
            "commitUrl": f"{base_url(request)}/{repo_id}/commit/{c.id}",
            "hookOutput": "",
            "pullRequestUrl": None,
        }

    # ----- refs ----------------------------------------------------------------------------------------------
    @app.post("/api/models/{org}/{name}/tag/{rev}")
    async def create_tag(request: Request, org: str, name: str, rev: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        body = await read_json(request)
        tag = body.get("tag") if isinstance(body, dict) else None
        if not isinstance(tag, str):
            raise BadRequest("expected {'tag': <name>}")
        sha = await run_in_threadpool(storage.create_tag, repo_id, tag, rev)
        log.info("tag", extra={"repo": repo_id, "tag": tag, "commit": sha})
        return {"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": sha}

    @app.delete("/api/models/{org}/{name}/tag/{tag}")
    def delete_tag(request: Request, org: str, name: str, tag: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        storage.delete_tag(repo_id, tag)
        log.info("deleted tag", extra={"repo": repo_id, "tag": tag})
        return {}

    @app.post("/api/models/{org}/{name}/branch/{branch}")
    async def create_branch(request: Request, org: str, name: str, branch: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        body = await read_json(request)
        start = body.get("startingPoint") if isinstance(body, dict) else None
        if start is not None and not isinstance(start, str):
            raise BadRequest("'startingPoint' must be a revision string")
        sha = await run_in_threadpool(storage.create_branch, repo_id, branch, start)
        log.info("branch", extra={"repo": repo_id, "branch": branch, "commit": sha})
        return {"name": branch, "ref": f"refs/heads/{branch}", "targetCommit": sha}

    @app.delete("/api/models/{org}/{name}/branch/{branch}")
    def delete_branch(request: Request, org: str, name: str, branch: str) -> dict[str, Any]:
        require_write(request)
        repo_id = repo_id_of(org, name)
        storage.delete_branch(repo_id, branch)
        log.info("deleted branch", extra={"repo": repo_id, "branch": branch})
        return {}

    return app


# ----- running it --------------------------------------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _sock_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_keep_alive=30,
        lifespan="off",
        log_config=None,  # keep the host process's logging setup (vla_rl.logs)
    )
    return uvicorn.Server(config)


def _serve_socket(
    sock: socket.socket,
    data_dir: str | os.PathLike[str],
    token: str | None,
    private: bool,
    log_level: str,
    started: Callable[[Any], None] | None = None,
) -> None:
    app = create_app(data_dir, token=token, private=private)
    server = _uvicorn_server(app, log_level)
    if started is not None:
        started(server)
    url = _sock_url(sock)
    log.info(
        "hub listening on %s",
        url,
        extra={"url": url, "data": str(Path(data_dir).resolve()), "auth": token is not None},
    )
    server.run(sockets=[sock])


def serve(
    data_dir: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    *,
    private: bool = False,
    log_level: str = "info",
) -> None:
    """Run the Hub server in the foreground until interrupted (Ctrl-C / SIGTERM).

    ``port=0`` picks a free port (logged as ``hub listening url=...``). Without a token anyone who can reach
    the port can write, so a non-loopback ``host`` without a token is allowed but warned about.
    """
    if token is None and not _is_loopback(host):
        log.warning("hub binds %s without a token: anyone on the network can push and delete", host)
    sock = _bind(host, port)
    try:
        _serve_socket(sock, data_dir, token, private, log_level)
    finally:
        sock.close()


_CHILD_ENV = "VLA_RL_HUB_CHILD"


def _serve_child() -> None:
    """Entry of :class:`HubServer` subprocesses: settings (token included) come through the environment, not
    argv, so the token never shows in ``ps``; the listening socket is inherited from the parent."""
    cfg = json.loads(os.environ.pop(_CHILD_ENV))
    parent = os.getppid()

    def watch_parent() -> None:
        # A killed test run or CLI must not leave a server holding the port and the data folder.
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    logging.basicConfig(
        level=cfg["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sock = socket.socket(fileno=cfg["fd"])
    _serve_socket(sock, cfg["data_dir"], cfg["token"], cfg["private"], cfg["log_level"])


class HubServer:
    """Run the Hub server in the background, for tests and for embedding in ``vla-rl up``.

    ``port=0`` (the default) picks a free port; :attr:`url` gives the address once started. By default the
    server runs in a thread of this process; ``subprocess=True`` runs it in a child process instead, which keeps
    its Python work off this process's GIL (use it when measuring throughput or when the host is busy) and
    lets a test kill it. The listening socket is bound here in both modes, so the port is known before start
    returns and there is no window in which another process could take it.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        private: bool = False,
        subprocess: bool = False,
        log_level: str = "warning",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host, self.port = host, port
        self.token, self.private = token, private
        self.use_subprocess = subprocess
        self.log_level = log_level
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._proc: Any = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("HubServer is not started")
        return self._url

    def start(self, timeout: float = 30.0) -> HubServer:
        if self._url is not None:
            return self
        self._sock = _bind(self.host, self.port)
        self._url = _sock_url(self._sock)
        if self.use_subprocess:
            self._start_process()
        else:
            self._start_thread()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_thread(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def started(server: Any) -> None:
            self._server = server
            ready.set()

        def run() -> None:
            try:
                assert self._sock is not None
                _serve_socket(self._sock, self.data_dir, self.token, self.private, self.log_level, started)
            except BaseException as e:  # surfaced by _wait_ready
                failure.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, name="vla-rl-hub", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"hub server failed to start: {failure[0]!r}") from failure[0]

    def _start_process(self) -> None:
        assert self._sock is not None
        cfg = {
            "fd": self._sock.fileno(),
            "data_dir": str(self.data_dir),
            "token": self.token,
            "private": self.private,
            "log_level": self.log_level,
        }
        env = {**os.environ, _CHILD_ENV: json.dumps(cfg)}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from vla_rl.hub.server import _serve_child; _serve_child()"],
            env=env,
            pass_fds=(self._sock.fileno(),),
        )

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"hub server process exited with code {self._proc.returncode}")
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("hub server thread exited during startup")
            if self._server is not None and self._server.started:
                return
            if self._proc is not None:
                try:
                    if httpx.get(f"{self.url}/api/health", timeout=1.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"hub server at {self.url} not ready after {timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._server = None
        self._url = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

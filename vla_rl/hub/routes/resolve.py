"""Downloads: ``/{org}/{name}/resolve/{rev}/{path}`` with the headers the client checks."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from vla_rl.hub.naming import COMMIT_SHA
from vla_rl.hub.routes.auth import ReadableRepo
from vla_rl.hub.routes.state import HubDep
from vla_rl.hub.storage import EntryNotFound, check_path

router = APIRouter()


class _BigFileResponse(FileResponse):
    chunk_size = 1024 * 1024  # 64 KiB (the default) caps loopback downloads well below disk speed


@router.api_route("/{org}/{name}/resolve/{rev}/{path:path}", methods=["GET", "HEAD"])
def resolve_file(hub: HubDep, repo_id: ReadableRepo, rev: str, path: str) -> Response:
    check_path(path)
    sha = hub.storage.resolve(repo_id, rev)
    entry = hub.storage.commit(repo_id, sha).files.get(path)
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
        hub.storage.blob_path(entry.sha256), headers=headers, media_type="application/octet-stream"
    )

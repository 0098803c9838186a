"""The page and its assets, served from memory.

Every file under ``static/`` is read once when the app is made (the whole frontend is ~100 KB) and
answered from memory by an async route: no file-system call and no thread hop per request, so the
first page of a fresh browser on a just-started dashboard does not queue its assets behind the
server's thread pool (which the API's blocking routes and the start-up sync also use). A text asset
also has a gzip copy, sent to browsers that accept it (a fleet site's network is not loopback).

URLs: ``/static/<version>/<path>`` is what the page loads (``version``: :func:`static_version`, a
content hash, so those answers are cached forever, immutable); ``/static/<path>`` is the same file,
revalidated after :data:`STATIC_MAX_AGE_S`. Both carry an ETag; a matching ``If-None-Match`` gets 304.
A request names an asset only by looking it up in the table read at start-up, so no path from outside
ever reaches the file system.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from fastapi.responses import HTMLResponse, Response
from starlette.requests import Request

STATIC = Path(__file__).with_name("static")
STATIC_MAX_AGE_S = 300
"""Assets under ``/static/`` are revalidated after this long (ETag makes that a 304)."""
IMMUTABLE_MAX_AGE_S = 365 * 86400
"""Assets under ``/static/<version>/`` (what the page loads) never change: cached this long, immutable."""
GZIP_MIN_BYTES = 1024
"""Text assets at least this large also get a gzip copy."""
_TEXT = (".js", ".css", ".html", ".svg", ".json", ".txt", ".map")


def static_version(root: Path = STATIC) -> str:
    """A content hash of every asset (12 hex digits of SHA-256 over each file's relative path and bytes,
    in sorted order), computed when the app is made: the page loads its assets from
    ``/static/<version>/...`` so a browser may cache them forever, and a changed asset is a new URL.
    ES modules import each other by relative paths, so they stay inside the same version."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


_STATIC_IMPORT = re.compile(r'^\s*import\b[^;]*?\bfrom\s+"(\.{1,2}/[^"]+\.js)"', re.M)
_ROUTE = re.compile(r'route\("([^"]+)",\s*\(\)\s*=>\s*import\("\./([^"]+\.js)"\)\)')


def page_modules(page: str, root: Path = STATIC) -> list[str]:
    """The ES modules (paths under ``root``) the page at route ``page`` (a FastAPI path such as
    ``/episodes/{episode_id}``) runs: ``app.js``, the page module app.js routes it to (its
    ``route("/episodes/:id", () => import("./pages/episode.js"))`` lines) and everything they import
    statically, transitively; sorted. What index.html preloads for that route, so a fresh browser
    fetches them all at once and nothing the page does not need."""

    def shape(path: str) -> list[str]:
        return ["*" if p.startswith((":", "{")) else p for p in path.strip("/").split("/")]

    start = ["app.js"]
    routes = _ROUTE.findall((root / "app.js").read_text())
    start += [mod for pattern, mod in routes if shape(pattern) == shape(page)][:1]
    seen: set[str] = set()
    todo = list(start)
    while todo:
        mod = todo.pop()
        if mod in seen or not (root / mod).is_file():
            continue
        seen.add(mod)
        base = PurePosixPath(mod).parent
        for dep in _STATIC_IMPORT.findall((root / mod).read_text()):
            todo.append(posixpath.normpath((base / dep).as_posix()))
    return sorted(seen)


def index_page(version: str, page: str, root: Path = STATIC) -> Callable[[], Response]:
    """The route handler of page ``page``: index.html (never cached: it names the assets' version) with
    its asset URLs under ``/static/<version>/`` and a ``<link rel="modulepreload">`` for each module of
    :func:`page_modules` in place of its ``<!-- modulepreload -->`` line; built once, here."""
    index = root / "index.html"
    if not index.is_file():
        text = "<!doctype html><title>vla-rl</title><p>The dashboard's page is not installed.</p>"
    else:
        links = "\n".join(
            f'    <link rel="modulepreload" href="/static/{m}" />' for m in page_modules(page, root)
        )
        text = index.read_text().replace("    <!-- modulepreload -->", links)
        text = text.replace('"/static/', f'"/static/{version}/')
    body = text.encode()

    async def serve() -> Response:
        return HTMLResponse(body, headers={"Cache-Control": "no-cache"})

    return serve


@dataclass(frozen=True)
class Asset:
    """One file: its bytes, a gzip copy (text assets of at least :data:`GZIP_MIN_BYTES`), its ETag (a
    content hash) and media type."""

    body: bytes
    gzipped: bytes | None
    etag: str
    media_type: str


def load_assets(root: Path = STATIC) -> dict[str, Asset]:
    """Every file under ``root`` by its POSIX path relative to it."""
    out: dict[str, Asset] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        body = path.read_bytes()
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if media.startswith("text/") or media in ("application/javascript", "application/json"):
            media += "; charset=utf-8"
        packed = (
            gzip.compress(body, compresslevel=9, mtime=0)
            if path.suffix in _TEXT and len(body) >= GZIP_MIN_BYTES
            else None
        )
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        out[path.relative_to(root).as_posix()] = Asset(body, packed, etag, media)
    return out


class AssetServer:
    """The ``/static/{path:path}`` handler over :func:`load_assets` (module doc: URLs and caching)."""

    def __init__(self, version: str, root: Path = STATIC) -> None:
        self.version = version
        self.assets = load_assets(root) if root.is_dir() else {}
        self._immutable = f"public, max-age={IMMUTABLE_MAX_AGE_S}, immutable"
        self._revalidate = f"public, max-age={STATIC_MAX_AGE_S}"

    async def serve(self, path: str, request: Request) -> Response:
        cache = self._revalidate
        prefix = f"{self.version}/"
        if path.startswith(prefix):
            path, cache = path[len(prefix) :], self._immutable
        asset = self.assets.get(path)
        if asset is None:
            return Response("no such asset", status_code=404, media_type="text/plain")
        headers = {"Cache-Control": cache, "ETag": asset.etag, "Vary": "Accept-Encoding"}
        if asset.etag in (t.strip() for t in request.headers.get("if-none-match", "").split(",")):
            return Response(status_code=304, headers=headers)
        body = asset.body
        if asset.gzipped is not None and "gzip" in request.headers.get("accept-encoding", ""):
            body, headers["Content-Encoding"] = asset.gzipped, "gzip"
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(body))
            return Response(status_code=200, headers=headers, media_type=asset.media_type)
        return Response(body, headers=headers, media_type=asset.media_type)

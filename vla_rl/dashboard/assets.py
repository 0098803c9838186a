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


BUNDLE = "app.bundle.js"
"""The asset the page runs: ``app.js`` and every module it imports, statically or by ``import()``, in
one file (:func:`bundle`), built in memory when the assets are read, so a fresh browser fetches one
script instead of a module graph (on ``/episodes`` six module requests became one, and the page's first
API requests no longer wait for one of the browser's 6 connections behind them)."""
ENTRY = "app.js"
_MODULES = "__vlaModules"
_IMPORT = re.compile(r'^import \{([^}]*)\} from "(\.{1,2}/[^"]+\.js)";[ \t]*$')
_EXPORT = re.compile(r"^export (?:async function\*?|function\*?|class|const) ([A-Za-z_$][\w$]*)")
_DYNAMIC = re.compile(r'\bimport\("(\.{1,2}/[^"]+\.js)"\)')


class BundleError(ValueError):
    """A module uses a form :func:`bundle` does not handle; the message names the file and line."""


@dataclass(frozen=True)
class _Module:
    path: str
    deps: tuple[str, ...]
    """Static imports first, then ``import()`` targets (paths under the root), in source order."""
    text: str


def _resolve(base: str, spec: str) -> str:
    return posixpath.normpath((PurePosixPath(base).parent / spec).as_posix())


def _parse(root: Path, path: str) -> _Module:
    """One module rewritten to run inside a function: its ``import { a, b as c } from "./x.js";`` lines
    become ``const { a, b: c } = __vlaModules["x.js"];``, ``export`` is dropped from its declarations
    (which it returns as its namespace), ``import("./y.js")`` becomes a promise of that module's namespace.
    Anything else that imports or exports (default exports, ``export let``, ``export { }``, ``import *``,
    multi-line imports, ``import.meta``) is a :class:`BundleError`: exports are bound once, so a live
    binding (``export let``) would silently freeze."""
    source = root / path
    if not source.is_file():
        raise BundleError(f"{path}: imported but not under {root}")
    static: list[str] = []
    dynamic: list[str] = []
    exports: list[str] = []
    out: list[str] = []
    for n, line in enumerate(source.read_text().splitlines(), 1):
        where = f"{path}:{n}"
        if m := _IMPORT.match(line):
            dep = _resolve(path, m.group(2))
            names = [x.strip() for x in m.group(1).split(",") if x.strip()]
            bound = [x.replace(" as ", ": ") for x in names]
            if not names or any(not re.fullmatch(r"[\w$]+(?:: [\w$]+)?", b) for b in bound):
                raise BundleError(
                    f'{where}: expected import {{ a, b as c }} from "./x.js", got {line.strip()!r}'
                )
            static.append(dep)
            out.append(f'const {{ {", ".join(bound)} }} = {_MODULES}["{dep}"];')
            continue
        if "import.meta" in line or _MODULES in line:
            raise BundleError(
                f"{where}: import.meta and the name {_MODULES} are not bundled, got {line.strip()!r}"
            )
        if re.match(r"^\s*(import|export)\b(?!\()", line):
            if not (m := _EXPORT.match(line)):
                raise BundleError(
                    f"{where}: expected export function|async function|class|const NAME (or a one-line "
                    f'import {{ ... }} from "./x.js"), got {line.strip()!r}'
                )
            exports.append(m.group(1))
            line = line[len("export ") :]
        for spec in _DYNAMIC.findall(line):
            dynamic.append(_resolve(path, spec))
        line = _DYNAMIC.sub(lambda m: f'Promise.resolve({_MODULES}["{_resolve(path, m.group(1))}"])', line)
        if re.search(r"\bimport\s*\(", line):
            raise BundleError(
                f'{where}: expected import("./x.js") with a literal relative path, got {line.strip()!r}'
            )
        out.append(line)
    body = "\n".join(out)
    text = f'// ---- {path}\n{_MODULES}["{path}"] = (() => {{\n{body}\nreturn {{ {", ".join(exports)} }};\n}})();\n'
    return _Module(path, (*static, *dynamic), text)


def bundle(root: Path = STATIC, entry: str = ENTRY) -> str:
    """``entry`` and every module it reaches, each wrapped in a function of its own (its top-level names
    stay its own) and run once, dependencies first (depth-first in import order, as a browser evaluates
    a module graph), the entry last. A module reached only by ``import()`` (a page) runs before the entry
    too, not when first asked for: the pages define functions and classes, nothing runs at their top
    level. The bundle is an ES module itself (served as :data:`BUNDLE`, run by ``<script type="module">``:
    strict and deferred as the modules were). The sources stay as they are (readable, each also served on
    its own); a cycle or a form :func:`_parse` does not handle is a :class:`BundleError` when the app is
    made, never a broken page."""
    done: dict[str, _Module] = {}
    visiting: list[str] = []

    def visit(path: str) -> None:
        if path in done:
            return
        if path in visiting:
            raise BundleError(f"import cycle: {' -> '.join([*visiting[visiting.index(path) :], path])}")
        visiting.append(path)
        mod = _parse(root, path)
        for dep in mod.deps:
            visit(dep)
        visiting.pop()
        done[path] = mod

    visit(entry)
    head = (
        f"// The dashboard's ES modules in one file: {entry} and what it imports, built in memory from\n"
        f"// static/*.js when the app starts (vla_rl.dashboard.assets.bundle); edit those, not this.\n"
        f"const {_MODULES} = {{}};\n"
    )
    return head + "".join(m.text for m in done.values())


def index_page(version: str, root: Path = STATIC) -> Callable[[], Response]:
    """A page route's handler: index.html (never cached: it names the assets' version) with its asset
    URLs under ``/static/<version>/``; built once, here. (Every route gets the same page: the frontend
    routes itself, from the one :data:`BUNDLE`.)"""
    index = root / "index.html"
    if not index.is_file():
        text = "<!doctype html><title>vla-rl</title><p>The dashboard's page is not installed.</p>"
    else:
        text = index.read_text().replace('"/static/', f'"/static/{version}/')
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


def _asset(name: str, body: bytes) -> Asset:
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if media.startswith("text/") or media in ("application/javascript", "application/json"):
        media += "; charset=utf-8"
    packed = (
        gzip.compress(body, compresslevel=9, mtime=0)
        if PurePosixPath(name).suffix in _TEXT and len(body) >= GZIP_MIN_BYTES
        else None
    )
    return Asset(body, packed, '"' + hashlib.sha256(body).hexdigest()[:20] + '"', media)


def load_assets(root: Path = STATIC) -> dict[str, Asset]:
    """Every file under ``root`` by its POSIX path relative to it, and :data:`BUNDLE` (:func:`bundle`)
    when ``root`` has an :data:`ENTRY`."""
    out = {
        p.relative_to(root).as_posix(): _asset(p.name, p.read_bytes())
        for p in sorted(p for p in root.rglob("*") if p.is_file())
    }
    if (root / ENTRY).is_file():
        out[BUNDLE] = _asset(BUNDLE, bundle(root).encode())
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

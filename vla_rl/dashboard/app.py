"""``create_app(DashboardConfig)``: the FastAPI app: JSON API under /api/v1, the page and its assets.

Routes: ``/`` and the page's own routes (/episodes, /episodes/{id}, /rounds, /rounds/{n}, /fleet) all
answer ``static/index.html`` (the frontend routes itself); ``/static/*`` are its assets, with cache
headers; ``/api/v1/*`` is the API (docs/dashboard.md), its OpenAPI schema at /api/v1/openapi.json.
Request bodies are bounded (``max_body_kb``; larger: 413).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import posixpath
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vla_rl import __version__
from vla_rl.dashboard import episodes, fleet, labels, rounds
from vla_rl.dashboard.auth import Principal, TokenTable, generated, load_tokens
from vla_rl.dashboard.config import DashboardConfig
from vla_rl.dashboard.context import Context
from vla_rl.dashboard.errors import ApiError, install_handlers
from vla_rl.dashboard.resources import Resources
from vla_rl.dashboard.startup import GateRequests, run_sync, warm_imports
from vla_rl.instance import own_instance_tag

log = logging.getLogger("vla_rl.dashboard")

STATIC = Path(__file__).with_name("static")
API = "/api/v1"
PAGES = ("/", "/episodes", "/episodes/{episode_id}", "/rounds", "/rounds/{n}", "/fleet", "/flagged")
STATIC_MAX_AGE_S = 300
"""Assets under ``/static/`` are revalidated after this long (ETag / Last-Modified make that a 304)."""
IMMUTABLE_MAX_AGE_S = 365 * 86400
"""Assets under ``/static/<version>/`` (what the page loads) never change: cached this long, immutable."""


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


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (declared by Content-Length, or counted)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counting() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise ApiError(413, "body", self._message(), f"<= {self.max_bytes} bytes")
            return msg

        await self.app(scope, counting, send)

    def _message(self) -> str:
        return f"request body over the dashboard's limit of {self.max_bytes} bytes (--max-body-kb)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(413, "body", self._message(), f"<= {self.max_bytes} bytes")
        await JSONResponse(err.body(), status_code=413)(scope, receive, send)


class CachedStatic(StaticFiles):
    """Static files with a Cache-Control header (plus the ETag / Last-Modified StaticFiles sends)."""

    def __init__(self, *args: Any, cache_control: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache_control = cache_control

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        resp = super().file_response(*args, **kwargs)
        resp.headers["Cache-Control"] = self.cache_control
        return resp


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


def _index_page(version: str, page: str) -> Callable[[], Response]:
    """The page for route ``page``: index.html (never cached: it names the assets' version) with its
    asset URLs under ``/static/<version>/`` and a ``<link rel="modulepreload">`` for each module of
    :func:`page_modules` in place of its ``<!-- modulepreload -->`` line."""
    index = STATIC / "index.html"
    if not index.is_file():
        text = "<!doctype html><title>vla-rl</title><p>The dashboard's page is not installed.</p>"
    else:
        links = "\n".join(f'    <link rel="modulepreload" href="/static/{m}" />' for m in page_modules(page))
        text = index.read_text().replace("    <!-- modulepreload -->", links)
        text = text.replace('"/static/', f'"/static/{version}/')

    def serve() -> Response:
        return HTMLResponse(text, headers={"Cache-Control": "no-cache"})

    return serve


def create_app(cfg: DashboardConfig, tokens: TokenTable | None = None) -> FastAPI:
    """The app. ``tokens`` default: :func:`~vla_rl.dashboard.auth.load_tokens` (the tokens file or
    environment), else a generated one-time operator token (``app.state.generated_token``)."""
    if cfg.hub:
        from vla_rl.hub.registry import configure_hub
        from vla_rl.secrets import env_secret

        configure_hub(cfg.hub, env_secret("VLA_RL_HUB_TOKEN", "HF_TOKEN"))
    generated_token = None
    if tokens is None:
        tokens = load_tokens(cfg.tokens_file)
    if tokens is None:
        tokens, generated_token = generated()
    res = Resources(cfg)
    ctx = Context(cfg=cfg, res=res, tokens=tokens)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        startup = ctx.startup
        # before the port opens: an import of seconds (torch) holds the GIL, and during a first page
        # load it made every request of that page wait behind it
        await asyncio.to_thread(warm_imports)
        if cfg.sync_db:
            threading.Thread(
                target=run_sync, args=(res.store, res.db, startup), name="dashboard-sync-db", daemon=True
            ).start()
        else:
            startup.progress.update(phase="off")
        yield
        res.close()

    app = FastAPI(
        lifespan=lifespan,
        title="vla-rl dashboard",
        version=__version__,
        openapi_url=f"{API}/openapi.json",
        docs_url=None,  # Swagger UI would load its assets from a CDN; robots' networks are often offline
        redoc_url=None,
        description="Review and label rollouts, start post-training rounds, promote and roll back "
        "checkpoints. Every /api/v1 route but /health needs 'Authorization: Bearer <token>'.",
    )
    app.state.ctx = ctx
    app.state.generated_token = generated_token
    install_handlers(app, res.map_exception)

    api = APIRouter(prefix=API)
    viewer = Depends(ctx.require("viewer"))
    instance = own_instance_tag()  # which supervisor's child this is (vla_rl.instance)

    @api.get("/health", summary="store and DB reachability (no token needed)")
    def health() -> dict[str, Any]:
        return {
            "store": res.store_health(),
            "db": res.db_health(),
            "sync": ctx.startup.progress.to_dict(),
            "version": __version__,
            "instance": instance,
        }

    @api.get("/session", summary="who the token belongs to")
    def session(who: Principal = viewer) -> dict[str, Any]:
        return {"name": who.name, "role": who.role}

    api.include_router(labels.make_router(ctx))
    api.include_router(episodes.make_router(ctx))
    api.include_router(rounds.make_router(ctx))
    api.include_router(fleet.make_router(ctx))

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def unknown(path: str) -> None:
        raise ApiError(404, "path", f"no API route {API}/{path}", f"a route of {API}/openapi.json")

    app.include_router(api)
    version = static_version() if STATIC.is_dir() else "none"
    app.state.static_version = version
    if STATIC.is_dir():
        immutable = f"public, max-age={IMMUTABLE_MAX_AGE_S}, immutable"
        app.mount(
            f"/static/{version}", CachedStatic(directory=STATIC, cache_control=immutable), name="assets"
        )
        revalidate = f"public, max-age={STATIC_MAX_AGE_S}"
        app.mount("/static", CachedStatic(directory=STATIC, cache_control=revalidate), name="static")
    for page in PAGES:
        app.add_api_route(
            page,
            _index_page(version, page),
            methods=["GET"],
            include_in_schema=False,
            response_class=HTMLResponse,
        )

    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_kb * 1024)
    app.add_middleware(GateRequests, gate=ctx.startup.gate)  # outermost: counts a request from its start
    return app

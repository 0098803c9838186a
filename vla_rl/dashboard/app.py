"""``create_app(DashboardConfig)``: the FastAPI app: JSON API under /api/v1, the page and its assets.

Routes: ``/`` and the page's own routes (/episodes, /episodes/{id}, /rounds, /rounds/{n}, /fleet, /help) all
answer ``static/index.html`` (the frontend routes itself); ``/static/*`` are its assets, with cache
headers; ``/api/v1/*`` is the API (docs/dashboard.md), its OpenAPI schema at /api/v1/openapi.json.
Request bodies are bounded (``max_body_kb``; larger: 413).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vla_rl.core.instance import own_instance_tag
from vla_rl.core.version import __version__
from vla_rl.dashboard import episodes, fleet, helpqueue, labels, rounds
from vla_rl.dashboard.assets import BUNDLE, STATIC, AssetServer, index_page, static_version
from vla_rl.dashboard.auth import Principal, TokenTable, generated, load_tokens
from vla_rl.dashboard.config import DashboardConfig
from vla_rl.dashboard.context import Context
from vla_rl.dashboard.errors import ApiError, SafeJSONResponse, install_handlers
from vla_rl.dashboard.resources import Resources
from vla_rl.dashboard.startup import GateRequests, run_sync, warm_imports, warm_queries, warm_requests

log = logging.getLogger("vla_rl.dashboard")

API = "/api/v1"
PAGES = ("/", "/episodes", "/episodes/{episode_id}", "/rounds", "/rounds/{n}", "/fleet", "/flagged", "/help")


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413: one that declares a larger Content-Length at
    once; one sent without a length (chunked) is read here first, up to the limit, and handed on whole
    (the limit is small, 4 MiB by default). Counting while the app reads it would raise inside FastAPI's
    body parsing, which answers that with 400."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the server reads no more than it declares
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        read: list[Message] = []
        seen = 0
        while True:
            msg = await receive()
            read.append(msg)
            if msg["type"] != "http.request":  # the client went away
                break
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not msg.get("more_body", False):
                break
        pending = iter(read)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(
            413,
            "body",
            f"request body over the dashboard's limit of {self.max_bytes} bytes (--max-body-kb)",
            f"<= {self.max_bytes} bytes",
        )
        await JSONResponse(err.body(), status_code=413)(scope, receive, send)


def create_app(cfg: DashboardConfig, tokens: TokenTable | None = None) -> FastAPI:
    """The app. ``tokens`` default: :func:`~vla_rl.dashboard.auth.load_tokens` (the tokens file or
    environment), else a generated one-time operator token (``app.state.generated_token``)."""
    if cfg.hub:
        from vla_rl.core.secrets import env_secret
        from vla_rl.hub.registry import configure_hub

        configure_hub(cfg.hub, env_secret("VLA_RL_HUB_TOKEN", "HF_TOKEN"))
    generated_token = None
    if tokens is None:
        tokens = load_tokens(cfg.tokens_file)
    if tokens is None:
        tokens, generated_token = generated()
    res = Resources(cfg)
    ctx = Context(cfg=cfg, res=res, tokens=tokens)

    @contextlib.asynccontextmanager
    async def lifespan(this: FastAPI) -> AsyncIterator[None]:
        startup = ctx.startup
        # before the port opens: an import of seconds (torch) holds the GIL, and during a first page
        # load it made every request of that page wait behind it
        await asyncio.to_thread(warm_imports)
        await asyncio.to_thread(warm_queries, res.store, res.db)
        await warm_requests(this, ["/episodes", f"/static/{this.state.static_version}/{BUNDLE}"])
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
        default_response_class=SafeJSONResponse,  # never a 500 for text a DB holds (errors.py)
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
    instance = own_instance_tag()  # which supervisor's child this is (vla_rl.core.instance)

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
    async def session(who: Principal = viewer) -> dict[str, Any]:  # no I/O: on the event loop
        return {"name": who.name, "role": who.role}

    api.include_router(labels.make_router(ctx))
    api.include_router(episodes.make_router(ctx))
    api.include_router(rounds.make_router(ctx))
    api.include_router(fleet.make_router(ctx))
    api.include_router(helpqueue.make_router(ctx))

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def unknown(path: str) -> None:
        raise ApiError(404, "path", f"no API route {API}/{path}", f"a route of {API}/openapi.json")

    app.include_router(api)
    version = static_version() if STATIC.is_dir() else "none"
    app.state.static_version = version
    app.add_api_route(
        "/static/{path:path}", AssetServer(version).serve, methods=["GET", "HEAD"], include_in_schema=False
    )
    page_handler = index_page(version)
    for page in PAGES:
        app.add_api_route(
            page,
            page_handler,
            methods=["GET"],
            include_in_schema=False,
            response_class=HTMLResponse,
        )

    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_kb * 1024)
    app.add_middleware(GateRequests, gate=ctx.startup.gate)  # outermost: counts a request from its start
    return app

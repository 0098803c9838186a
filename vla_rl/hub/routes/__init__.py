"""The local Hub server's HTTP routes, one :class:`fastapi.APIRouter` per resource.

:func:`vla_rl.hub.server.create_app` includes them in :data:`ROUTERS` order. Shared state (storage and
settings) reaches the routes through :data:`vla_rl.hub.routes.state.HubDep`; who may read or write is decided
in :mod:`vla_rl.hub.routes.auth` alone.
"""

from fastapi import APIRouter

from vla_rl.hub.routes import commits, lfs, refs, repos, resolve, service, tree

# Order matters where two routes match one URL: ``resolve`` (``/{org}/{name}/resolve/{rev}/{path:path}``)
# also matches e.g. ``/api/models/resolve/x/refs``, so it goes last and the ``/api/...`` routes win.
ROUTERS: tuple[APIRouter, ...] = (
    service.router,
    repos.router,
    refs.router,
    commits.router,
    tree.router,
    lfs.router,
    resolve.router,
)

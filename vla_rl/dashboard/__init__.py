"""The web dashboard's backend: a FastAPI app (``create_app``) serving the JSON API ``/api/v1`` and the
single-page frontend in ``static/`` (see docs/dashboard.md).

Modules: ``config`` (the CLI flags), ``auth`` (bearer tokens with roles), ``errors`` (the API's error
shape), ``resources`` (store / DB / hub access with 503s that say how to fix them), ``frames`` (camera
frames and MP4s read from the Zarr store, cached), and one module of routes per page: ``episodes``,
``rounds``, ``fleet``. Nothing here runs a round: rounds are queued for ``vla-rl round worker``.
"""

from __future__ import annotations

from vla_rl.dashboard.config import DashboardConfig

__all__ = ["DashboardConfig", "create_app"]


def create_app(cfg: DashboardConfig, **kw: object) -> object:
    """The FastAPI app for ``cfg`` (see :func:`vla_rl.dashboard.app.create_app`)."""
    from vla_rl.dashboard.app import create_app as _create

    return _create(cfg, **kw)  # type: ignore[arg-type]

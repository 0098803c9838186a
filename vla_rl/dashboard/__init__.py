"""The web dashboard's backend: a FastAPI app (``create_app``) serving the JSON API ``/api/v1`` and the
single-page frontend in ``static/`` (see docs/dashboard.md).

Modules: ``config`` (the CLI flags), ``auth`` (bearer tokens with roles), ``errors`` (the API's error
shape and its JSON response), ``fields`` (request text, ids and refs checked at the edge),
``resources`` (store / DB access with 503s that say how to fix them), ``hub`` (refs, resolving,
moving), ``frames`` (camera frames and MP4s read from the Zarr store, cached), ``curves`` (a running
round's TensorBoard scalars), and the routes: ``episodes``, ``labels``, ``rounds``, ``fleet``. Nothing
here runs a round: rounds are queued for ``vla-rl round worker``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vla_rl.dashboard.config import DashboardConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from vla_rl.dashboard.auth import TokenTable

__all__ = ["DashboardConfig", "create_app"]


def create_app(cfg: DashboardConfig, tokens: TokenTable | None = None) -> FastAPI:
    """The FastAPI app for ``cfg`` (see :func:`vla_rl.dashboard.app.create_app`); imported lazily, so
    ``vla-rl dashboard --help`` needs only the config."""
    from vla_rl.dashboard.app import create_app as _create

    return _create(cfg, tokens=tokens)

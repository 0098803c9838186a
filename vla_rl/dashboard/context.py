"""What every route module shares: config, resources, tokens, frame and video caches, and the role check."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Header

from vla_rl.dashboard.auth import ROLES, WHAT_ROLE_DOES, Principal, TokenTable, bearer
from vla_rl.dashboard.config import DashboardConfig
from vla_rl.dashboard.curves import LiveCurves
from vla_rl.dashboard.errors import ApiError
from vla_rl.dashboard.frames import FrameReader, JpegCache, VideoCache
from vla_rl.dashboard.resources import Resources
from vla_rl.dashboard.startup import Startup


@dataclass
class Context:
    cfg: DashboardConfig
    res: Resources
    tokens: TokenTable
    curves: LiveCurves = field(default_factory=LiveCurves)
    jpegs: JpegCache = field(default_factory=JpegCache)
    startup: Startup = field(default_factory=Startup)
    _reader: FrameReader | None = None
    _video: VideoCache | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reader(self) -> FrameReader:
        store = self.res.store()
        with self._lock:
            if self._reader is None or self._reader.store is not store:
                self._reader = FrameReader(store, self.cfg.frame_cache_mb * 1024 * 1024)
                self._video = VideoCache(
                    self.cfg.workdir / "video",
                    self._reader,
                    max_bytes=self.cfg.video_cache_mb * 1024 * 1024,
                    encoders=self.cfg.video_encoders,
                )
            return self._reader

    def video(self) -> VideoCache:
        self.reader()
        assert self._video is not None
        return self._video

    def require(self, role: str) -> Callable[..., Awaitable[Principal]]:
        """A FastAPI dependency: the caller's :class:`Principal`, or 401 (no or unknown token) / 403 (the
        role is too low; the message names the role needed)."""
        assert role in ROLES

        # async: a dict lookup and constant-time compares, run on the event loop (a sync dependency
        # would take a trip through the thread pool before every request's handler)
        async def check(
            authorization: str | None = Header(default=None, include_in_schema=False),
        ) -> Principal:
            token = bearer(authorization)
            if token is None:
                raise ApiError(
                    401,
                    "authorization",
                    "no token: send the header 'Authorization: Bearer <token>' (a dashboard token from the "
                    "tokens file, see docs/dashboard.md)",
                    "Bearer <token>",
                )
            who = self.tokens.lookup(token)
            if who is None:
                raise ApiError(
                    401,
                    "authorization",
                    "unknown token: it is not in the dashboard's tokens",
                    "a known token",
                )
            if not who.may(role):
                raise ApiError(
                    403,
                    "authorization",
                    f"{who.name} has the {who.role} role; to {WHAT_ROLE_DOES[role]} needs the {role} role "
                    "(or higher): ask an operator for such a token",
                    role,
                )
            return who

        return check


def jsonable(value: Any) -> Any:
    """numpy scalars and tuples -> JSON types (for records built from dataclasses)."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and value != value:
        return None
    return value

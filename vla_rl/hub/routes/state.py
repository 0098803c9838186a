"""What every route shares: the storage and the server's settings, kept on ``app.state.hub``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from vla_rl.hub.limits import Limits
from vla_rl.hub.storage import HubStorage


@dataclass(frozen=True)
class Settings:
    token: str | None  # the one shared token; None: no authentication
    private: bool  # reads need the token too
    user: str  # the name commits and repos are attributed to
    secret: bytes  # signs LFS upload URLs
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class Hub:
    storage: HubStorage
    settings: Settings


def get_hub(request: Request) -> Hub:
    return request.app.state.hub


HubDep = Annotated[Hub, Depends(get_hub)]

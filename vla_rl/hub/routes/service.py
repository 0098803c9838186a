"""Server-wide routes: health, the caller's identity, README metadata validation."""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi import APIRouter, Request

from vla_rl.hub.routes.auth import bearer_token, check_token
from vla_rl.hub.routes.bodies import read_body
from vla_rl.hub.routes.errors import Unauthorized
from vla_rl.hub.routes.state import HubDep

router = APIRouter()


@router.get("/api/health")
def health(request: Request) -> dict[str, Any]:
    # "instance": the tag of the nonce a supervisor started this server with (vla_rl.core.instance), or None
    return {"ok": True, "instance": request.app.state.instance}


# Not served on purpose: GET /api/agent-harnesses. The client fetches it from its *global* endpoint to tag
# its user-agent and caches the answer for a day in the user's HF_HOME; answering would plant our empty
# registry there for the real Hub too. A 404 is swallowed by the client.


@router.get("/api/whoami-v2")
def whoami(request: Request, hub: HubDep) -> dict[str, Any]:
    # Without a server token any token is accepted, but the client needs to have sent one.
    if hub.settings.token is not None:
        check_token(hub, request)
    elif bearer_token(request) is None:
        raise Unauthorized("no token sent")
    user = hub.settings.user
    return {
        "type": "user",
        "id": hashlib.sha1(user.encode(), usedforsecurity=False).hexdigest()[:24],
        "name": user,
        "fullname": user,
        "email": None,
        "emailVerified": False,
        "isPro": False,
        "orgs": [],
        "auth": {
            "type": "access_token",
            "accessToken": {"displayName": "vla-rl local hub", "role": "write"},
        },
    }


@router.post("/api/validate-yaml")
async def validate_yaml(request: Request) -> dict[str, Any]:
    # The client calls this before committing a README.md; model cards are not checked here.
    await read_body(request)
    return {"errors": [], "warnings": []}

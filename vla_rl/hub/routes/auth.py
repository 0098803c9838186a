"""Who may read and write: the server's token rules, as FastAPI dependencies.

Rules (one shared token): when the server has a token, every write needs ``Authorization: Bearer <token>``;
reads need it too on a ``private`` server and are public otherwise, except the reads of a repo created
``private``, which need a token that may read it (the server's token; on a server without a token, where
anyone may write anyway, any bearer token). LFS upload URLs are signed instead (see
:mod:`vla_rl.hub.routes.lfs`). Every route that names a repo gets its id from :data:`ReadableRepo` or
:data:`WritableRepo` (or :data:`WritableLfsRepo`), which check access first and then validate the id, so a
per-repo rule belongs in :func:`readable_repo` / :func:`writable_repo` and nowhere else (a test enumerates the
routes to keep it so).

A read of a private repo without a token that may read it gets exactly the answer of a repo that does not
exist (404, ``X-Error-Code: RepoNotFound``, same message), before any other check of the request, so no
answer tells a hidden repo from a missing one.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from vla_rl.hub.naming import validate_repo_id
from vla_rl.hub.routes.errors import Unauthorized
from vla_rl.hub.routes.state import Hub, HubDep
from vla_rl.hub.storage import BadRequest, HubError, RepoNotFound


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def check_token(hub: Hub, request: Request) -> None:
    """Raise :class:`Unauthorized` unless the request carries the server's token (if it has one)."""
    if hub.settings.token is None:
        return
    given = bearer_token(request)
    if given is None:
        raise Unauthorized("a token is required to write: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.encode(), hub.settings.token.encode()):
        raise Unauthorized("invalid token")


def require_write(request: Request, hub: HubDep) -> None:
    check_token(hub, request)


def require_read(request: Request, hub: HubDep) -> None:
    if hub.settings.private:
        check_token(hub, request)


def repo_id_of(org: str, name: str) -> str:
    repo_id = f"{org}/{name}"
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return repo_id


def may_read_private(hub: Hub, request: Request) -> bool:
    """Whether the request carries a token that may read private repos."""
    given = bearer_token(request)
    if given is None:
        return False
    if hub.settings.token is None:  # no authentication on this server: any token will do (as for whoami)
        return True
    return hmac.compare_digest(given.encode(), hub.settings.token.encode())


def readable_repo(
    org: str, name: str, request: Request, hub: HubDep, _: Annotated[None, Depends(require_read)]
) -> str:
    """The id of the repo a read route names, once the caller may read it: it exists, and it is public or the
    request carries a token that may read it. Otherwise RepoNotFound, the same for a missing and a hidden repo.
    """
    repo_id = repo_id_of(org, name)
    private = hub.storage.is_private(repo_id)
    if private is None or (private and not may_read_private(hub, request)):
        raise RepoNotFound.of(repo_id)
    return repo_id


def writable_repo(org: str, name: str, _: Annotated[None, Depends(require_write)]) -> str:
    """The id of the repo a write route names, once the caller may write."""
    return repo_id_of(org, name)


def writable_lfs_repo(org: str, repo_git: str, _: Annotated[None, Depends(require_write)]) -> str:
    """The repo of a git-LFS URL (``/{org}/{name}.git/info/lfs/...``), once the caller may write."""
    if not repo_git.endswith(".git"):
        raise HubError("Not Found", status=404)
    return repo_id_of(org, repo_git[: -len(".git")])


ReadableRepo = Annotated[str, Depends(readable_repo)]
WritableRepo = Annotated[str, Depends(writable_repo)]
WritableLfsRepo = Annotated[str, Depends(writable_lfs_repo)]
WriteAccess = Depends(
    require_write
)  # for writes that name no repo in the URL: ``dependencies=[WriteAccess]``

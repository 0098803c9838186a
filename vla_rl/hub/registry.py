"""Checkpoint registry: push checkpoint folders to a Hub and pull them back, with the real ``huggingface_hub``.

A reference names a checkpoint: ``hub://org/name@rev`` where ``rev`` is a branch, a tag or a 40-hex commit
(default ``main``), or a plain local folder path. Each training round pushes a commit and a tag
(:func:`push_folder`); promotion moves a ref such as ``prod`` (:func:`move_ref`); policy servers follow a ref by
polling :func:`resolve` and loading with :func:`pull` when the commit changes.

Nothing here is specific to the local server (:mod:`vla_rl.hub.server`): pointed at https://huggingface.co the
same calls publish there. What differs is configuration, which :func:`configure_hub` handles:

* ``HF_ENDPOINT`` selects the Hub. ``huggingface_hub`` reads it once, **at import**, into
  ``huggingface_hub.constants.ENDPOINT``; some clients ignore ``HfApi(endpoint=...)`` on some commit calls,
  so the endpoint is both set in the environment and passed explicitly to every call here.
* ``HF_HUB_DISABLE_XET=1`` is needed for any Hub without Xet storage (the local one): otherwise uploads go
  through Xet and fail with ``501 .../xet-write-token/main``. It is also read at import.

So call :func:`configure_hub` **before anything imports huggingface_hub** (lerobot, transformers and datasets
all do), e.g. first thing in the CLI. If the client is already imported, ``configure_hub`` also patches the
client's module constants (``ENDPOINT`` together with the URL template built from it, and the Xet switch), which
works for the client versions we pin but is a fallback, not the contract. Child processes inherit the
environment variables. As a last safety net, every function here turns Xet off before talking to a Hub that is
not huggingface.co, whatever was configured.

This module does not import ``huggingface_hub`` at import time, so importing it never freezes the settings.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from vla_rl.hub.naming import COMMIT_SHA, validate_client_revision, validate_repo_id

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger("vla_rl.hub.registry")

SCHEME = "hub://"
DEFAULT_REVISION = "main"
OFFICIAL_ENDPOINT = "https://huggingface.co"
_REF_FORMAT = "hub://org/name[@rev] (rev = branch, tag or 40-hex commit; default main)"


@dataclass(frozen=True)
class HubRef:
    """A checkpoint on a Hub: repo ``org/name`` at ``revision`` (branch, tag or commit sha)."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class HubSettings:
    """What :func:`configure_hub` settled on."""

    endpoint: str
    token: str | None
    xet_disabled: bool


@dataclass(frozen=True)
class Checkpoint:
    """A pulled checkpoint folder and the exact version it holds.

    ``commit`` is the Hub commit sha the reference resolved to, or, for a local folder, ``local:<sha1>`` over
    its files' names, sizes and modification times, so followers compare versions the same way either way.
    """

    path: Path
    commit: str
    ref: str
    repo_id: str | None = None
    revision: str | None = None


# ----- configuration ---------------------------------------------------------------------------------------
DEFAULT_HUB = "http://127.0.0.1:8808"
"""Where the embedded registry (`vla-rl hub serve`) listens by default: the CLI's and dashboard's default Hub."""


def _normalize_endpoint(endpoint: str | None) -> str:
    value = (endpoint or os.environ.get("HF_ENDPOINT") or OFFICIAL_ENDPOINT).strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"invalid Hub endpoint {value!r}: expected an http(s) URL like http://127.0.0.1:8808"
        )
    return value


def is_official_hub(endpoint: str) -> bool:
    """True for huggingface.co (and its staging host), which speak Xet; False for any other server."""
    host = urlsplit(endpoint).hostname or ""
    return host == "huggingface.co" or host.endswith(".huggingface.co")


def configure_hub(
    endpoint: str | None = None,
    token: str | None = None,
    *,
    disable_xet: bool | None = None,
) -> HubSettings:
    """Point this process (and its children) at a Hub. Call it before ``huggingface_hub`` is imported.

    Sets ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET`` (by default on for any Hub but huggingface.co) and, when a
    token is given, ``HF_TOKEN``. If ``huggingface_hub`` is already imported, its constants are patched too
    (see the module docstring for why that is a fallback).
    """
    endpoint = _normalize_endpoint(endpoint)
    xet_off = (not is_official_hub(endpoint)) if disable_xet is None else disable_xet
    os.environ["HF_ENDPOINT"] = endpoint
    if xet_off:
        os.environ["HF_HUB_DISABLE_XET"] = "1"
    else:
        os.environ.pop("HF_HUB_DISABLE_XET", None)
    if token:
        os.environ["HF_TOKEN"] = token
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        if endpoint != constants.ENDPOINT:
            log.debug("huggingface_hub already imported: patching its endpoint to %s", endpoint)
            # hf_hub_url() swaps the endpoint only when the template starts with ENDPOINT: keep them in step.
            constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
            constants.ENDPOINT = endpoint
        constants.HF_HUB_DISABLE_XET = xet_off
    return HubSettings(endpoint=endpoint, token=token, xet_disabled=xet_off)


def _client_for(endpoint: str | None, token: str | None) -> tuple[HfApi, str]:
    """An HfApi for ``endpoint`` (explicit), with Xet off when that Hub cannot take it."""
    endpoint = _normalize_endpoint(endpoint)
    if not is_official_hub(endpoint):
        from huggingface_hub import constants

        if not constants.HF_HUB_DISABLE_XET:
            log.info(
                "turning off Xet transfers for %s (call vla_rl.hub.registry.configure_hub early to do it "
                "explicitly)",
                endpoint,
            )
            constants.HF_HUB_DISABLE_XET = True
    from huggingface_hub import HfApi

    from vla_rl.core.version import __version__

    return HfApi(endpoint=endpoint, token=token, library_name="vla-rl", library_version=__version__), endpoint


class HubUnavailable(RuntimeError):
    """The Hub registry cannot be used as asked; the message says how to fix it."""


def _offline() -> bool:
    """HF_HUB_OFFLINE as the environment says now, or as ``huggingface_hub`` read it at import."""
    constants = sys.modules.get("huggingface_hub.constants")
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def check_hub(
    endpoint: str | None = None, token: str | None = None, *, write: bool = False, timeout_s: float = 5.0
) -> None:
    """Fail early, before any work, with a message that says how to fix it: the Hub at ``endpoint`` is not
    reachable, ``HF_HUB_OFFLINE`` blocks it, or (``write``) there is no token or the Hub refuses it."""
    import urllib.error
    import urllib.request

    ep = _normalize_endpoint(endpoint)
    if _offline():
        raise HubUnavailable(
            f"HF_HUB_OFFLINE=1 blocks the Hub registry at {ep}: unset it (or set HF_HUB_OFFLINE=0) to push and "
            "pull checkpoints"
        )
    token = token or os.environ.get("HF_TOKEN")
    if write and not token:
        raise HubUnavailable(
            f"pushing to the Hub at {ep} needs a token: set VLA_RL_HUB_TOKEN (or HF_TOKEN) to the registry's token"
        )
    req = urllib.request.Request(
        f"{ep}/api/whoami-v2", headers={"authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s):
            pass
    except urllib.error.HTTPError as e:
        if write and e.code in (401, 403):
            raise HubUnavailable(
                f"the Hub at {ep} refused the token ({e.code}): check VLA_RL_HUB_TOKEN (or HF_TOKEN)"
            ) from None
        # any other HTTP answer means a server is there; reads decide per repo
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise HubUnavailable(
            f"no Hub registry at {ep} ({reason}): start one with `vla-rl hub serve`, or set --hub / VLA_RL_HUB"
        ) from None


# ----- references ------------------------------------------------------------------------------------------
def is_hub_ref(ref: str | os.PathLike[str] | HubRef) -> bool:
    return isinstance(ref, HubRef) or (isinstance(ref, str) and ref.startswith(SCHEME))


def parse_ref(ref: str | HubRef) -> HubRef:
    """Parse ``hub://org/name[@rev]``; raise ValueError naming the expected form for anything else."""
    if isinstance(ref, HubRef):
        return ref
    if not isinstance(ref, str) or not ref.startswith(SCHEME):
        raise ValueError(f"invalid checkpoint reference {ref!r}: expected {_REF_FORMAT}")
    body = ref[len(SCHEME) :]
    repo_id, sep, revision = body.partition("@")
    if sep and not revision:
        raise ValueError(
            f"invalid checkpoint reference {ref!r}: empty revision after '@'; expected {_REF_FORMAT}"
        )
    if "@" in revision:
        raise ValueError(f"invalid checkpoint reference {ref!r}: more than one '@'; expected {_REF_FORMAT}")
    try:
        validate_repo_id(repo_id)
        validate_client_revision(revision or DEFAULT_REVISION)
    except ValueError as e:
        raise ValueError(f"invalid checkpoint reference {ref!r}: {e}; expected {_REF_FORMAT}") from None
    return HubRef(repo_id=repo_id, revision=revision or DEFAULT_REVISION)


def _local_folder(ref: str | os.PathLike[str]) -> Path:
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"checkpoint reference {str(ref)!r} is neither {_REF_FORMAT} nor an existing local folder"
        )
    return path.resolve()


def local_fingerprint(folder: str | os.PathLike[str]) -> str:
    """``local:<sha1>`` over the folder's relative file paths, sizes and mtimes: changes when a file changes."""
    root = Path(folder)
    h = hashlib.sha1(usedforsecurity=False)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"local:{h.hexdigest()}"


# ----- operations ------------------------------------------------------------------------------------------
def resolve(
    ref: str | os.PathLike[str] | HubRef,
    *,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """The commit sha a reference points at now (one metadata request), or a local folder's fingerprint.

    Raises ``huggingface_hub`` errors (RepositoryNotFoundError, RevisionNotFoundError, ...) when the Hub says
    so. A follower that gets an error should keep serving what it has: while :func:`move_ref` moves a ref
    there is a moment (between its delete and its create) when the ref does not exist.
    """
    if not is_hub_ref(ref):
        return local_fingerprint(_local_folder(ref))  # type: ignore[arg-type]
    hub_ref = parse_ref(ref)  # type: ignore[arg-type]
    api, _ = _client_for(endpoint, token)
    sha = api.model_info(hub_ref.repo_id, revision=hub_ref.revision).sha
    if not sha or not COMMIT_SHA.fullmatch(sha):
        raise RuntimeError(f"{hub_ref}: the Hub returned no valid commit sha ({sha!r})")
    return sha


def pull(
    ref: str | os.PathLike[str] | HubRef,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Checkpoint:
    """Make a checkpoint available locally; return its folder and the commit it holds.

    The reference is resolved to a commit first and that exact commit is downloaded, so the folder and
    ``commit`` always agree even if the ref moves meanwhile. Files come from the Hugging Face cache layout
    under ``cache_dir`` (default: the client's cache), so pulling an unchanged commit again downloads nothing.
    Treat the folder as read-only: its files are links into the shared cache. Local folders are returned as
    they are.
    """
    if not is_hub_ref(ref):
        folder = _local_folder(ref)  # type: ignore[arg-type]
        return Checkpoint(path=folder, commit=local_fingerprint(folder), ref=str(ref))
    hub_ref = parse_ref(ref)  # type: ignore[arg-type]
    sha = resolve(hub_ref, endpoint=endpoint, token=token)
    from huggingface_hub import snapshot_download

    _, endpoint = _client_for(endpoint, token)
    path = snapshot_download(
        hub_ref.repo_id,
        revision=sha,
        cache_dir=str(cache_dir) if cache_dir is not None else None,
        endpoint=endpoint,
        token=token,
        library_name="vla-rl",
    )
    log.info("pulled checkpoint", extra={"ref": str(hub_ref), "commit": sha, "path": path})
    return Checkpoint(
        path=Path(path), commit=sha, ref=str(hub_ref), repo_id=hub_ref.repo_id, revision=hub_ref.revision
    )


def push_folder(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    message: str,
    tag: str | None = None,
    branch: str = DEFAULT_REVISION,
    endpoint: str | None = None,
    token: str | None = None,
    description: str | None = None,
    private: bool | None = None,
    mirror: bool = True,
) -> str:
    """Commit ``folder`` to ``repo_id`` on ``branch`` (creating repo and branch if missing); return the commit.

    With ``mirror`` (the default) the branch ends up holding exactly the folder's files: files of the previous
    checkpoint that the folder no longer has are deleted in the same commit (``.gitattributes`` is kept). If
    nothing changed, no commit is made and the current head is returned. ``tag`` then points at the commit,
    moved there if it already existed elsewhere.
    """
    src = Path(folder)
    if not src.is_dir():
        raise ValueError(f"checkpoint folder {str(folder)!r} does not exist or is not a folder")
    validate_repo_id(repo_id)
    validate_client_revision(branch)
    if not message or not message.strip():
        raise ValueError("a commit message is required")
    api, ep = _client_for(endpoint, token)
    api.create_repo(repo_id, repo_type="model", exist_ok=True, private=private)
    if branch != DEFAULT_REVISION:
        api.create_branch(repo_id, branch=branch, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=src,
        revision=branch,
        commit_message=message,
        commit_description=description,
        delete_patterns="*" if mirror else None,
    )
    sha = info.oid
    if tag is not None:
        _point_ref(api, repo_id, tag, sha, "tag")
    log.info(
        "pushed checkpoint",
        extra={"repo": repo_id, "branch": branch, "commit": sha, "tag": tag, "endpoint": ep},
    )
    return sha


def move_ref(
    repo_id: str,
    name: str,
    to_revision: str,
    *,
    kind: Literal["tag", "branch"] | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """Point tag or branch ``name`` at the commit ``to_revision`` resolves to (for promotion); return it.

    ``kind`` defaults to what ``name`` already is, or a tag for a new name. The Hub has no atomic ref update,
    so moving is delete + create: followers may see the ref missing for a moment (see :func:`resolve`).
    ``main`` cannot be moved this way (its history would be lost).
    """
    validate_repo_id(repo_id)
    validate_client_revision(name)
    if name == DEFAULT_REVISION:
        raise ValueError(f"refusing to move {DEFAULT_REVISION!r}: push to it, or promote through another ref")
    api, _ = _client_for(endpoint, token)
    sha = api.model_info(repo_id, revision=to_revision).sha
    assert sha is not None
    _point_ref(api, repo_id, name, sha, kind)
    log.info("moved ref", extra={"repo": repo_id, "ref": name, "commit": sha})
    return sha


def _point_ref(api: Any, repo_id: str, name: str, sha: str, kind: str | None, attempts: int = 6) -> None:
    """Delete + create ``name`` at ``sha``. Two processes moving the same ref at once (two round workers
    promoting) race between the look and the move: one's delete or create then answers 404 / 409. That is
    no failure: look again and move again (the last mover wins), a few times."""
    from huggingface_hub.errors import HfHubHTTPError

    for attempt in range(attempts):
        try:
            _point_ref_once(api, repo_id, name, sha, kind)
            return
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status not in (404, 409) or attempt == attempts - 1:
                raise
            log.info("ref moved meanwhile; again", extra={"repo": repo_id, "ref": name, "status": status})
            time.sleep(0.05 * (attempt + 1))


def _move_tag(api: Any, repo_id: str, tag: str, sha: str) -> bool:
    """Move ``tag`` to ``sha`` in one request where the registry can (our embedded one: ``"move": true``,
    never missing for a follower); False where it cannot (the Hub answers 409: the tag exists), and the
    caller deletes and creates."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import get_session, hf_raise_for_status

    url = f"{api.endpoint}/api/models/{repo_id}/tag/{sha}"
    response = get_session().post(url, headers=api._build_hf_headers(), json={"tag": tag, "move": True})
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code in (400, 409):
            return False
        raise
    return True


def _point_ref_once(api: Any, repo_id: str, name: str, sha: str, kind: str | None) -> None:
    refs = api.list_repo_refs(repo_id)
    tags = {r.name: r.target_commit for r in refs.tags}
    branches = {r.name: r.target_commit for r in refs.branches}
    kind = kind or ("branch" if name in branches else "tag")
    if kind not in ("tag", "branch"):
        raise ValueError(f"invalid ref kind {kind!r}: expected 'tag' or 'branch'")
    same, other = (tags, branches) if kind == "tag" else (branches, tags)
    if name in other:
        raise ValueError(
            f"{name!r} is already a {'branch' if kind == 'tag' else 'tag'} of {repo_id}, not a {kind}"
        )
    if same.get(name) == sha:
        return
    if kind == "tag":
        if name in same and _move_tag(api, repo_id, name, sha):
            return
        if name in same:
            api.delete_tag(repo_id, tag=name)
        api.create_tag(repo_id, tag=name, revision=sha)
    else:
        if name in same:
            api.delete_branch(repo_id, branch=name)
        api.create_branch(repo_id, branch=name, revision=sha)

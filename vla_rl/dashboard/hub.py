"""The Hub registry as the dashboard uses it: refs of the policy repo, resolving a base, reading a
checkpoint's robot spec, moving the followed ref. Hub failures become API errors that say what to fix."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from vla_rl.dashboard.errors import ApiError


def endpoint() -> str:
    from vla_rl.hub.registry import DEFAULT_HUB

    return os.environ.get("HF_ENDPOINT", DEFAULT_HUB)


@contextlib.contextmanager
def hub_errors(field: str = "hub") -> Iterator[None]:
    """Hub client exceptions -> ApiError: a missing repo or revision is the caller's ``field`` (422),
    an unreachable Hub is 503, a refused token 502 (the dashboard's own Hub token is at fault)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    from vla_rl.hub.registry import HubUnavailable

    ep = endpoint()
    try:
        yield
    except RevisionNotFoundError as e:
        raise ApiError(
            422,
            field,
            f"{field}: no such tag, branch or commit at {ep} ({_first_line(e)})",
            "a ref that resolves on the Hub",
        ) from None
    except RepositoryNotFoundError as e:
        raise ApiError(
            422, field, f"{field}: no such repo at {ep} ({_first_line(e)})", "an existing repo"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise ApiError(
                502,
                "hub",
                f"the Hub at {ep} refused the dashboard's token ({status}): set "
                "VLA_RL_HUB_TOKEN (or HF_TOKEN) for the dashboard process",
                "a Hub token with write access",
            ) from None
        raise ApiError(502, "hub", f"the Hub at {ep} answered {status}: {_first_line(e)}", None) from None
    except (
        HubUnavailable,
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.ReadTimeout,
        ConnectionError,
    ) as e:
        raise ApiError(
            503,
            "hub",
            f"no Hub registry at {ep} ({_first_line(e)}): start one with `vla-rl hub "
            "serve`, or pass --hub to the dashboard",
            "a reachable Hub",
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=os.environ.get("HF_TOKEN") or None)


def list_refs(repo: str) -> list[dict[str, Any]]:
    """Branches and tags of ``repo``: ``[{"name", "commit", "kind"}]``, sorted by name."""
    with hub_errors("repo"):
        refs = api().list_repo_refs(repo)
    out = [{"name": b.name, "commit": b.target_commit, "kind": "branch"} for b in refs.branches]
    out += [{"name": t.name, "commit": t.target_commit, "kind": "tag"} for t in refs.tags]
    return sorted(out, key=lambda r: r["name"])


def resolve_ref(ref: str, field: str) -> str:
    """The commit ``ref`` (hub://org/name@rev, or a local folder) points at, or 422 naming ``field``."""
    from vla_rl.hub.registry import resolve

    try:
        with hub_errors(field):
            return resolve(ref)
    except ValueError as e:
        raise ApiError(422, field, f"{field}: {e}", "hub://org/name@rev (or a checkpoint folder)") from None


def current_commit(repo: str, ref: str) -> str | None:
    """Where ``ref`` of ``repo`` points now (None: it does not exist)."""
    from huggingface_hub.errors import RevisionNotFoundError

    from vla_rl.hub.registry import resolve

    with hub_errors("repo"):
        try:
            return resolve(f"hub://{repo}@{ref}")
        except RevisionNotFoundError:
            return None


def robot_spec_name(ref: str, commit: str, field: str) -> str:
    """The task a checkpoint was trained for (its config.json's robot spec), read without its weights."""
    from pathlib import Path

    from vla_rl.hub.checkpoint import CheckpointError, read_info
    from vla_rl.hub.registry import is_hub_ref, parse_ref

    try:
        if is_hub_ref(ref):
            from huggingface_hub import hf_hub_download

            with hub_errors(field):
                path = hf_hub_download(
                    parse_ref(ref).repo_id, "config.json", revision=commit, endpoint=endpoint()
                )
            return read_info(Path(path).parent).robot_spec.name
        return read_info(ref).robot_spec.name
    except CheckpointError as e:
        raise ApiError(
            422, field, f"{field}: {ref} is not a vla-rl checkpoint ({e})", "a vla-rl checkpoint"
        ) from None


def move(repo: str, ref: str, commit: str) -> str:
    from vla_rl.hub.registry import move_ref

    with hub_errors("repo"):
        return move_ref(repo, ref, commit)

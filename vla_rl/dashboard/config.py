"""``vla-rl dashboard`` flags: one dataclass, parsed by tyro (the field docstrings are the ``--help``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from vla_rl.hub.naming import check_round_target

_ADDRESS = re.compile(r"^[A-Za-z0-9_.:\[\]-]+:\d{1,5}$")


def store_root(store: str | Path) -> str | Path:
    """An episode store as the dashboard keeps it: an object-store URL stays text (``s3://b/p``; also
    what ``Path`` made of one, ``s3:/b/p``), a folder a Path."""
    from fleet.objstore import is_remote  # imports zarr: not for --help

    if is_remote(store):
        text = str(store)
        return text if text.startswith("s3://") else "s3://" + text.removeprefix("s3:/")
    return Path(store)


@dataclass
class DashboardConfig:
    """The fleet's workbench in a browser: review and label every rollout (synchronised camera playback,
    timeline of controller segments, action / reward / state plots), start post-training rounds (queued
    for `vla-rl round worker`), watch them train, promote or roll back the ref the policy servers follow.
    A FastAPI app with a versioned JSON API (/api/v1, OpenAPI at /api/v1/openapi.json) and the page
    itself, nothing loaded from the internet. Access needs a bearer token with a role (viewer, labeller,
    operator) from --tokens-file or VLA_RL_DASHBOARD_TOKENS_FILE / VLA_RL_DASHBOARD_TOKEN (never a
    flag: ps shows flags); without any, a one-time operator token is made and printed. Binds 127.0.0.1
    unless told otherwise. Example: vla-rl dashboard --store runs/fleet/store --server 127.0.0.1:50061"""

    store: str | Path
    """Episode store: a folder or an object-store URL (``s3://bucket/prefix``; then --db is needed).
    Its frames are read from here; they never pass through the DB."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store (a local store only)."""
    hub: str | None = None
    """Hub endpoint for refs, promotion and round bases; None = the global --hub (env VLA_RL_HUB)."""
    repo: str | None = None
    """Policy repo (org/name) whose refs the page lists and promotes; None = the newest round's."""
    server: tuple[str, ...] = ()
    """Policy server addresses (host:port) whose GetInfo the fleet page shows."""
    collector: str | None = None
    """Fleet collector address (host:port) for per-robot stats (token: env VLA_RL_COLLECTOR_TOKEN)."""
    labels: Path | None = None
    """Label schema (TOML); None = the project's fleet/labels.toml."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8780
    """HTTP port (0 = any free port, printed on start)."""
    tokens_file: Path | None = None
    """TOML file of [[token]] name / role / token (or token_file) entries; default: env
    VLA_RL_DASHBOARD_TOKENS_FILE, else VLA_RL_DASHBOARD_TOKEN as one operator token."""
    workdir: Path = Path("runs/dashboard")
    """Caches (encoded videos) and the output folder of the rounds queued from the page (rounds/)."""
    promote_ref: str = "prod"
    """The ref the servers follow: what Promote moves and Rollback moves back."""
    max_body_kb: int = 4096
    """Largest request body accepted (KiB), declared or sent in chunks; larger: 413."""
    frame_cache_mb: int = 256
    """Decoded camera chunks kept in memory (MiB)."""
    video_cache_mb: int = 2048
    """Encoded videos kept in <workdir>/video (MiB); beyond it the least recently used are removed."""
    video_encoders: int = 2
    """Videos encoded at once (each an ffmpeg process); more video requests wait for one."""
    help_expire_s: float = 600.0
    """A robot's help request nobody claimed for this long (seconds) is expired on the help queue."""
    sync_db: bool = True
    """On start, record the store's closed episodes that the metadata DB lacks (a store written without
    the DB, e.g. by `vla-rl sim demos`), so the episode list shows them."""

    def __post_init__(self) -> None:
        self.store = store_root(self.store)
        if isinstance(self.store, str) and self.db is None:
            raise ValueError(
                f"db: the store {self.store} is on object storage and has no SQLite file beside it; "
                "give the metadata DB's URL with --db (e.g. postgresql://host/vla_rl)"
            )
        self.workdir = Path(self.workdir)
        self.server = tuple(self.server)
        for addr in (*self.server, *([self.collector] if self.collector else [])):
            if not _ADDRESS.match(addr):
                raise ValueError(f"server/collector: expected host:port, got {addr!r}")
        if self.hub is not None:
            parts = urlsplit(self.hub)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"hub: expected an http(s) URL like http://127.0.0.1:8808, got {self.hub!r}")
        check_round_target(self.repo, self.promote_ref)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0..65535, got {self.port}")
        if not 1 <= self.max_body_kb <= 1024 * 1024:
            raise ValueError(f"max_body_kb: expected 1..1048576, got {self.max_body_kb}")
        if not 1 <= self.frame_cache_mb <= 1024 * 1024:
            raise ValueError(f"frame_cache_mb: expected 1..1048576, got {self.frame_cache_mb}")
        if not 1 <= self.video_cache_mb <= 1024 * 1024 * 1024:
            raise ValueError(f"video_cache_mb: expected 1..1073741824, got {self.video_cache_mb}")
        if not 1 <= self.help_expire_s <= 7 * 86400:
            raise ValueError(f"help_expire_s: expected 1..604800 seconds, got {self.help_expire_s}")
        if not 1 <= self.video_encoders <= 64:
            raise ValueError(f"video_encoders: expected 1..64, got {self.video_encoders}")

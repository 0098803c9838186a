"""The embedded Hub registry's configuration: one dataclass, the flags of ``vla-rl hub serve`` and what
:func:`vla_rl.hub.server.serve` takes whole (no web framework imported here, so the CLI reads it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from vla_rl.core.configs import SECRET
from vla_rl.core.secrets import env_secret, read_secret_file
from vla_rl.hub.limits import Limits

DEFAULT_PORT = 8808
TOKEN_ENV = "VLA_RL_HUB_TOKEN"


@dataclass
class HubConfig:
    """Run the embedded Hub-compatible registry: model repos stored under --data, served with the
    Hugging Face Hub's HTTP API so the real huggingface_hub client pushes and pulls checkpoints here.
    Writes need the token when one is set, and so do reads of repos created private. The token comes from
    env VLA_RL_HUB_TOKEN or --token-file rather than a flag: a command line is visible to every user of the
    machine through ps (and /proc), the environment and a 0600 file are not. Request bodies are bounded
    (--max-commit-bytes, --max-inline-file-bytes, --max-json-bytes, --max-commit-operations; over a
    limit: 413 naming it). Binds 127.0.0.1 unless told otherwise."""

    data: Path = Path("runs/hub")
    """Repository storage folder."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = DEFAULT_PORT
    """HTTP port (0 = any free port, logged on start)."""
    token: str | None = field(default_factory=lambda: env_secret(TOKEN_ENV), repr=False, metadata=SECRET)
    """Write token (default: env VLA_RL_HUB_TOKEN; prefer the environment or --token-file over this flag)."""
    token_file: Path | None = None
    """File holding the token alone (surrounding whitespace ignored; wins over VLA_RL_HUB_TOKEN); mode 0600."""
    limits: Annotated[Limits, tyro.conf.OmitArgPrefixes] = field(default_factory=Limits)
    """Bounds on request bodies (each its own flag)."""

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0-65535, got {self.port!r}")
        if not self.host:
            raise ValueError("host: expected an address to bind, e.g. 127.0.0.1")

    def resolved_token(self) -> str | None:
        """The write token: --token-file's, else --token / the environment's; None = no token."""
        if self.token_file is not None:
            try:
                return read_secret_file(self.token_file)
            except ValueError as e:
                raise ValueError(f"token_file: {e}") from None
        return self.token or None

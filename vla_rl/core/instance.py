"""Which process answered a health check: a supervisor's per-child nonce, echoed as a hash.

``vla-rl up`` hands each HTTP child it starts (the dashboard, the hub registry) a fresh random nonce in
the environment variable :data:`INSTANCE_ENV` (never on the command line, which every user of the
machine can read); the child's health endpoint answers ``"instance": instance_tag(nonce)`` (the first
16 hex digits of SHA-256 of it; None when started without one), and the ready check accepts only that
answer. Another process that holds the port (another ``vla-rl up`` on the machine, an old dashboard)
answers with another tag or none, so it is not taken for the child. The nonce grants nothing (it is no
credential); only its hash is served all the same. Imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import os
import secrets

INSTANCE_ENV = "VLA_RL_INSTANCE_NONCE"
"""The environment variable that carries a child's nonce."""


def new_nonce() -> str:
    """A fresh random nonce (32 hex digits) for one child."""
    return secrets.token_hex(16)


def instance_tag(nonce: str) -> str:
    """What a health endpoint answers for ``nonce``: ``sha256(nonce)`` as hex, its first 16 digits."""
    return hashlib.sha256(nonce.encode()).hexdigest()[:16]


def own_instance_tag() -> str | None:
    """This process's tag: :func:`instance_tag` of the nonce in :data:`INSTANCE_ENV`, None when unset."""
    nonce = os.environ.get(INSTANCE_ENV, "").strip()
    return instance_tag(nonce) if nonce else None

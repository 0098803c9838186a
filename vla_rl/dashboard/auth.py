"""Bearer tokens with roles: viewer (read) < labeller (labels) < operator (rounds, promote, rollback).

Tokens come from a TOML file (``--tokens-file`` or env ``VLA_RL_DASHBOARD_TOKENS_FILE``)::

    [[token]]
    name = "ana"            # the author of every label ana writes
    role = "labeller"
    token = "..."           # or token_file = "/run/secrets/ana" (the secret alone on one line)

or, alone, env ``VLA_RL_DASHBOARD_TOKEN`` = one operator token named ``operator`` (what ``vla-rl up``
sets). Never from a flag: a command line is visible to every user of the machine. Requests send
``Authorization: Bearer <token>`` (no cookie), so a write cannot be forged by another site (CSRF).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from vla_rl.core.secrets import env_secret, read_secret_file

Role = Literal["viewer", "labeller", "operator"]
ROLES: tuple[str, ...] = get_args(Role)
WHAT_ROLE_DOES = {
    "viewer": "read",
    "labeller": "write labels",
    "operator": "queue, cancel, promote and roll back rounds",
}
TOKENS_FILE_ENV = "VLA_RL_DASHBOARD_TOKENS_FILE"
TOKEN_ENV = "VLA_RL_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@ -]{0,63}$")


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to: ``name`` (recorded as the author of labels) and ``role``."""

    name: str
    role: str

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


class TokenError(ValueError):
    """The tokens file is unusable; the message names the file, the entry and what was expected."""


@dataclass(frozen=True)
class TokenTable:
    """The dashboard's tokens; :meth:`lookup` compares a presented token with every entry in constant time."""

    entries: tuple[tuple[str, Principal], ...]
    source: str
    """Where they came from (for the start-up line): a file path, an env variable, or 'generated'."""

    def lookup(self, token: str) -> Principal | None:
        found = None
        for secret, who in self.entries:  # every entry compared: the time says nothing about which
            if hmac.compare_digest(token.encode(), secret.encode()):
                found = who
        return found


def parse_tokens(text: str, where: str) -> TokenTable:
    """The ``[[token]]`` entries of a TOML document (``where`` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TokenError(f"{where}: not valid TOML ({e})") from None
    raw = doc.get("token")
    if not isinstance(raw, list) or not raw:
        raise TokenError(f"{where}: expected [[token]] entries with name, role and token (or token_file)")
    entries: list[tuple[str, Principal]] = []
    for i, e in enumerate(raw, 1):
        at = f"{where}: [[token]] #{i}"
        if not isinstance(e, dict):
            raise TokenError(f"{at}: expected a table")
        unknown = sorted(set(e) - {"name", "role", "token", "token_file"})
        if unknown:
            raise TokenError(f"{at}: unknown key {unknown[0]!r}; expected name, role, token or token_file")
        name, role = e.get("name"), e.get("role")
        if not isinstance(name, str) or not _NAME.match(name):
            raise TokenError(
                f"{at}: name: expected 1-64 letters, digits or _.@- (the label author), got {name!r}"
            )
        if role not in ROLES:
            raise TokenError(f"{at}: role: expected one of {', '.join(ROLES)}, got {role!r}")
        if ("token" in e) == ("token_file" in e):
            raise TokenError(f"{at}: expected exactly one of token and token_file")
        if "token_file" in e:
            try:
                secret = read_secret_file(Path(str(e["token_file"])).expanduser())
            except ValueError as err:
                raise TokenError(f"{at}: token_file: {err}") from None
        else:
            secret = e["token"]
        if not isinstance(secret, str) or len(secret) < MIN_TOKEN_CHARS or secret != secret.strip():
            raise TokenError(
                f"{at}: token: expected at least {MIN_TOKEN_CHARS} characters without surrounding spaces"
            )
        if any(hmac.compare_digest(secret, s) for s, _ in entries):
            raise TokenError(f"{at}: token: the same token as an earlier entry (each person needs their own)")
        entries.append((secret, Principal(name, str(role))))
    return TokenTable(tuple(entries), where)


def load_tokens(tokens_file: Path | None = None) -> TokenTable | None:
    """Tokens from ``tokens_file``, else env VLA_RL_DASHBOARD_TOKENS_FILE, else VLA_RL_DASHBOARD_TOKEN as
    one operator token; None when none of them is set (the caller then :func:`generated` one)."""
    path = tokens_file or (Path(p) if (p := env_secret(TOKENS_FILE_ENV)) else None)
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise TokenError(f"{path}: cannot read the tokens file ({e.strerror})") from None
        return parse_tokens(text, str(path))
    single = os.environ.get(TOKEN_ENV, "").strip()
    if single:
        if len(single) < MIN_TOKEN_CHARS:
            raise TokenError(f"{TOKEN_ENV}: expected at least {MIN_TOKEN_CHARS} characters")
        return TokenTable(((single, Principal("operator", "operator")),), TOKEN_ENV)
    return None


def generated() -> tuple[TokenTable, str]:
    """A one-time operator token (no tokens configured): the table and the secret to show the user."""
    secret = secrets.token_urlsafe(24)
    return TokenTable(((secret, Principal("operator", "operator")),), "generated"), secret


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when absent or another scheme)."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None

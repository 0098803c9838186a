"""Validation of repo ids, ref names and file paths, shared by the local Hub server and the registry client.

The server keys everything on disk by these strings, so they are checked before any path is built from them:
a repo id can never name a directory outside the data folder, and a file path inside a repo can never make a
client that downloads the repo (``snapshot_download``) write outside its target folder. The rules follow the
real Hub's where they are stricter than ours, so a name accepted here is also accepted there.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

# Every pattern here is used with ``fullmatch`` only (so no anchors): ``re.match`` with a trailing ``$`` would
# accept a trailing newline ('main\n'), which then names another ref, file or folder than the one checked.
# Hub rule: alphanumerics plus '-', '_', '.'; no '--' or '..'; '-' and '.' neither start nor end; 96 chars max.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
# Branch and tag names this server stores. No '/', so a ref is always one URL path segment.
_REF = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9_])?")
# Revisions a client may ask the real Hub for: ref names, commit shas, and slashed refs like refs/pr/1.
_CLIENT_REVISION = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_PATH_BYTES = 1024
# Names Windows reserves for devices, whatever the extension or case ("nul.txt" is NUL): a client that
# downloads the repo there cannot create the file, or writes to the device.
_WINDOWS_DEVICES = frozenset(
    ["CON", "PRN", "AUX", "NUL"]
    + [f"{d}{n}" for d in ("COM", "LPT") for n in [*"123456789", "\u00b9", "\u00b2", "\u00b3"]]
)
# Unicode categories refused anywhere in a path: controls, format characters (zero-width, bidirectional
# overrides and isolates, soft hyphen: they make one name look like another), surrogates, and line and
# paragraph separators.
_BAD_CATEGORIES = {"Cc": "control", "Cf": "invisible or bidirectional formatting", "Cs": "surrogate"}
_BAD_CATEGORIES |= {"Zl": "line separator", "Zp": "paragraph separator"}


def _check_name(part: str, what: str, repo_id: str) -> None:
    if not _NAME.fullmatch(part) or "--" in part or ".." in part:
        raise ValueError(
            f"invalid {what} {part!r} in repo id {repo_id!r}: expected 1-96 characters from [A-Za-z0-9._-], "
            "starting and ending with a letter or digit, without '--' or '..'"
        )


def validate_repo_id(repo_id: str) -> tuple[str, str]:
    """Return ``(namespace, name)`` of an ``org/name`` repo id, or raise ValueError saying what was expected."""
    if not isinstance(repo_id, str):
        raise ValueError(f"repo id must be a string like 'org/name', got {type(repo_id).__name__}")
    parts = repo_id.split("/")
    if len(parts) != 2:
        raise ValueError(f"invalid repo id {repo_id!r}: expected exactly one '/', as in 'org/name'")
    namespace, name = parts
    _check_name(namespace, "namespace", repo_id)
    _check_name(name, "name", repo_id)
    if name.lower().endswith(".git"):
        raise ValueError(f"invalid repo id {repo_id!r}: the name must not end with '.git'")
    return namespace, name


def validate_ref_name(ref: str, what: str = "ref") -> str:
    """Check a branch or tag name this server can store; return it unchanged.

    A 40-hex name is refused because it would be ambiguous with a commit sha when resolving revisions.
    """
    if not isinstance(ref, str) or not _REF.fullmatch(ref) or ".." in ref or ref.endswith(".lock"):
        raise ValueError(
            f"invalid {what} name {ref!r}: expected 1-128 characters from [A-Za-z0-9._-] (no '/'), "
            "starting with a letter or digit, without '..', not ending in '.lock'"
        )
    if COMMIT_SHA.fullmatch(ref):
        raise ValueError(f"invalid {what} name {ref!r}: a 40-hex name would be ambiguous with a commit sha")
    return ref


def validate_client_revision(revision: str) -> str:
    """Check a revision a client may send to any Hub: a branch, a tag or a commit sha (slashes allowed)."""
    if (
        not isinstance(revision, str)
        or not revision
        or len(revision) > 255
        or not _CLIENT_REVISION.fullmatch(revision)
        or ".." in revision
    ):
        raise ValueError(
            f"invalid revision {revision!r}: expected a branch name, a tag name or a 40-hex commit sha "
            "(characters [A-Za-z0-9._-/], no '..')"
        )
    return revision


def validate_repo_path(path: str) -> str:
    """Check a file path inside a repo (``dir/file.ext``); return it unchanged.

    Refused: empty, absolute, backslashes, control, invisible and bidirectional formatting characters
    (zero-width spaces, RLO: a name that looks like another), empty / '.' / '..' segments, '.git' in any
    case ('.GIT' is '.git' on a case-insensitive file system), Windows device names (CON, NUL, COM1, in any
    case and with any extension), a trailing '/', and more than 1024 UTF-8 bytes. Paths that differ only in
    case or Unicode normalisation are refused when committed together (:func:`path_collision`).
    """
    if not isinstance(path, str) or not path:
        raise ValueError("invalid path in repo: expected a non-empty relative path like 'dir/file.ext'")
    problem = None
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        problem = f"longer than {MAX_PATH_BYTES} bytes"
    elif path.startswith("/"):
        problem = "absolute paths are not allowed"
    elif "\\" in path:
        problem = "backslashes are not allowed (use '/')"
    elif bad := next((c for c in path if unicodedata.category(c) in _BAD_CATEGORIES), None):
        what = _BAD_CATEGORIES[unicodedata.category(bad)]
        problem = f"{what} characters are not allowed (U+{ord(bad):04X})"
    else:
        problem = next(filter(None, map(_segment_problem, path.split("/"))), None)
    if problem:
        raise ValueError(f"invalid path in repo {path!r}: {problem}")
    return path


def _segment_problem(seg: str) -> str | None:
    """Why one path segment is refused, or None. Windows ignores trailing dots and spaces and case, so
    '.GIT', '.git.' and 'nul.txt' are refused like '.git' and 'NUL'."""
    if seg in ("", ".", ".."):
        return "empty, '.' and '..' segments are not allowed"
    bare = seg.rstrip(". ")
    if bare.casefold() == ".git":
        return "'.git' segments are not allowed, in any case"
    if bare.split(".")[0].rstrip(" ").upper() in _WINDOWS_DEVICES:
        return f"{seg!r} is a device name Windows reserves (CON, PRN, AUX, NUL, COM1-9, LPT1-9)"
    return None


def path_key(path: str) -> str:
    """What a case-insensitive, normalisation-insensitive file system (macOS, Windows) makes of ``path``: two
    paths with the same key are one file there. NFD, case folding, then NFC (Unicode's canonical caseless
    match)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", path).casefold())


def path_collision(paths: Iterable[str], new: Iterable[str]) -> tuple[str, str] | None:
    """Two different paths of ``paths`` (a repo's files after a commit), or of their folders, that are one
    file where case and Unicode normalisation do not count, one of them a path (or folder) of ``new`` (what
    the commit adds): ``(added, other)``, or None. Older collisions are left alone."""
    added = {prefix for p in new for prefix in _prefixes(p)}
    seen: dict[str, set[str]] = {}
    for p in paths:
        for prefix in _prefixes(p):
            seen.setdefault(path_key(prefix), set()).add(prefix)
    for names in seen.values():
        if len(names) > 1 and (mine := sorted(names & added)):
            return mine[0], sorted(names - {mine[0]})[0]
    return None


def _prefixes(path: str) -> list[str]:
    """``a``, ``a/b``, ``a/b/c.txt`` for ``a/b/c.txt``: the folders on the way and the path itself."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def check_round_target(repo: str | None, promote_ref: str) -> None:
    """The repository a round pushes to (``org/name``, or None: the base's) and the ref it promotes (a
    valid tag or branch other than ``main``, which keeps the history): a ValueError naming the field."""
    if repo is not None:
        try:
            validate_repo_id(repo)
        except ValueError as e:
            raise ValueError(f"repo: expected org/name, got {repo!r} ({e})") from None
    try:
        validate_client_revision(promote_ref)
    except ValueError as e:
        raise ValueError(f"promote_ref: {e}") from None
    if promote_ref == "main":
        raise ValueError("promote_ref: expected a tag or branch other than main (it keeps the history)")

"""Bounds on request bodies of the local Hub server (no web framework imported, so the CLI can read the
defaults cheaply). ``vla-rl hub serve`` exposes each field as a flag of the same name."""

from __future__ import annotations

from dataclasses import dataclass

from vla_rl.hub.storage import LFS_THRESHOLD

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may make the server hold or parse, each named in the 413 that enforces it.

    A commit carries only regular files inline (base64, at most ``max_inline_file_bytes`` each); large files go
    through LFS, whose uploads are streamed to disk and never held in memory. The commit is parsed line by
    line, so memory is bounded by one line (one inline file), not by ``max_commit_bytes``.
    """

    max_commit_bytes: int = 256 * MiB
    """Largest NDJSON commit body (header plus all inline files, base64-encoded)."""
    max_inline_file_bytes: int = LFS_THRESHOLD
    """Largest regular (non-LFS) file a commit may carry inline, decoded; at most the LFS threshold."""
    max_json_bytes: int = 4 * MiB
    """Largest JSON body of any other request (preupload, LFS batch, paths-info, refs, repos)."""
    max_commit_operations: int = 100_000
    """Most operations (added, LFS and deleted files or folders) in one commit; each is held until it lands."""

    def __post_init__(self) -> None:
        for name in ("max_commit_bytes", "max_inline_file_bytes", "max_json_bytes", "max_commit_operations"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_inline_file_bytes > LFS_THRESHOLD:
            raise ValueError(
                f"max_inline_file_bytes must be <= {LFS_THRESHOLD} (larger files always go through LFS), "
                f"got {self.max_inline_file_bytes}"
            )

    @property
    def max_commit_line_bytes(self) -> int:
        """Longest NDJSON line of a commit: one inline file in base64 plus its JSON framing and path."""
        return 4 * -(-self.max_inline_file_bytes // 3) + 64 * 1024

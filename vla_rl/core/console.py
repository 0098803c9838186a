"""Plain-text console output shared by every command: aligned tables and human-readable sizes.

Imports nothing of ours, so any layer (the simulated fleet, the collector, the CLI) can print a table.
"""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (binary units, one decimal; whole bytes below 1 KB)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Left-aligned columns under a header and a dashed rule; trailing spaces stripped."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)

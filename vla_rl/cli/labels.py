"""``vla-rl label ...``: automatic labels the dashboard shows pre-filled and rounds train with."""

from __future__ import annotations

import json
from typing import Any

from vla_rl.cli.common import CliError, Command, open_store, user_errors
from vla_rl.core.console import table


def _label_auto_args() -> type:
    from vla_rl.train.segment_critic import SegmentCriticConfig

    return SegmentCriticConfig


def label_auto(cfg: Any) -> int:
    """HELP's segment critic over the selected episodes (vla_rl/train/segment_critic.py)."""
    from vla_rl.train.segment_critic import CLASSES, label_store

    _store, db = open_store(cfg.store, db_url=cfg.db_url)
    if db is None:
        raise CliError(f"--db-url: the store {cfg.store} has no metadata DB beside it; name one")
    with user_errors(ValueError, KeyError):
        report = label_store(cfg, db=db)
    rows = [
        [eid[:12], str(len(spans)), " ".join(f"{k}[{s}:{e})" for k, s, e in spans)[:90]]
        for eid, spans in list(report.spans.items())[:20]
    ]
    if rows:
        print(table(rows, ["episode", "spans", "classes [start:end)"]))
        if len(report.spans) > 20:
            print(f"... and {len(report.spans) - 20} more episodes")
    frames = ", ".join(f"{c} {report.frames_per_class.get(c, 0)}" for c in CLASSES)
    verb = "would label" if cfg.dry_run else "labelled"
    print(
        f"{verb} {len(report.labelled)} of {report.episodes} episodes (frames: {frames}); skipped "
        f"{len(report.skipped_human)} with human segment spans, {len(report.skipped_auto)} already "
        f"auto-labelled (--replace to redo), {len(report.all_idle)} idle throughout (left unlabelled){'' if cfg.dry_run else f'; undid {report.undone} old auto spans'}"
        f" in {report.seconds:.1f} s"
    )
    if cfg.out is not None:
        cfg.out.write_text(
            json.dumps(
                {
                    "episodes": report.episodes,
                    "dry_run": cfg.dry_run,
                    "spans": {e: [list(s) for s in v] for e, v in report.spans.items()},
                    "skipped_human": report.skipped_human,
                    "skipped_auto": report.skipped_auto,
                    "all_idle": report.all_idle,
                    "frames_per_class": report.frames_per_class,
                    "value_loss": report.value_loss,
                },
                indent=2,
            )
        )
    return 0


COMMANDS = [
    Command(
        ("label", "auto"),
        "pre-label episodes' segments (progress/idle/failure-inducing/recovery) with HELP's critic",
        _label_auto_args,
        label_auto,
    ),
]

"""The labels an export carries: ``meta/vla_rl_labels.parquet`` (written, read back) and a current
``outcome`` label applied to the exported outcome.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vla_rl_client.meta import EpisodeMeta

LABELS_PATH = "meta/vla_rl_labels.parquet"
LABEL_COLUMNS = (
    "episode_index",
    "episode_id",
    "label_id",
    "key",
    "value",
    "start",
    "end",
    "note",
    "author",
    "source",
    "created_at",
)


def with_outcome_label(meta: EpisodeMeta, events: Sequence[Any]) -> EpisodeMeta:
    """The meta with a current ``outcome`` label's value as its outcome (``success`` -> success)."""
    from fleet.db import OUTCOME_KEY, effective_outcome

    labels = {lb.key: lb.value for lb in events if lb.start is None and lb.segment_index is None}
    if labels.get(OUTCOME_KEY) is None:
        return meta
    outcome, success = effective_outcome(meta.outcome, meta.success, labels)
    return dataclasses.replace(meta, outcome=outcome, success=success)


def write_labels(path: Path, metas: Sequence[EpisodeMeta], events: Mapping[str, Sequence[Any]]) -> None:
    """The current labels as a parquet table (one row per label; :data:`LABEL_COLUMNS`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        (index, lb)
        for index, m in enumerate(metas)
        for lb in events.get(m.episode_id, [])
        if lb.start is not None or lb.segment_index is None
    ]
    table = pa.table(
        {
            "episode_index": pa.array([i for i, _ in rows], pa.int64()),
            "episode_id": pa.array([lb.episode_id for _, lb in rows], pa.string()),
            "label_id": pa.array([lb.id for _, lb in rows], pa.int64()),
            "key": pa.array([lb.key for _, lb in rows], pa.string()),
            "value": pa.array([json.dumps(lb.value) for _, lb in rows], pa.string()),
            "start": pa.array([lb.start for _, lb in rows], pa.int64()),
            "end": pa.array([lb.end for _, lb in rows], pa.int64()),
            "note": pa.array([lb.note for _, lb in rows], pa.string()),
            "author": pa.array([lb.author for _, lb in rows], pa.string()),
            "source": pa.array([lb.source for _, lb in rows], pa.string()),
            "created_at": pa.array([lb.created_at for _, lb in rows], pa.float64()),
        }
    )
    pq.write_table(table, path)


def read_exported_labels(dataset_root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The labels an export carried (``meta/vla_rl_labels.parquet``) as dicts with ``value`` decoded;
    ``[]`` when the dataset has none."""
    path = Path(dataset_root) / LABELS_PATH
    if not path.is_file():
        return []
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for r in rows:
        r["value"] = json.loads(r["value"])
    return rows

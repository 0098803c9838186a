"""The imported real data that the offline tests start from (tests/test_offline_eval.py,
tests/test_real_data.py): a LeRobot dataset written by LeRobot's own API (task "koch", no simulator),
imported into a store, and a short SFT base on it; the same dataset again in a store whose metadata DB is
a PostgreSQL database; and the fixture helper that picks one by backend. One place, so both files build
them the same way.

    store, base = imported_base(tmp)                      # teleoperation only (what lerobot-record writes)
    store, base = imported_base(tmp, intervention=DAGGER)  # a DAgger recording
    store, base, url = on_postgresql((store, base), pg, tmp2)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_lerobot_io import import_into, record_style_dataset

PG_SLOW = ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)]
"""``params`` of a backend fixture whose PostgreSQL case runs in the slow suite only."""


def imported_base(tmp: Path, intervention: list[bool] | None = None) -> tuple[Path, Path]:
    """A LeRobot dataset (LeRobot's own API; ``intervention``: DAgger's per-frame column) imported into the
    store ``tmp/store``, and a 10-step SFT base on it (``tmp/sft``)."""
    from vla_rl.train.sft import SFTConfig, train_sft

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(tmp / "hf"))  # LeRobot writes the dataset locally
    try:
        record_style_dataset(tmp / "lerobot", intervention=intervention)
        import_into(tmp / "lerobot", tmp / "store")
    finally:
        mp.undo()
    cfg = SFTConfig(
        store=tmp / "store",
        out=tmp / "sft",
        steps=10,
        batch_size=16,
        chunk_len=4,
        n_exec=2,
        d_model=32,
        checkpoint_every=10,
        progress=False,
    )
    return tmp / "store", train_sft(cfg).checkpoint


def on_postgresql(imported: tuple[Path, Path], pg: Any, tmp: Path) -> tuple[Path, Path, str]:
    """``imported``'s dataset imported again into a store (``tmp/store``) whose metadata DB is a new
    PostgreSQL database on ``pg`` (episodes and labels recorded there); the same base."""
    store, base = imported
    url = pg.create_database()
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(tmp / "hf"))
    try:
        return import_into(store.parent / "lerobot", tmp / "store", url), base, url
    finally:
        mp.undo()


def on_backend(request: pytest.FixtureRequest, name: str) -> tuple[Path, Path, str | None]:
    """(store, base, DB URL) of fixture ``name`` on ``request.param``'s backend: ``name`` with the store's
    SQLite (None), or ``name_pg``."""
    if request.param == "sqlite":
        return (*request.getfixturevalue(name), None)
    return request.getfixturevalue(f"{name}_pg")

"""Span labels written in the dashboard reach SFT as they reach AWR / RECAP / QAM: frames in an
``idle`` span (not also in a ``recovery`` one) are no samples of SFT's ChunkDataset, the same frames
the transition buffer drops, and no action chunk crosses the dropped stretch. Store and metadata DB
are real (SQLite)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vla_rl_client.meta import Controller
from vla_rl_client.spec import RobotSpec

from fleet.dataset import ChunkDataset
from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from vla_rl.train.sft import SFTConfig, span_keep
from vla_rl.train.transitions import TransitionBuffer

SPEC = RobotSpec(name="toy/Reach-v0", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")


def _record(store: EpisodeStore, n: int, offset: float) -> str:
    """An episode whose action at frame i is offset + i (so a chunk shows which frames it holds)."""
    w = store.create_episode(SPEC, robot_id="arm-1", task=SPEC.name, chunk_len=4)
    for i in range(n):
        w.add_frame(
            cameras={},
            state=np.full(2, i, np.float32),
            action=np.full(1, offset + i, np.float32),
            reward=0.0,
            terminated=i == n - 1,
            controller=Controller.POLICY,
            revision="r",
        )
    return w.close(outcome="success", success=True).episode_id


@pytest.fixture
def labelled(tmp_path: Path) -> tuple[EpisodeStore, MetadataDB, list[str]]:
    db = MetadataDB(f"sqlite:///{tmp_path / 'meta.db'}")
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    a, b = _record(store, 10, 0.0), _record(store, 6, 100.0)
    db.add_label(a, "segment", "idle", author="ana", start=3, end=8)
    db.add_label(a, "segment", "recovery", author="ana", start=5, end=6)  # wins over idle
    db.add_label(a, "segment", "progress", author="ana", start=0, end=3)  # changes nothing
    undone = db.add_label(b, "segment", "idle", author="bob", start=0, end=6)
    db.undo_label(undone, author="bob")  # an undone span changes nothing either
    return store, db, [a, b]


def test_sft_samples_skip_idle_spans_like_the_transitions(labelled) -> None:
    store, db, ids = labelled
    plain = ChunkDataset(store, 3, episode_ids=ids, cameras=False)
    ds = ChunkDataset(store, 3, episode_ids=ids, cameras=False, keep=span_keep(db, ids))
    assert (len(plain), len(ds)) == (16, 12)
    b = ds.batch(np.arange(len(ds)))
    frames = list(zip(b["episode_index"].tolist(), b["frame_index"].tolist(), strict=True))
    # by hand: episode 0 keeps 0..2, 5 (recovery), 8, 9; episode 1 keeps all 6
    assert frames == [(0, 0), (0, 1), (0, 2), (0, 5), (0, 8), (0, 9)] + [(1, t) for t in range(6)]
    buf = TransitionBuffer.from_store(store, ids, db=db, cameras=False)  # what AWR / RECAP / QAM train on
    assert list(zip(buf.array("episode").tolist(), buf.array("frame").tolist(), strict=True)) == frames
    # a chunk stops where its run of kept frames stops (padded with the run's last action)
    a, pad = b["action"][:, :, 0].tolist(), b["action_is_pad"].tolist()
    assert (a[1], pad[1]) == ([1.0, 2.0, 2.0], [False, False, True])  # frame 1: frame 3 is idle
    assert (a[3], pad[3]) == ([5.0, 5.0, 5.0], [False, True, True])  # frame 5: a run of one
    assert (a[4], pad[4]) == ([8.0, 9.0, 9.0], [False, False, True])  # frame 8: the episode ends
    assert a[6] == [100.0, 101.0, 102.0] and not any(pad[6])
    np.testing.assert_array_equal(b["observation.state"][3].numpy(), [5.0, 5.0])
    with pytest.raises(ValueError, match="keep: expected a bool mask of 10 frames"):
        ChunkDataset(store, 3, episode_ids=ids, cameras=False, keep=lambda ep: np.ones(3, bool))


def test_sft_trains_on_the_kept_frames_only_and_reports_its_steps(labelled, tmp_path: Path) -> None:
    """A real (tiny) SFT run through the algorithm table: it trains on the 12 kept frames, and its step
    counts reach the ``on_progress`` callback (what a round writes into the DB)."""
    from vla_rl.train.algorithms import train

    store, db, _ = labelled
    cfg = SFTConfig(
        store=store.root,
        db_url=db.url,
        out=tmp_path / "sft",
        steps=2,
        batch_size=4,
        chunk_len=3,
        n_exec=1,
        d_model=16,
        n_layers=1,
        expert_n_layers=1,
        n_heads=2,
        instruction_encoder="none",
        threads=1,
        progress=False,
        checkpoint_every=2,
    )
    reports: list[dict] = []
    res = train(cfg, on_progress=reports.append)
    assert res.data["frames"] == 12 and res.data["episodes"] == 2, res.data
    assert [(r["stage"], r["step"], r["total_steps"]) for r in reports] == [("train", s, 2) for s in range(3)]

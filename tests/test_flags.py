"""Auto-flags (fleet/flags.py): each check on synthetic episodes with a known answer, and
refresh_flags over a real store + metadata DB (SQLite and PostgreSQL), cached and filterable."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.db import EpisodeQuery, MetadataDB
from fleet.flags import (
    FLAG_NAMES,
    FlagThresholds,
    compute_flags,
    episode_uncertainty,
    jerk,
    length_outlier,
    refresh_flags,
    stillness,
    takeovers,
)
from fleet.meta import Controller, EpisodeMeta, Segment, SegmentKind
from fleet.store import Episode, EpisodeStore
from vla_rl.spec import RobotSpec

SPEC = RobotSpec(name="toy", state_dim=2, action_dim=2, control_hz=10.0, instruction="do it")


def _episode(action: np.ndarray, segments: tuple[Segment, ...] = ()) -> Episode:
    t = len(action)
    meta = EpisodeMeta(
        episode_id="e",
        robot_id="arm",
        task="toy",
        instruction="do it",
        spec=SPEC,
        chunk_len=2,
        status="closed",
        length=t,
        created=0.0,
        closed=1.0,
        outcome="success",
        success=True,
        revisions=("r",),
        segments=segments or (Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, t),),
    )
    z = np.zeros(t)
    return Episode(
        meta=meta,
        cameras={},
        state=np.zeros((t, 2), np.float32),
        action=np.asarray(action, np.float32),
        proposed_action=np.full((t, 2), np.nan, np.float32),
        reward=z.astype(np.float32),
        terminated=z.astype(bool),
        truncated=z.astype(bool),
        controller=z.astype(np.uint8),
        segment=z.astype(np.int32),
        revision=z.astype(np.int16),
        timestamp=z,
    )


def _smooth(t: int) -> np.ndarray:
    x = np.linspace(0, 2 * np.pi, t)
    return 0.5 * np.stack([np.sin(x), np.cos(x)], axis=1)


def test_stillness_finds_the_longest_still_stretch() -> None:
    a = _smooth(100)
    a[20:60] = 0.001  # 40 frames = 4 s at 10 Hz
    f = stillness(_episode(a))
    assert f.raised and f.score == pytest.approx(4.0) and "frames 20-59" in f.detail
    assert not stillness(_episode(_smooth(100))).raised
    a[20:60] = 0.0
    a[35] = 0.5  # broken in two: 1.5 s and 2.4 s
    f = stillness(_episode(a))
    assert not f.raised and f.score == pytest.approx(2.4)


def test_jerk_separates_noise_from_smooth_motion() -> None:
    rng = np.random.default_rng(0)
    smooth = jerk(_episode(_smooth(200)))
    noisy = jerk(_episode(_smooth(200) + rng.normal(0, 0.05, (200, 2))))
    assert smooth.score < 0.2 and not smooth.raised
    assert noisy.score == pytest.approx(np.sqrt(20 / 6), rel=0.15) and noisy.raised  # white noise ratio
    tiny = jerk(_episode(rng.normal(0, 1e-4, (200, 2))))  # barely moving: below the floor
    assert tiny.score > 1.2 and not tiny.raised
    assert not jerk(_episode(_smooth(3))).raised


def test_length_outlier_is_a_robust_z_within_the_task() -> None:
    lengths = [100, 102, 98, 101, 99, 100, 500]  # one outlier does not move median / MAD
    f = length_outlier(_episode(_smooth(500)), lengths)
    # median 100, MAD 1 -> floored at 5% of the median = 5 frames: z = 400 / 5
    assert f.raised and f.score == pytest.approx(80.0) and "long" in f.detail
    assert not length_outlier(_episode(_smooth(103)), lengths).raised
    assert length_outlier(_episode(_smooth(500)), lengths[:3]).score == 0.0  # too few to judge


def test_takeovers_counts_human_segments_with_their_reasons() -> None:
    segs = (
        Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 10),
        Segment(1, SegmentKind.INTERVENTION, Controller.HUMAN, 10, 14, "slip"),
        Segment(2, SegmentKind.AUTONOMOUS, Controller.POLICY, 14, 20),
        Segment(3, SegmentKind.INTERVENTION, Controller.HUMAN, 20, 30, "drop"),
    )
    f = takeovers(_episode(_smooth(30), segs))
    assert f.raised and f.score == 2.0 and f.detail == "2 takeovers (14 human frames): drop, slip"
    assert not takeovers(_episode(_smooth(30))).raised
    assert episode_uncertainty(_episode(_smooth(5))) is None  # the documented hook: not stored yet


def test_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match="still_s: expected a number > 0"):
        FlagThresholds(still_s=0)
    with pytest.raises(ValueError, match="min_task_episodes: expected an integer >= 2"):
        FlagThresholds(min_task_episodes=1)
    with pytest.raises(ValueError, match="flag: unknown check 'colour'"):
        compute_flags(_episode(_smooth(5)), [], names=["colour"])


def _record(store: EpisodeStore, actions: np.ndarray, human: tuple[int, int] | None = None) -> str:
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=2)
    for i, a in enumerate(actions):
        if human is not None and i == human[0]:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        if human is not None and i == human[1]:
            w.begin_segment(SegmentKind.AUTONOMOUS, Controller.POLICY)
        in_human = human is not None and human[0] <= i < human[1]
        w.add_frame(
            cameras={},
            state=np.zeros(2, np.float32),
            action=np.asarray(a, np.float32),
            reward=0.0,
            terminated=i == len(actions) - 1,
            truncated=False,
            controller=Controller.HUMAN if in_human else Controller.POLICY,
            revision="r",
        )
    return w.close(outcome="success", success=True).episode_id


def test_refresh_flags_computes_missing_checks_once(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    normal = [_record(store, _smooth(40)) for _ in range(5)]
    still = np.zeros((40, 2))
    still[:5] = np.linspace(0.1, 0.0, 5)[:, None]  # slows down to a stop at frame 4 and stays there
    idle_ep = _record(store, still)
    long_ep = _record(store, _smooth(200))
    taken = _record(store, _smooth(40), human=(10, 20))
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=2)  # still open: skipped
    opened = w.episode_id
    closed = [*normal, idle_ep, long_ep, taken]
    assert db.closed_lacking_flags(FLAG_NAMES) == closed[::-1]  # newest first; the open one is not asked
    assert db.episode_ids() == sorted([*closed, opened])
    pauses: list[int] = []
    got = refresh_flags(
        store, db, [*closed, opened, "no-such-episode"], pause=lambda: pauses.append(len(pauses))
    )
    assert len(pauses) == len(closed) + 1  # before each episode read and before the write
    assert db.closed_lacking_flags(FLAG_NAMES) == [] and db.closed_lacking_flags(["zz"]) == closed[::-1]
    assert set(got) == {*normal, idle_ep, long_ep, taken}
    assert all({f.name for f in fs} == set(FLAG_NAMES) for fs in got.values())
    raised = db.flags([idle_ep, long_ep, taken, normal[0]])
    assert set(raised[idle_ep]) == {"stillness"} and raised[idle_ep]["stillness"].score == pytest.approx(3.6)
    assert set(raised[long_ep]) == {"length_outlier"}
    assert set(raised[taken]) == {"takeovers"} and "10 human frames" in raised[taken]["takeovers"].detail
    assert raised[normal[0]] == {}
    assert len(db.flags([normal[0]], raised_only=False)[normal[0]]) == len(FLAG_NAMES)
    assert refresh_flags(store, db) == {}  # cached: nothing left to compute
    items, total = db.query_episodes(EpisodeQuery(flagged=True, sort="created_at"))
    assert total == 3 and [i.id for i in items] == [idle_ep, long_ep, taken]
    assert items[0].to_dict()["flags"]["stillness"]["detail"].startswith("no motion for 3.6 s")
    assert db.query_episodes(EpisodeQuery(flags=("takeovers", "stillness")))[1] == 2
    w.close(outcome="success", success=True)
    assert set(refresh_flags(store, db)) == {opened}  # closed now: computed on the next refresh


def test_an_episode_without_frames_is_skipped_after_one_try(tmp_path, db_url: str) -> None:
    """A DB row whose frames are not in the store (e.g. another store's) is tried once and remembered in the
    caller's ``unreadable`` set, so a per-request refresh does not retry (and warn) on every request."""
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    ok = _record(store, _smooth(40))
    other = EpisodeStore(tmp_path / "other", create=True)
    ghost_meta = other.read_metadata(_record(other, _smooth(40)))
    db.record_episodes([ghost_meta], str(other.root))  # in this DB, frames elsewhere
    unreadable: set[str] = set()
    got = refresh_flags(store, db, [ok, ghost_meta.episode_id], unreadable=unreadable)
    assert set(got) == {ok} and unreadable == {ghost_meta.episode_id}
    assert refresh_flags(store, db, [ok, ghost_meta.episode_id], unreadable=unreadable) == {}


def test_two_writers_of_the_same_flags_take_turns(tmp_path, db_url: str) -> None:
    """The dashboard's start-up refresh and a page's lazy refresh may store the same episode's flags at
    once: both succeed (the later replaces the earlier), no unique-key error."""
    import threading

    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    eids = [_record(store, _smooth(40)) for _ in range(3)]
    ep = {e: store.read_episode(e, cameras=False) for e in eids}
    flags = {e: compute_flags(ep[e], [40, 40, 40], list(FLAG_NAMES)) for e in eids}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def write() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                db.set_flags(flags)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert all(len(v) == len(FLAG_NAMES) for v in db.flags(eids, raised_only=False).values())

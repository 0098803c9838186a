"""Auto-flags (fleet/flags.py): each check on synthetic episodes with a known answer, and
refresh_flags over a real store + metadata DB (SQLite and PostgreSQL), cached and filterable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vla_rl_client.meta import Controller, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import Flag, MetadataDB
from fleet.flags import (
    FLAG_NAMES,
    FlagThresholds,
    calibrate_revision,
    calibration_basis,
    compute_flags,
    episode_uncertainty,
    failure_score,
    high_uncertainty,
    jerk,
    length_outlier,
    needs_recalibration,
    refresh_flags,
    stillness,
    takeovers,
)
from fleet.selection import EpisodeQuery
from fleet.store import Episode, EpisodeStore

SPEC = RobotSpec(name="toy", state_dim=2, action_dim=2, control_hz=10.0, instruction="do it")


def _episode(
    action: np.ndarray,
    segments: tuple[Segment, ...] = (),
    uncertainty: np.ndarray | None = None,
    failure: np.ndarray | None = None,
) -> Episode:
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
    seg = np.zeros(t, np.int32)
    for g in segments:
        seg[g.start : g.end] = g.index
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
        segment=seg,
        revision=z.astype(np.int16),
        timestamp=z,
        uncertainty=None if uncertainty is None else np.asarray(uncertainty, np.float32),
        failure=None if failure is None else np.asarray(failure, np.float32),
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


# per-chunk scores near the default reference (mean 0.596, std 0.189), two frames per chunk
CALM = [0.55, 0.62, 0.58, 0.65, 0.6, 0.57, 0.63, 0.59, 0.61, 0.56]


def _per_frame(chunks: list[float], frames_per_chunk: int = 2) -> np.ndarray:
    return np.repeat(np.asarray(chunks, np.float32), frames_per_chunk)


def _reference_peak(chunks: list[float], th: FlagThresholds) -> float:
    """The CUSUM peak written out independently of fleet.uncertainty."""
    s, peak = 0.0, 0.0
    for x in chunks:
        s = max(0.0, s + (x - th.uncertainty_mean) / th.uncertainty_std - th.uncertainty_k)
        peak = max(peak, s)
    return peak


def test_high_uncertainty_is_the_peak_cusum_over_chunks() -> None:
    th = FlagThresholds()
    burst = [*CALM[:4], 1.2, 1.3, 1.25, *CALM[4:]]  # three chunks ~3.4 stds high
    u = _per_frame(burst)
    u[:4] = np.nan  # the first two chunks unscored (e.g. the robot started under a human)
    f = high_uncertainty(_episode(_smooth(len(u)), uncertainty=u))
    # one CUSUM step per chunk, not per frame (per frame, the peak would be about twice as high)
    assert f.raised and f.score == pytest.approx(_reference_peak(burst[2:], th), rel=1e-5)
    assert (
        f.score > th.uncertainty_h
        and "at frame 12" in f.detail
        and f"{len(burst) - 2} scored chunks" in f.detail
    )
    calm = high_uncertainty(_episode(_smooth(20), uncertainty=_per_frame(CALM)))
    assert not calm.raised and calm.score == pytest.approx(_reference_peak(CALM, th), rel=1e-5)
    assert calm.score < 1.0
    # no scores: an old episode (no array) or nothing scored (all NaN)
    for u0 in (None, np.full(20, np.nan, np.float32)):
        f = high_uncertainty(_episode(_smooth(20), uncertainty=u0))
        assert not f.raised and f.score == 0.0 and f.detail.startswith("no uncertainty recorded")
    assert episode_uncertainty(_episode(_smooth(5))) is None
    np.testing.assert_allclose(episode_uncertainty(_episode(_smooth(20), uncertainty=u[:20])), u[:20])


def test_high_uncertainty_restarts_at_each_segment() -> None:
    """As the operator's CUSUM restarts after a handback: two moderate stretches split by a takeover do
    not add up; the same chunks in one segment do."""
    th = FlagThresholds()
    half = [0.86, 0.88]  # CUSUM 2.4 after one stretch, 4.8 after both: only together above h = 3.52
    u = np.concatenate([_per_frame(half), np.full(4, np.nan, np.float32), _per_frame(half)])
    t = len(u)
    one = high_uncertainty(_episode(_smooth(t), uncertainty=u))
    assert one.raised and one.score == pytest.approx(_reference_peak(half * 2, th), rel=1e-5)
    segs = (
        Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 4),
        Segment(1, SegmentKind.INTERVENTION, Controller.HUMAN, 4, 8, "stall"),
        Segment(2, SegmentKind.AUTONOMOUS, Controller.POLICY, 8, t),
    )
    split = high_uncertainty(_episode(_smooth(t), segs, uncertainty=u))
    assert not split.raised and split.score == pytest.approx(_reference_peak(half, th), rel=1e-5)


def test_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match="still_s: expected a number > 0"):
        FlagThresholds(still_s=0)
    with pytest.raises(ValueError, match="min_task_episodes: expected an integer >= 2"):
        FlagThresholds(min_task_episodes=1)
    with pytest.raises(ValueError, match="uncertainty_std: expected a number > 0"):
        FlagThresholds(uncertainty_std=0.0)
    with pytest.raises(ValueError, match="uncertainty_k: expected a number >= 0"):
        FlagThresholds(uncertainty_k=-0.1)
    with pytest.raises(ValueError, match="uncertainty_mean: expected a finite number"):
        FlagThresholds(uncertainty_mean=float("nan"))
    for bad in (0.0, 1.0, "high"):
        with pytest.raises(ValueError, match=r"^failure_floor: expected a number in \(0, 1\)"):
            FlagThresholds(failure_floor=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flag: unknown check 'colour'"):
        compute_flags(_episode(_smooth(5)), [], names=["colour"])


def _record(
    store: EpisodeStore,
    actions: np.ndarray,
    human: tuple[int, int] | None = None,
    uncertainty: np.ndarray | None = None,
    revision: str = "r",
    outcome: str = "success",
) -> str:
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=64)
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
            revision=revision,
            uncertainty=None if uncertainty is None else float(uncertainty[i]),
        )
    return w.close(outcome=outcome, success=outcome == "success").episode_id


def test_refresh_flags_computes_missing_checks_once(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    normal = [_record(store, _smooth(40)) for _ in range(5)]
    still = np.zeros((40, 2))
    still[:5] = np.linspace(0.1, 0.0, 5)[:, None]  # slows down to a stop at frame 4 and stays there
    idle_ep = _record(store, still)
    long_ep = _record(store, _smooth(200))
    taken = _record(store, _smooth(40), human=(10, 20))
    unsure = _record(store, _smooth(40), uncertainty=_per_frame([*CALM, 1.2, 1.3, 1.25, *CALM[:7]]))
    calm = _record(store, _smooth(40), uncertainty=_per_frame(CALM * 2))
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=64)  # still open: skipped
    opened = w.episode_id
    # two scored episodes of revision "r" cannot calibrate it: judged by the fixed reference, as asked
    fallback = FlagThresholds(uncertainty_fallback=True)
    closed = [*normal, idle_ep, long_ep, taken, unsure, calm]
    assert db.closed_lacking_flags(FLAG_NAMES) == closed[::-1]  # newest first; the open one is not asked
    assert db.episode_ids() == sorted([*closed, opened])
    pauses: list[int] = []
    got = refresh_flags(
        store, db, [*closed, opened, "no-such-episode"], fallback, pause=lambda: pauses.append(len(pauses))
    )
    assert len(pauses) == len(closed) + 1  # before each episode read and before the write
    assert db.closed_lacking_flags(FLAG_NAMES) == [] and db.closed_lacking_flags(["zz"]) == closed[::-1]
    assert set(got) == set(closed)
    assert all({f.name for f in fs} == set(FLAG_NAMES) for fs in got.values())
    raised = db.flags([idle_ep, long_ep, taken, normal[0], unsure, calm])
    assert set(raised[unsure]) == {"high_uncertainty"} and raised[calm] == {}
    assert raised[unsure]["high_uncertainty"].detail.startswith("peak CUSUM 9.")
    assert raised[unsure]["high_uncertainty"].detail.endswith(
        "fixed thresholds, not enough successful episodes of r to calibrate (1/9)"
    )
    everything = db.flags([normal[0]], raised_only=False)[normal[0]]
    assert everything["high_uncertainty"].detail == "no uncertainty recorded (no frame scored)"
    assert set(raised[idle_ep]) == {"stillness"} and raised[idle_ep]["stillness"].score == pytest.approx(3.6)
    assert set(raised[long_ep]) == {"length_outlier"}
    assert set(raised[taken]) == {"takeovers"} and "10 human frames" in raised[taken]["takeovers"].detail
    assert raised[normal[0]] == {}
    assert len(db.flags([normal[0]], raised_only=False)[normal[0]]) == len(FLAG_NAMES)
    assert refresh_flags(store, db, th=fallback) == {}  # cached: nothing left to compute
    items, total = db.query_episodes(EpisodeQuery(flagged=True, sort="created_at"))
    assert total == 4 and [i.id for i in items] == [idle_ep, long_ep, taken, unsure]
    only = db.query_episodes(EpisodeQuery(flags=("high_uncertainty",)))[0]
    assert [i.id for i in only] == [unsure]
    assert items[0].to_dict()["flags"]["stillness"]["detail"].startswith("no motion for 3.6 s")
    assert db.query_episodes(EpisodeQuery(flags=("takeovers", "stillness")))[1] == 2
    w.close(outcome="success", success=True)
    assert set(refresh_flags(store, db, th=fallback)) == {opened}  # closed now: computed on the next refresh


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


def _calm_chunks(rng: np.random.Generator, mean: float, n: int = 10) -> list[float]:
    return list(rng.normal(mean, 0.1 * mean, n))


def _scored(store: EpisodeStore, chunks: list[float], revision: str, outcome: str = "success") -> str:
    """A policy-driven episode, two frames per chunk, written in one batch (fast)."""
    u = _per_frame(chunks)
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=64)
    w.add_frames(
        {
            "cameras": {},
            "state": np.zeros((len(u), 2), np.float32),
            "action": _smooth(len(u)).astype(np.float32),
            "controller": Controller.POLICY,
            "revision": revision,
            "uncertainty": u,
        }
    )
    return w.close(outcome=outcome, success=outcome == "success").episode_id


def test_high_uncertainty_is_calibrated_per_revision(tmp_path, db_url: str) -> None:
    """Two checkpoints whose scores sit on scales 6x apart: each is judged by its own successful
    episodes, so calm episodes of both pass (about alpha of them at most, by construction) and a burst in
    either is raised; the fixed reference (one benchmark model's) raises every calm one of the high scale.
    A revision with too few successful episodes is not judged."""
    rng = np.random.default_rng(7)
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    calm: dict[str, list[str]] = {}
    burst: dict[str, str] = {}
    fixed_raised = {}
    for rev, mean in (("small", 0.5), ("big", 3.0)):
        scores = [_calm_chunks(rng, mean) for _ in range(10)]
        calm[rev] = [_scored(store, c, rev) for c in scores]
        # the fixed reference (one benchmark model's) on the same episodes
        fixed_raised[rev] = sum(
            high_uncertainty(_episode(_smooth(20), uncertainty=_per_frame(c))).raised for c in scores
        )
        chunks = _calm_chunks(rng, mean)
        chunks[4:7] = [1.4 * mean, 1.42 * mean, 1.45 * mean]  # three chunks ~4 stds high
        burst[rev] = _scored(store, chunks, rev, "failure")
    few = [_scored(store, _calm_chunks(rng, 1.0), "few") for _ in range(3)]
    # a successful episode with a takeover does not calibrate (nor does a failure)
    _record(store, _smooth(20), human=(4, 8), uncertainty=_per_frame(_calm_chunks(rng, 1.0)), revision="few")
    few_fail = _scored(store, _calm_chunks(rng, 1.0), "few", "failure")
    refresh_flags(store, db)
    got = db.flags(
        [e for es in calm.values() for e in es] + [*burst.values(), *few, few_fail], raised_only=False
    )
    for rev in ("small", "big"):
        hu = [got[e]["high_uncertainty"] for e in calm[rev]]
        assert sum(f.raised for f in hu) <= 1  # alpha = 0.1 of 10
        assert all(f.detail.endswith(f"calibrated on 9 successful episodes of {rev}") for f in hu)
        b = got[burst[rev]]["high_uncertainty"]
        assert b.raised and b.detail.endswith(f"calibrated on 10 successful episodes of {rev}")
        assert b.score > max(f.score for f in hu)
        assert calibration_basis(b) == (rev, 10, True)  # stored as columns, read back from the DB
    assert fixed_raised == {"small": 0, "big": 10}
    f = got[few_fail]["high_uncertainty"]
    assert not f.raised and f.score == 0.0
    assert f.detail == "not enough successful episodes of few to calibrate (3/9)"
    assert calibration_basis(f) == ("few", 3, False)
    assert (
        got[few[0]]["high_uncertainty"].detail == "not enough successful episodes of few to calibrate (2/9)"
    )
    assert db.calibration_counts()["few"][0] == 3


def test_a_provisional_uncertainty_flag_is_recomputed_when_the_calibration_grows(
    tmp_path, db_url: str
) -> None:
    """Too few successful episodes: "not enough"; once there are enough the next refresh recomputes it
    (calibrated, raised); after that only when the calibration has doubled, so a refresh stays cheap."""
    rng = np.random.default_rng(3)
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)

    def calm() -> str:
        return _scored(store, _calm_chunks(rng, 2.0), "v2")

    first = [calm() for _ in range(5)]
    chunks = _calm_chunks(rng, 2.0)
    chunks[3:6] = [2.8, 2.85, 2.9]
    fail = _scored(store, chunks, "v2", "failure")
    refresh_flags(store, db, [fail, *first])
    before = db.flags([fail], raised_only=False)[fail]["high_uncertainty"]
    assert not before.raised and before.detail.endswith("(5/9)")
    assert refresh_flags(store, db, [fail]) == {}  # nothing new: cached
    _more = [calm() for _ in range(4)]  # 9 successful episodes: enough at alpha 0.1
    got = refresh_flags(store, db, [fail])
    assert set(got) == {fail} and [f.name for f in got[fail]] == ["high_uncertainty"]
    now = db.flags([fail], raised_only=False)[fail]["high_uncertainty"]
    assert now.raised and now.detail.endswith("calibrated on 9 successful episodes of v2")
    assert now.computed_at > before.computed_at
    calm()  # 10: under twice 9, the result stands
    assert refresh_flags(store, db, [fail]) == {}
    for _ in range(8):  # 18 = twice 9
        calm()
    again = refresh_flags(store, db, [fail])
    assert again[fail][0].detail.endswith("calibrated on 18 successful episodes of v2")
    th = FlagThresholds(uncertainty_alpha=0.05)  # alpha 0.05 needs 19
    with pytest.raises(ValueError, match="uncertainty_alpha: expected a number in"):
        FlagThresholds(uncertainty_alpha=1.5)
    assert min(th.uncertainty_max_calibration, 19) == 19


def test_revision_calibration_judges_a_member_by_the_others_and_knows_when_it_is_stale() -> None:
    rng = np.random.default_rng(11)
    episodes = {f"e{i}": rng.normal(2.0, 0.2, 12) for i in range(10)}
    cal = calibrate_revision("v", episodes)
    assert cal.reference is not None
    pooled = np.concatenate(list(episodes.values()))
    ref = FlagThresholds(uncertainty_mean=float(pooled.mean()), uncertainty_std=float(pooled.std()))
    peaks = {e: _reference_peak(list(x), ref) for e, x in episodes.items()}
    assert cal.reference.h == pytest.approx(sorted(peaks.values())[9])  # r = ceil(11 * 0.9) = 10 of 10
    member, m = cal.for_episode("e3")
    others = sorted(p for e, p in peaks.items() if e != "e3")
    assert m == 9 and member is not None and member.h == pytest.approx(others[8])  # ceil(10 * 0.9) = 9 of 9
    assert cal.for_episode("new") == (cal.reference, 10)
    assert calibrate_revision("v", dict(list(episodes.items())[:8])).reference is None  # 8 < 9
    # what a stored result was computed on (its basis columns), and when it is out of date
    at = 100.0
    done = Flag(
        "high_uncertainty",
        1.0,
        "peak CUSUM 1.00 ...; calibrated on 9 successful episodes of v 2",
        False,
        at,
        calibrated=True,
        calibration_revision="v 2",
        calibration_n=9,
    )
    assert calibration_basis(done) == ("v 2", 9, True)
    assert not needs_recalibration(done, {"v 2": (17, at + 5)})  # under twice 9
    assert not needs_recalibration(done, {"v 2": (18, at - 5)})  # none closed since
    assert needs_recalibration(done, {"v 2": (18, at + 5)})
    few = Flag(
        "high_uncertainty",
        0.0,
        "not enough successful episodes of v to calibrate (3/9)",
        False,
        at,
        calibrated=False,
        calibration_revision="v",
        calibration_n=3,
    )
    assert calibration_basis(few) == ("v", 3, False) and needs_recalibration(few, {"v": (4, at + 1)})
    assert not needs_recalibration(few, {"v": (3, at + 1)})
    old = Flag(  # stored before the basis was (migration 0004 leaves it NULL)
        "high_uncertainty", 5.0, "peak CUSUM 5.00 (threshold 3.52) at frame 3; 9 scored chunks", True, at
    )
    assert calibration_basis(old) == ("", -1, False) and needs_recalibration(old, {})  # once more
    fixed = Flag("high_uncertainty", 5.0, "peak CUSUM 5.00 ...; fixed thresholds", True, at, calibrated=False)
    none = Flag("high_uncertainty", 0.0, "no uncertainty recorded", False, at, calibrated=False)
    assert calibration_basis(fixed) is None and calibration_basis(none) is None
    assert not needs_recalibration(none, {"": (100, at + 5)})
    assert calibration_basis(Flag("stillness", 0.0, "always moving", False, at)) is None
    with pytest.raises(ValueError, match="calibration_n: expected a count exactly when"):
        Flag("high_uncertainty", 0.0, "x", False, at, calibrated=True, calibration_revision="v")


def test_the_recalibration_decision_does_not_read_the_detail_text() -> None:
    """The detail is for people: reworded (or in another language), every decision stays the same, and a
    detail that reads like another basis does not fool it."""
    at = 100.0
    counts = {"v": (18, at + 5)}
    calibrated = {"calibrated": True, "calibration_revision": "v", "calibration_n": 9}
    provisional = {"calibrated": False, "calibration_revision": "v", "calibration_n": 9}
    for detail in (
        "peak CUSUM 1.00 ...; calibrated on 9 successful episodes of v",  # today's wording
        "Spitzenwert 1,00; kalibriert mit 9 Episoden von v",
        "not enough successful episodes of v to calibrate (3/9)",  # says provisional: the columns win
        "",
    ):
        done = Flag("high_uncertainty", 1.0, detail, False, at, **calibrated)
        assert calibration_basis(done) == ("v", 9, True)
        assert needs_recalibration(done, counts) and not needs_recalibration(done, {"v": (17, at + 5)})
        waiting = Flag("high_uncertainty", 0.0, detail, False, at, **provisional)
        assert calibration_basis(waiting) == ("v", 9, False)
        assert not needs_recalibration(waiting, {"v": (9, at + 5)}) and needs_recalibration(
            waiting, {"v": (10, at + 5)}
        )
        independent = Flag("high_uncertainty", 0.0, detail, False, at, calibrated=False)
        assert calibration_basis(independent) is None and not needs_recalibration(independent, counts)


# ------------------------------------------------------------------------------------------ fleet-judged
def _jittery(rng: np.random.Generator, t: int = 60) -> np.ndarray:
    return _smooth(t) + rng.normal(0, 0.02, (t, 2))  # jerk ratio ~1.7-1.9: above the fixed 1.2 every time


def test_jerk_is_judged_against_the_fleet_so_it_marks_the_outlier_not_everyone(tmp_path, db_url: str) -> None:
    """A fleet whose episodes are all equally jerky: the fixed rule raises ``jerk`` on every one (noise);
    judged against the task's episodes only a few are raised, and an episode far jerkier than its peers
    (alternating actions, ratio 2) still is. The first episodes are judged by the fixed rule (too few to
    calibrate) and judged again once the task has enough."""
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    rng = np.random.default_rng(0)
    first = [_record(store, _jittery(rng)) for _ in range(10)]
    refresh_flags(store, db)
    early = db.flags(first)
    assert all("jerk" in early[e] for e in first)  # too few others: the fixed threshold, as before
    f = early[first[0]]["jerk"]
    assert (f.calibrated, f.reference_n, f.threshold) == (False, 9, 1.2)
    assert f.detail.endswith("fixed threshold 1.2 (only 9 other episodes of toy; 20 calibrate)")

    rest = [_record(store, _jittery(rng)) for _ in range(30)]
    alternating = _smooth(60) + 0.05 * np.where(np.arange(60) % 2 == 0, 1.0, -1.0)[:, None]
    outlier = _record(store, alternating)
    jittery = first + rest
    assert all(jerk(store.read_episode(e, cameras=False)).raised for e in jittery)  # the fixed rule: all
    got = refresh_flags(store, db)
    assert set(first) <= set(got)  # judged again, now that the task can calibrate
    raised = db.flags([*jittery, outlier])
    assert "jerk" in raised[outlier]
    n_jerky = sum("jerk" in raised[e] for e in jittery)
    assert n_jerky <= 3, n_jerky  # the 95th percentile of 40 others: a couple at most
    f = raised[outlier]["jerk"]
    assert f.calibrated is True and f.reference_n == 40 and 1.7 < f.threshold < 2.0
    assert "95th percentile" in f.detail and "of 40 other episodes of toy (floor 1.2)" in f.detail
    assert f.to_dict()["threshold"] == f.threshold  # what the API sends with the badge
    again = db.flags([first[0]], raised_only=False)[first[0]]["jerk"]
    assert again.calibrated is True and again.reference_n == 40
    # cached: nothing to judge again until the task doubles
    assert refresh_flags(store, db) == {}
    # the other metric checks are judged the same way; takeovers is a fact and stays raised
    assert {"stillness", "length_outlier"} <= set(db.flags([outlier], raised_only=False)[outlier])
    assert db.flags([outlier], raised_only=False)[outlier]["stillness"].calibrated is True


def test_fleet_quantile_and_when_a_result_is_judged_again() -> None:
    from fleet.flag_fleet import fleet_quantile, needs_rejudging

    assert fleet_quantile(list(range(1, 101)), 0.95) == 95.0
    assert fleet_quantile([3.0], 0.95) == 3.0
    th = FlagThresholds()
    old = Flag("jerk", 1.5, "d", computed_at=10.0)  # stored before thresholds were kept
    assert needs_rejudging(old, (5, 11.0), th)
    provisional = Flag("jerk", 1.5, "d", computed_at=10.0, threshold=1.2, reference_n=9, calibrated=False)
    assert not needs_rejudging(provisional, (15, 11.0), th)  # still too few: the same answer
    assert needs_rejudging(provisional, (21, 11.0), th)
    assert not needs_rejudging(provisional, (21, 9.0), th)  # nothing closed since
    calibrated = dataclasses.replace(provisional, reference_n=40, calibrated=True)
    assert not needs_rejudging(calibrated, (60, 11.0), th) and needs_rejudging(calibrated, (81, 11.0), th)
    assert not needs_rejudging(Flag("takeovers", 1.0, "d"), (81, 11.0), th)
    with pytest.raises(ValueError, match=r"^fleet_quantile: expected a number in \(0, 1\)"):
        FlagThresholds(fleet_quantile=1.0)
    with pytest.raises(ValueError, match=r"^fleet_min_episodes: expected at most fleet_window"):
        FlagThresholds(fleet_window=10, fleet_min_episodes=20)


# ------------------------------------------------------------------------------------------ failure score
def test_failure_score_is_the_peak_over_the_policys_frames() -> None:
    p = _per_frame([0.1, 0.3, 0.8, 0.2, 0.1])
    p[:2] = np.nan  # the first chunk unscored
    f = failure_score(_episode(_smooth(10), failure=p))
    assert f.raised and f.score == pytest.approx(0.8) and f.detail == "peak failure score 0.80 (frame 4)"
    calm = failure_score(_episode(_smooth(10), failure=_per_frame([0.1, 0.3, 0.4, 0.2, 0.1])))
    assert not calm.raised and calm.score == pytest.approx(0.4)
    assert not failure_score(_episode(_smooth(10), failure=p), FlagThresholds(failure_floor=0.9)).raised
    human = dataclasses.replace(
        _episode(_smooth(10), failure=p), controller=np.array([0] * 4 + [1] * 6, np.uint8)
    )
    assert failure_score(human).score == pytest.approx(0.3)  # a human's frames are not the policy's
    for none in (None, np.full(10, np.nan)):  # recorded before the store kept it / nothing scored
        f = failure_score(_episode(_smooth(10), failure=none))
        assert (f.raised, f.score, f.detail) == (False, 0.0, "no failure score recorded")


def _failing(store: EpisodeStore, chunks: list[float] | None) -> str:
    """A policy-driven episode with these per-chunk failure scores (None: none recorded), in one batch."""
    t = 2 * len(chunks) if chunks is not None else 20
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=64)
    w.add_frames(
        {
            "cameras": {},
            "state": np.zeros((t, 2), np.float32),
            "action": _smooth(t).astype(np.float32),
            "controller": Controller.POLICY,
            "revision": "r",
            "failure": None if chunks is None else _per_frame(chunks),
        }
    )
    return w.close(outcome="success", success=True).episode_id


def test_failure_score_is_judged_against_the_fleet(tmp_path, db_url: str) -> None:
    """A policy whose predictor is always somewhat worried (peaks 0.55-0.75, above the 0.5 floor): the fixed
    rule raises every episode; judged against the task's episodes only the few above its 95th percentile
    are, and an episode the predictor was sure would fail is. An episode without scores is never raised."""
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    rng = np.random.default_rng(1)
    worried = [_failing(store, [*rng.uniform(0.3, 0.55, 8), rng.uniform(0.55, 0.75)]) for _ in range(30)]
    sure = _failing(store, [0.2, 0.4, 0.97, 0.5])
    unscored = _failing(store, None)
    assert all(failure_score(store.read_episode(e, cameras=False)).raised for e in worried)  # the fixed rule
    refresh_flags(store, db)
    raised = db.flags([*worried, sure, unscored])
    assert "failure_score" in raised[sure] and raised[unscored] == {}
    assert sum("failure_score" in raised[e] for e in worried) <= 3
    f = raised[sure]["failure_score"]
    assert f.score == pytest.approx(0.97) and f.calibrated is True and f.reference_n == 31
    assert 0.55 < f.threshold < 0.75 and "of 31 other episodes of toy (floor 0.5)" in f.detail
    none = db.flags([unscored], raised_only=False)[unscored]["failure_score"]
    assert not none.raised and none.detail.startswith("no failure score recorded")

"""Episode store, metadata DB and dataset: round trips, crash safety, concurrency, validation.

Crash and concurrency tests run real writer processes (``python -c`` importing this module) and
SIGKILL them, so what they check is what a robot host losing power to its process would leave.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from sqlalchemy import update
from sqlalchemy.orm import Session
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.db import EpisodeRow, MetadataDB, default_url
from fleet.store import Episode, EpisodeStore, EpisodeWriter

SPEC = RobotSpec(
    name="test-arm",
    state_dim=7,
    action_dim=4,
    control_hz=20.0,
    instruction="pick up the cube",
    cameras=(CameraSpec("base_camera", 32, 32), CameraSpec("hand_camera", 32, 32)),
)
TASK = "maniskill/PickCube-v1"
TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent

Frames = dict[str, Any]


def make_frames(n: int, seed: int) -> Frames:
    """Deterministic frames (an add_frames batch); every 4th frame has no proposed action and no
    uncertainty or failure score."""
    rng = np.random.default_rng(seed)
    proposed = rng.uniform(-1, 1, (n, SPEC.action_dim)).astype(np.float32)
    proposed[::4] = np.nan
    uncertainty = rng.uniform(0.2, 1.5, n).astype(np.float32)
    uncertainty[::4] = np.nan
    failure = rng.uniform(0, 1, n).astype(np.float32)
    failure[::4] = np.nan
    return {
        "cameras": {c.name: rng.integers(0, 256, (n, *c.shape), dtype=np.uint8) for c in SPEC.cameras},
        "state": rng.standard_normal((n, SPEC.state_dim), dtype=np.float32),
        "action": rng.uniform(-1, 1, (n, SPEC.action_dim)).astype(np.float32),
        "proposed_action": proposed,
        "reward": rng.standard_normal(n).astype(np.float32),
        "terminated": rng.random(n) < 0.1,
        "truncated": rng.random(n) < 0.1,
        "controller": rng.integers(0, 3, n).astype(np.uint8),
        "revision": [f"rev-{k}" if k else "" for k in rng.integers(0, 3, n)],
        "timestamp": 1.7e9 + np.cumsum(rng.uniform(0.01, 0.1, n)),
        "uncertainty": uncertainty,
        "failure": failure,
    }


def take(frames: Frames, i: int, j: int) -> Frames:
    return {k: {c: a[i:j] for c, a in v.items()} if k == "cameras" else v[i:j] for k, v in frames.items()}


def add_singly(w: EpisodeWriter, frames: Frames, i: int, j: int) -> None:
    """Frames [i, j) through add_frame, with python scalars, controller names and None proposals."""
    for t in range(i, j):
        p = frames["proposed_action"][t]
        w.add_frame(
            cameras={c: a[t] for c, a in frames["cameras"].items()},
            state=frames["state"][t],
            action=frames["action"][t],
            proposed_action=None if np.isnan(p).all() else p,
            reward=float(frames["reward"][t]),
            terminated=bool(frames["terminated"][t]),
            truncated=bool(frames["truncated"][t]),
            controller=Controller(int(frames["controller"][t])).label,
            revision=frames["revision"][t],
            timestamp=float(frames["timestamp"][t]),
            uncertainty=None if np.isnan(frames["uncertainty"][t]) else float(frames["uncertainty"][t]),
            failure=None if np.isnan(frames["failure"][t]) else float(frames["failure"][t]),
        )


def assert_frames_equal(ep: Episode, frames: Frames, n: int) -> None:
    """The episode holds exactly frames [0, n), bit for bit."""
    assert ep.length == n
    exp = take(frames, 0, n)
    for c in SPEC.camera_names:
        np.testing.assert_array_equal(ep.cameras[c], exp["cameras"][c], err_msg=c)
        assert ep.cameras[c].dtype == np.uint8
    for key in (
        "state",
        "action",
        "proposed_action",
        "reward",
        "terminated",
        "truncated",
        "controller",
        "timestamp",
        "uncertainty",
        "failure",
    ):
        got = getattr(ep, key)
        assert got.dtype == np.asarray(exp[key]).dtype, key
        # tobytes: NaN rows must match bit for bit too.
        assert got.tobytes() == np.asarray(exp[key]).tobytes(), key
    assert [ep.meta.revisions[r] for r in ep.revision] == exp["revision"]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- child processes
def child_writer(root: str, seed: int, n: int, chunk_len: int, db_url: str, wait_go: bool) -> None:
    """Write one episode in blocks, printing the committed length after every flush.

    Run in a separate process by the crash and concurrency tests. Block sizes are random (seeded)
    so that commits land both on chunk boundaries and between them.
    """
    store = EpisodeStore(root, db=MetadataDB(db_url) if db_url else None)
    frames = make_frames(n, seed)
    w = store.create_episode(
        SPEC, robot_id=f"robot-{seed}", task=TASK, chunk_len=chunk_len, episode_id=f"ep-{seed}"
    )
    w.begin_segment("autonomous", "policy")
    print("ready", flush=True)
    if wait_go:
        sys.stdin.readline()
    rng = np.random.default_rng(seed + 1000)
    i = 0
    while i < n:
        j = min(n, i + int(rng.integers(5, 40)))
        if i <= n // 2 < j:
            w.begin_segment("intervention", "human", reason="operator")
        w.add_frames(take(frames, i, j))
        print(w.flush(), flush=True)
        i = j
    w.close(outcome="success" if seed % 2 else "failure")
    print("closed", flush=True)


def spawn_writer(
    root: Path, seed: int, n: int, chunk_len: int, db_url: str = "", wait_go: bool = False
) -> subprocess.Popen[str]:
    code = f"import test_store; test_store.child_writer({str(root)!r}, {seed}, {n}, {chunk_len}, {db_url!r}, {wait_go})"
    path = [
        str(REPO),
        str(TESTS_DIR),
        os.environ.get("PYTHONPATH"),
    ]  # the last: e.g. a client package checkout
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, path))}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        assert proc.stderr is not None
        pytest.fail(f"writer exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    return line.strip()


# ---------------------------------------------------------------------- round trip
def test_round_trip_bit_exact_across_flushes_and_chunks(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path / "store", create=True)
    frames = make_frames(150, seed=1)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=64, episode_id="ep-1")
    add_singly(w, frames, 0, 10)
    w.add_frames(take(frames, 10, 30))
    assert w.committed == 0 and w.num_frames == 30
    assert w.flush() == 30  # mid-chunk commit; the next block rewrites that chunk
    assert_frames_equal(store.read_episode("ep-1"), frames, 30)  # readable while still open
    add_singly(w, frames, 30, 40)
    assert w.begin_segment("intervention", "human", reason="operator took over") == 1
    w.add_frames(take(frames, 40, 90))
    assert w.committed == 64  # the block up to the chunk boundary was written on its own
    assert w.begin_segment(SegmentKind.AUTONOMOUS, Controller.POLICY) == 2
    for i in (90, 110, 130):
        w.add_frames(take(frames, i, i + 20))
    assert w.committed == 128
    meta = w.close(outcome="success")

    assert meta.is_closed and meta.success is True and meta.length == 150
    ep = store.read_episode("ep-1")
    assert_frames_equal(ep, frames, 150)
    assert [(s.index, s.kind, s.controller, s.start, s.end, s.reason) for s in ep.meta.segments] == [
        (0, SegmentKind.AUTONOMOUS, Controller(int(frames["controller"][0])), 0, 40, None),
        (1, SegmentKind.INTERVENTION, Controller.HUMAN, 40, 90, "operator took over"),
        (2, SegmentKind.AUTONOMOUS, Controller.POLICY, 90, 150, None),
    ]
    np.testing.assert_array_equal(ep.segment, np.repeat([0, 1, 2], [40, 50, 60]).astype(np.int32))
    np.testing.assert_array_equal(ep.has_proposal, np.arange(150) % 4 != 0)
    assert (ep.meta.episode_id, ep.meta.robot_id, ep.meta.task) == ("ep-1", "r0", TASK)
    assert ep.meta.instruction == SPEC.instruction
    assert ep.meta.spec == SPEC and ep.meta.chunk_len == 64
    group = zarr.open_group(store.episodes_dir / "ep-1", mode="r")
    assert group["cameras/base_camera"].shape == (150, 32, 32, 3)  # trimmed at close
    assert group["cameras/base_camera"].chunks == (64, 32, 32, 3)
    assert store.verify() == []


def test_whole_chunks_written_directly_match_what_zarr_writes(tmp_path: Path) -> None:
    """The writer encodes whole chunks itself (bypassing zarr's setitem); every chunk file must be
    byte-identical to the one zarr writes for the same rows, across a batch that starts mid-chunk and
    spans several chunks (head and tail through zarr, the middle direct)."""
    frames = make_frames(100, seed=3)
    store = EpisodeStore(tmp_path / "store", create=True)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    w.add_frames(take(frames, 0, 5))
    w.flush()  # committed 5: the next batch starts mid-chunk
    w.add_frames(take(frames, 5, 100))  # rows 5..96 written now: head 5-16, chunks 16..96, 4 pending
    assert w.committed == 96
    w.close()
    assert_frames_equal(store.read_episode("ep"), frames, 100)
    assert store.verify() == []

    ref = EpisodeStore(tmp_path / "ref", create=True)
    r = ref.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    r._encoders = dict.fromkeys(r._encoders)  # type: ignore[assignment]  # zarr writes every row
    r.add_frames(take(frames, 0, 100))
    r.close()
    ours, theirs = store.episodes_dir / "ep", ref.episodes_dir / "ep"
    chunks = sorted(p.relative_to(theirs) for p in theirs.rglob("c/*") if p.is_file())
    # every array holds full chunks 0..5 and the partial chunk 6 (zarr skips chunks of fill values)
    assert len(chunks) >= 7 * 2 and not list(ours.rglob("*.partial"))
    for rel in chunks:
        assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel


def test_resume_removes_chunk_temporaries_of_a_killed_writer(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(40, seed=4)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    w.add_frames(take(frames, 0, 20))
    # what a writer killed between writing a chunk's temporary and renaming it leaves behind
    stray = store.episodes_dir / "ep" / "cameras" / "base_camera" / "c" / "1" / "0" / "0" / "0.abc.partial"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"torn")
    del w
    r = store.resume_episode("ep")
    assert not stray.exists()
    r.add_frames(take(frames, 16, 40))
    r.close()
    assert_frames_equal(store.read_episode("ep"), frames, 40)


def test_context_manager_aborts_and_defaults(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(5, seed=2)
    with (
        pytest.raises(RuntimeError, match="boom"),
        store.create_episode(SPEC, robot_id="r/0 x", task=TASK) as w,
    ):
        w.add_frame(
            cameras={c: a[0] for c, a in frames["cameras"].items()},
            state=frames["state"][0],
            action=frames["action"][0],
        )
        raise RuntimeError("boom")
    (eid,) = store.episode_ids()
    assert re.fullmatch(r"\d{8}T\d{6}Z-r_0_x-[0-9a-f]{8}", eid)
    ep = store.read_episode(eid)
    assert (ep.meta.status, ep.meta.outcome, ep.meta.success, ep.length) == ("closed", "aborted", False, 1)
    assert ep.controller.tolist() == [Controller.POLICY]
    assert ep.revision.tolist() == [0] and ep.meta.revisions == ("",)
    assert np.isnan(ep.proposed_action).all() and ep.reward.tolist() == [0.0]
    with pytest.raises(RuntimeError, match="closed"):
        w.flush()
    with pytest.raises(ValueError, match="already exists"):
        store.create_episode(SPEC, robot_id="r0", task=TASK, episode_id=eid)
    with pytest.raises(FileNotFoundError, match="create=True"):
        EpisodeStore(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="maps fds to paths through /proc")
def test_fsync_syncs_data_before_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fsync=True, every chunk file a block wrote is fsynced before commit.json is replaced."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = EpisodeStore(tmp_path, create=True, fsync=True)
    frames = make_frames(40, seed=7)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    synced.clear()
    w.add_frames(take(frames, 0, 20))  # writes and commits rows [0, 16): chunk 0 of every array
    commit_at = next(i for i, p in enumerate(synced) if ".commit.json." in p)
    before = {str(Path(p).relative_to(store.episodes_dir.resolve() / "ep")) for p in synced[:commit_at]}
    assert {"state/c/0/0", "cameras/base_camera/c/0/0/0/0", "timestamp/c/0", "state/zarr.json"} <= before
    w.close()
    assert_frames_equal(store.read_episode("ep"), frames, 20)


# ---------------------------------------------------------------------- crash safety
@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_sigkilled_writer_leaves_only_committed_frames(tmp_path: Path, seed: int) -> None:
    root = tmp_path / "store"
    EpisodeStore(root, create=True)
    n, chunk_len = 3000, 16
    proc = spawn_writer(root, seed, n, chunk_len)
    rng = np.random.default_rng(seed)
    try:
        assert read_line(proc) == "ready"
        reported = [int(read_line(proc)) for _ in range(int(rng.integers(2, 8)))]
        time.sleep(rng.uniform(0, 0.02))  # a seeded random moment while it writes later blocks
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    store = EpisodeStore(root)
    assert store.verify() == []
    ep = store.read_episode(f"ep-{seed}")
    assert ep.meta.status == "open"
    # Every acknowledged frame survived; nothing beyond a real commit point is visible.
    assert ep.length >= reported[-1]
    assert ep.length % chunk_len == 0 or ep.length in _flush_points(seed, n)
    assert_frames_equal(ep, make_frames(n, seed), ep.length)
    assert store.info()["open_episodes"] == 1
    assert list(store.iter_episodes()) == []


def _flush_points(seed: int, n: int) -> set[int]:
    """Lengths child_writer commits with flush() (it also commits at every chunk boundary)."""
    rng = np.random.default_rng(seed + 1000)
    out, i = set(), 0
    while i < n:
        i = min(n, i + int(rng.integers(5, 40)))
        out.add(i)
    return out


def test_uncommitted_trailing_rows_are_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What a kill between writing data and committing leaves: rows past the commit, which readers skip."""
    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(40, seed=3)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    w.add_frames(take(frames, 0, 40))
    assert w.flush() == 40
    group = zarr.open_group(store.episodes_dir / "ep", mode="r+")
    for key in ("state", "action", "reward", "cameras/base_camera"):
        arr = group[key]
        assert isinstance(arr, zarr.Array)
        arr.resize((70, *arr.shape[1:]))
        arr[40:70] = 7
    with caplog.at_level(logging.INFO, logger="fleet.store"):
        assert store.verify() == []
    assert "uncommitted" in caplog.text
    assert_frames_equal(store.read_episode("ep"), frames, 40)


# ---------------------------------------------------------------------- concurrency
def test_concurrent_writers_of_different_episodes(tmp_path: Path, db_url: str) -> None:
    root = tmp_path / "store"
    EpisodeStore(root, create=True)
    url = default_url(root) if db_url.startswith("sqlite") else db_url
    seeds, n = [21, 22, 23], 400
    procs = [spawn_writer(root, s, n, chunk_len=32, db_url=url, wait_go=True) for s in seeds]
    try:
        for p in procs:
            assert read_line(p) == "ready"
        for p in procs:  # release them together so their writes interleave
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            while (line := read_line(p)) != "closed":
                int(line)
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()

    store = EpisodeStore(root)
    db = MetadataDB(url)
    assert store.verify(db=db) == []
    for s in seeds:
        ep = store.read_episode(f"ep-{s}")
        assert_frames_equal(ep, make_frames(n, s), n)
        assert ep.meta.outcome == ("success" if s % 2 else "failure")
        assert [seg.kind for seg in ep.meta.segments] == [SegmentKind.AUTONOMOUS, SegmentKind.INTERVENTION]
    assert sorted(r.id for r in db.episodes(task=TASK, status="closed")) == [f"ep-{s}" for s in seeds]
    info = store.info()
    assert info["episodes"] == 3 and info["frames"] == 3 * n and info["open_episodes"] == 0
    assert info["tasks"][TASK]["success_rate"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------- validation
def _frame(frames: Frames, t: int) -> dict[str, Any]:
    return {
        "cameras": {c: a[t] for c, a in frames["cameras"].items()},
        "state": frames["state"][t],
        "action": frames["action"][t],
        "proposed_action": frames["proposed_action"][t + 1],
        "reward": 0.5,
        "controller": "policy",
        "revision": "rev-x",
        "timestamp": float(frames["timestamp"][t]),
    }


def _with(**change: Any) -> Callable[[dict[str, Any]], None]:
    def apply(f: dict[str, Any]) -> None:
        for k, v in change.items():
            if k.startswith("cam_"):
                f["cameras"][k[4:]] = v
            else:
                f[k] = v

    return apply


def _drop_camera(f: dict[str, Any]) -> None:
    del f["cameras"]["hand_camera"]


def _partial_nan(f: dict[str, Any]) -> None:
    f["proposed_action"] = np.array([0.1, np.nan, 0.2, 0.3], np.float32)


BAD_FRAMES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("cameras.base_camera", _with(cam_base_camera=np.zeros((32, 32, 3), np.float32))),
    ("cameras.hand_camera", _with(cam_hand_camera=np.zeros((16, 32, 3), np.uint8))),
    ("cameras.hand_camera", _drop_camera),
    ("cameras.extra", _with(cam_extra=np.zeros((32, 32, 3), np.uint8))),
    ("state", _with(state=np.zeros(6, np.float32))),
    ("state", _with(state=np.zeros(7, np.float64))),
    ("action", _with(action=np.array([0, np.nan, 0, 0], np.float32))),
    ("action", _with(action=[0.0, 0.0, 0.0, 0.0])),
    ("proposed_action", _partial_nan),
    ("proposed_action", _with(proposed_action=np.zeros(3, np.float32))),
    ("controller", _with(controller="robot")),
    ("controller", _with(controller=7)),
    ("reward", _with(reward=float("nan"))),
    ("reward", _with(reward="1")),
    ("timestamp", _with(timestamp=1.0)),  # earlier than the frames already buffered
    ("timestamp", _with(timestamp=float("inf"))),
    ("revision", _with(revision=3)),
    ("uncertainty", _with(uncertainty=float("inf"))),
    ("uncertainty", _with(uncertainty="high")),
    ("failure", _with(failure=1.5)),
    ("failure", _with(failure=-0.1)),
    ("failure", _with(failure=float("inf"))),
    ("failure", _with(failure="likely")),
]


def test_bad_frames_are_rejected_naming_the_field_and_change_nothing(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(70, seed=4)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep")
    w.add_frames(take(frames, 0, 20))
    w.flush()
    w.add_frames(take(frames, 20, 31))  # one more frame would complete a chunk and write it
    before = tree_bytes(tmp_path)
    for field_name, mutate in BAD_FRAMES:
        f = _frame(frames, 31)
        mutate(f)
        with pytest.raises(SpecError, match=rf"^{re.escape(field_name)}: "):
            w.add_frame(**f)
    bad_batches: list[tuple[str, Frames]] = [
        ("state", take(frames, 31, 40) | {"state": frames["state"][31:39]}),
        (
            "proposed_action",
            take(frames, 31, 40)
            | {"proposed_action": np.where(np.eye(9, 4, dtype=bool), np.nan, 1).astype(np.float32)},
        ),
        ("controller", take(frames, 31, 40) | {"controller": ["policy"] * 8 + ["robot"]}),
        ("timestamp", take(frames, 31, 40) | {"timestamp": frames["timestamp"][31:40][::-1].copy()}),
        ("revision", take(frames, 31, 40) | {"revision": ["a"] * 8}),
        ("uncertainty", take(frames, 31, 40) | {"uncertainty": frames["uncertainty"][31:39]}),
        ("failure", take(frames, 31, 40) | {"failure": frames["failure"][31:39]}),
        ("failure", take(frames, 31, 40) | {"failure": np.full(9, 2.0, np.float32)}),
        ("cameras.base_camera", take(frames, 31, 40) | {"cameras": take(frames, 30, 40)["cameras"]}),
    ]
    for field_name, batch in bad_batches:
        with pytest.raises(SpecError, match=rf"^{re.escape(field_name)}: "):
            w.add_frames(batch)
    assert tree_bytes(tmp_path) == before
    assert w.num_frames == 31 and w.committed == 20
    w.add_frames(take(frames, 31, 70))
    w.close()
    assert_frames_equal(store.read_episode("ep"), frames, 70)
    assert store.verify() == []


def test_verify_reports_damage(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(50, seed=5)
    with store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep") as w:
        w.add_frames(take(frames, 0, 50))
        w.close()
    commit = store.episodes_dir / "ep" / "commit.json"
    good = json.loads(commit.read_text())
    for change, expect in [
        ({"length": 60}, "fewer than the 60 committed"),
        ({"segments": [good["segments"][0] | {"end": 30}]}, "last segment ends at 30"),
        ({"revisions": ["only-one"]}, "revision indices"),
    ]:
        commit.write_text(json.dumps(good | change))
        problems = store.verify()
        assert any(expect in p for p in problems), problems
    commit.write_text(json.dumps(good))
    controller = zarr.open_group(store.episodes_dir / "ep", mode="r+")["controller"]
    assert isinstance(controller, zarr.Array)
    controller[3] = 9
    assert any("controller holds invalid codes [9]" in p for p in store.verify())


def test_episodes_recorded_before_uncertainty_read_none_verify_and_resume(tmp_path: Path) -> None:
    """``uncertainty`` is optional: an episode without the array (as every episode written before it
    existed) reads as None, verifies clean, and a resumed writer continues it without the array; one
    with the array verifies its values (finite or NaN)."""
    import shutil

    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(40, seed=6)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="old")
    w.add_frames(take(frames, 0, 20))
    w.flush()
    del w  # the writer went away with the episode open
    shutil.rmtree(store.episodes_dir / "old" / "uncertainty")  # recorded by an older version
    assert store.read_episode("old").uncertainty is None
    r = store.resume_episode("old")
    r.add_frames(take(frames, 20, 40))  # its scores are dropped: no array to hold them
    r.close()
    ep = store.read_episode("old")
    assert ep.uncertainty is None and ep.length == 40 and store.verify() == []
    np.testing.assert_array_equal(ep.action, frames["action"])
    with store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="new") as w:
        w.add_frames(take(frames, 0, 40) | {"uncertainty": None})  # nothing scored: all NaN
    got = store.read_episode("new").uncertainty
    assert got is not None and got.dtype == np.float32 and np.isnan(got).all() and len(got) == 40
    arr = zarr.open_group(store.episodes_dir / "new", mode="r+")["uncertainty"]
    assert isinstance(arr, zarr.Array)
    arr[3] = np.inf
    assert store.verify() == ["new: uncertainty has inf in committed frames"]


def test_episodes_recorded_before_failure_read_nan_verify_and_resume(tmp_path: Path) -> None:
    """``failure`` is optional: an episode without the array (written before it existed) reads as all NaN,
    verifies clean and is resumed without it; one with the array verifies its scores are in [0, 1]."""
    import shutil

    store = EpisodeStore(tmp_path, create=True)
    frames = make_frames(40, seed=7)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="old")
    w.add_frames(take(frames, 0, 20))
    w.flush()
    del w  # the writer went away with the episode open
    shutil.rmtree(store.episodes_dir / "old" / "failure")  # recorded by an older version
    r = store.resume_episode("old")
    r.add_frames(take(frames, 20, 40))  # its failure scores are dropped: no array to hold them
    r.close()
    ep = store.read_episode("old")
    assert ep.failure is not None and ep.failure.dtype == np.float32 and len(ep.failure) == 40
    f5 = ep.frame(5).failure
    assert np.isnan(ep.failure).all() and f5 is not None and np.isnan(f5)
    np.testing.assert_array_equal(ep.uncertainty, frames["uncertainty"])  # the other score is kept
    assert not (store.episodes_dir / "old" / "failure").exists() and store.verify() == []
    with store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="new") as w:
        w.add_frames(take(frames, 0, 40))
    got = store.read_episode("new")
    assert got.failure is not None and got.failure.tobytes() == frames["failure"].tobytes()
    assert got.frame(1).failure == pytest.approx(float(frames["failure"][1]))
    arr = zarr.open_group(store.episodes_dir / "new", mode="r+")["failure"]
    assert isinstance(arr, zarr.Array)
    arr[3] = 1.5
    assert store.verify() == ["new: failure has scores outside [0, 1] in committed frames"]


# ---------------------------------------------------------------------- metadata DB
def test_metadata_db_records_episodes_segments_labels(tmp_path: Path, db_url: str) -> None:
    root = tmp_path / "store"
    EpisodeStore(root, create=True)
    sqlite = db_url.startswith("sqlite")
    db = MetadataDB.for_store(root) if sqlite else MetadataDB(db_url)
    store = EpisodeStore(root, db=db)
    if sqlite:
        assert (root / "metadata.db").exists()
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    frames = make_frames(30, seed=6)
    w = store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=16, episode_id="ep-a")
    rec = db.episode("ep-a")
    assert rec is not None and rec.status == "open" and rec.store_path == str(root.absolute())
    w.add_frames(take(frames, 0, 10))
    w.begin_segment("intervention", "human", reason="slipped")
    w.add_frames(take(frames, 10, 30))
    w.close(outcome="failure")
    rec = db.episode("ep-a")
    assert rec is not None
    assert (rec.status, rec.outcome, rec.success, rec.length) == ("closed", "failure", False, 30)
    assert set(rec.revisions) == set(frames["revision"])
    assert [(s.kind, s.controller, s.start, s.end, s.reason) for s in rec.segments] == [
        (SegmentKind.AUTONOMOUS, Controller(int(frames["controller"][0])), 0, 10, None),
        (SegmentKind.INTERVENTION, Controller.HUMAN, 10, 30, "slipped"),
    ]
    with store.create_episode(SPEC, robot_id="r1", task="other/task", episode_id="ep-b") as w2:
        w2.add_frames(take(frames, 0, 5))
        w2.close("success")

    first = db.add_label("ep-a", "quality", "bad", author="alice", segment_index=1)
    db.add_label("ep-a", "quality", {"score": 0.9}, author="bob")  # a relabel adds, never overwrites
    db.add_label("ep-b", "note", "ok", author="alice")
    assert [(lb.author, lb.value, lb.segment_index) for lb in db.labels("ep-a", key="quality")] == [
        ("alice", "bad", 1),
        ("bob", {"score": 0.9}, None),
    ]
    assert db.labels(key="note")[0].episode_id == "ep-b" and db.labels()[0].id == first
    with pytest.raises(KeyError):
        db.add_label("nope", "k", 1, author="x")
    assert [r.id for r in db.episodes(task=TASK)] == ["ep-a"]
    assert [r.id for r in db.episodes(success=True)] == ["ep-b"]
    assert store.verify(db=db) == []

    with Session(db.engine) as s, s.begin():
        s.execute(update(EpisodeRow).where(EpisodeRow.id == "ep-a").values(length=29, outcome="success"))
    problems = store.verify(db=db)
    assert any("DB length 29" in p for p in problems) and any("DB outcome 'success'" in p for p in problems)
    assert any("no DB row" in p for p in store.verify(db=MetadataDB(f"sqlite:///{tmp_path / 'empty.db'}")))


# ---------------------------------------------------------------------- dataset
def test_chunk_dataset_pads_at_episode_end(tmp_path: Path) -> None:
    # Imported here, not at the top: writer child processes import this module and should not pay for torch.
    import torch

    from fleet.dataset import ChunkDataset, iter_episode_tensors

    store = EpisodeStore(tmp_path, create=True)
    lengths = [10, 3]
    all_frames = []
    for k, n in enumerate(lengths):
        frames = make_frames(n, seed=30 + k)
        all_frames.append(frames)
        with store.create_episode(SPEC, robot_id="r0", task=TASK, chunk_len=4, episode_id=f"ep-{k}") as w:
            w.add_frames(frames)
            w.close()
    store.create_episode(SPEC, robot_id="r0", task=TASK, episode_id="ep-open").add_frames(make_frames(2, 9))

    ds = ChunkDataset(store, horizon=4)
    assert len(ds) == 13 and ds.episode_ids == ["ep-0", "ep-1"]
    a0 = all_frames[0]["action"]
    s = ds[8]  # frame 8 of 10: two real actions, then the last one repeated
    np.testing.assert_array_equal(s["action"].numpy(), a0[[8, 9, 9, 9]])
    assert s["action_is_pad"].tolist() == [False, False, True, True]
    assert (int(s["episode_index"]), int(s["frame_index"])) == (0, 8)
    assert ds[0]["action_is_pad"].tolist() == [False] * 4
    s = ds[10]  # first frame of the 3-frame episode
    np.testing.assert_array_equal(s["action"].numpy(), all_frames[1]["action"][[0, 1, 2, 2]])
    assert s["action_is_pad"].tolist() == [False, False, False, True]
    assert (int(s["episode_index"]), int(s["frame_index"])) == (1, 0)
    np.testing.assert_array_equal(s["observation.state"].numpy(), all_frames[1]["state"][0])
    img = s["observation.images.base_camera"]
    assert img.dtype == torch.uint8 and img.shape == (32, 32, 3)
    np.testing.assert_array_equal(img.numpy(), all_frames[1]["cameras"]["base_camera"][0])
    assert int(s["controller"]) == int(all_frames[1]["controller"][0])
    assert ds[-1]["action_is_pad"].tolist() == [False, True, True, True]

    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert batch["action"].shape == (5, 4, SPEC.action_dim)
    assert batch["observation.images.hand_camera"].shape == (5, 32, 32, 3)

    eps = list(iter_episode_tensors(store, closed_only=False))
    assert [e["episode_id"] for e in eps] == ["ep-0", "ep-1", "ep-open"]
    assert eps[1]["cameras"]["hand_camera"].shape == (3, 32, 32, 3)
    assert eps[1]["action"].dtype == torch.float32


def test_store_root_is_one_zarr_hierarchy(tmp_path: Path) -> None:
    """Generic Zarr tools reach every episode from the root; older stores get the missing group
    document on open, idempotently, and racing creators neither fail nor tear it."""
    import threading

    from fleet.store.layout import _create_group_doc

    store = EpisodeStore(tmp_path / "s", create=True)
    frames = make_frames(5, 0)
    w = store.create_episode(SPEC, robot_id="r", task=TASK, episode_id="e1")
    w.add_frames(frames)
    w.close()
    root = zarr.open_group(tmp_path / "s", mode="r")
    assert root.attrs["format"] == "vla-rl-episode-store"
    assert np.array_equal(root["episodes"]["e1"]["action"][:], frames["action"])

    doc = store.episodes_dir / "zarr.json"
    doc.unlink()  # a store written before the episodes/ group document existed
    assert "episodes" not in zarr.open_group(tmp_path / "s", mode="r")
    EpisodeStore(tmp_path / "s")
    text, mtime = doc.read_text(), doc.stat().st_mtime_ns
    assert json.loads(text) == {"zarr_format": 3, "node_type": "group", "attributes": {}}
    EpisodeStore(tmp_path / "s")  # opening again changes nothing
    assert (doc.read_text(), doc.stat().st_mtime_ns) == (text, mtime)
    assert np.array_equal(zarr.open_group(tmp_path / "s", mode="r")["episodes/e1/state"][:], frames["state"])

    doc.unlink()
    created: list[bool] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        created.append(_create_group_doc(store.episodes_dir, {"zarr_format": 3, "node_type": "group"}))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(created) == [False] * 7 + [True]
    assert json.loads(doc.read_text())["node_type"] == "group"
    assert sorted(p.name for p in store.episodes_dir.iterdir()) == ["e1", "zarr.json"]  # no temporaries
    assert store.verify() == []

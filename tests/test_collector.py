"""Fleet collector: exactly-once delivery under faults, bad input, auth, backpressure, accounting.

Real gRPC on loopback, real Zarr stores and SQLite DBs in tmp_path. The fault tests run the collector
(`vla-rl collect`) and 8 synthetic robots as separate processes, SIGKILL the collector mid-stream and
restart it, and check by per-frame content hashes that the store holds every frame the robots produced
exactly once; a TCP proxy cuts a robot's connection mid-episode. Frames are small (16x16 cameras) so
the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
from vla_rl_client.codec import to_tensor
from vla_rl_client.frame import Frame
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.proto import collector_pb2_grpc as pb_grpc
from vla_rl_client.robot_client import RobotClient
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.collector import Collector, CollectorConfig
from fleet.collector.config import MB
from fleet.collector.writers import _ProcessWriter
from fleet.store import EpisodeStore
from fleet.wal import WriteAheadLog
from sim.fleet_records import read_records
from sim.synthetic_robot import SyntheticRobotConfig, synthetic_robot_main
from vla_rl.cli.common import open_db

TOKEN = "collector-test-token"
SPEC = RobotSpec("arm", 5, 3, 30.0, "push the cube", cameras=(CameraSpec("front", 16, 16),))
REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that runs this checkout's code: the repo first on its path, then
    whatever this process's PYTHONPATH holds (e.g. a client package checkout beside the installed one)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


SC = grpc.StatusCode


# ------------------------------------------------------------------------------------------ helpers
def store_digests(root: Path) -> collections.Counter[tuple[str, int, str]]:
    """(episode, seq, content hash) of every committed frame in the store."""
    store = EpisodeStore(root)
    out: collections.Counter[tuple[str, int, str]] = collections.Counter()
    for eid in store.episode_ids():
        ep = store.read_episode(eid)
        for i in range(ep.length):
            out[(eid, i, ep.frame(i).digest())] += 1
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_stream(address: str, token: str | None = TOKEN) -> tuple[Any, Any, Any]:
    """A bare stream to send hand-made (possibly malformed) messages: (send, recv, close)."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CollectorStub(channel)
    q: Any = __import__("queue").Queue()
    end = object()
    md = (("authorization", f"Bearer {token}"),) if token else ()
    call = stub.Stream(iter(q.get, end), metadata=md)
    it = iter(call)

    def close() -> None:
        q.put(end)
        call.cancel()
        channel.close()

    return q.put, lambda: next(it), close


def hello(robot: str = "raw-0", spec: RobotSpec = SPEC) -> pb.RobotMessage:
    return pb.RobotMessage(hello=pb.Hello(robot_id=robot, task="test/task", robot_spec_json=spec.to_json()))


def batch(eid: str, seq: int, n: int, seed: int = 0, **over: Any) -> pb.RobotMessage:
    rng = np.random.default_rng(seed)
    fb = pb.FrameBatch(episode_id=eid, seq=seq)
    fb.cameras["front"].CopyFrom(to_tensor(rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)))
    fb.state.CopyFrom(to_tensor(rng.standard_normal((n, 5), dtype=np.float32)))
    fb.action.CopyFrom(to_tensor(rng.uniform(-1, 1, (n, 3)).astype(np.float32)))
    fb.timestamp.CopyFrom(to_tensor(1000.0 + seq + np.arange(n, dtype=np.float64)))
    for k, v in over.items():
        if k == "cameras":
            fb.cameras.clear()
            for name, arr in v.items():
                fb.cameras[name].CopyFrom(to_tensor(arr))
        else:
            getattr(fb, k).CopyFrom(to_tensor(v))
    return pb.RobotMessage(frames=fb)


def segment(
    eid: str, index: int, start: int, kind: int = pb.AUTONOMOUS, ctrl: int = pb.POLICY
) -> pb.RobotMessage:
    return pb.RobotMessage(
        segment=pb.SegmentMarker(
            episode_id=eid, index=index, start=start, kind=kind, controller=ctrl, reason="r"
        )
    )


def stream_episodes(
    client: RobotClient, episodes: int, frames: int, seed: int, pace_s: float = 0.0
) -> list[tuple[str, int, str]]:
    """Episodes with a takeover in the middle; returns (episode, seq, digest) of every frame produced."""
    rng = np.random.default_rng(seed)
    out = []
    ts = 0.0
    for _ in range(episodes):
        eid = client.start_episode()
        for i in range(frames):
            if i == frames // 3:
                client.begin_segment("intervention", "human", reason="stall: test")
            if i == frames // 2:
                client.begin_segment("autonomous", "policy", reason="handback")
            ctrl = 1 if frames // 3 <= i < frames // 2 else 0
            cams = {"front": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)}
            state = rng.standard_normal(5).astype(np.float32)
            action = rng.uniform(-1, 1, 3).astype(np.float32)
            prop = action if ctrl == 0 else np.full(3, np.nan, np.float32)
            ts = max(time.time(), ts)
            frame = Frame(cams, state, action, prop, 0.5, False, False, ctrl, "rev-a", ts)
            client.add(frame)
            out.append((eid, i, frame.digest()))
            if pace_s:
                time.sleep(pace_s)
        client.end_episode("success")
    return out


# The collector's metadata DB (store_db_url): the store's SQLite and PostgreSQL both in CI where the test is
# about what reaches the DB; SQLITE_ONLY where the DB plays no part (auth, wire garbage); PG_SLOW where
# the PostgreSQL run repeats a long test whose DB path a CI test covers already.
SQLITE_ONLY = pytest.mark.parametrize("store_db_url", ["sqlite"], indirect=True)
PG_SLOW = pytest.mark.parametrize(
    "store_db_url", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)


@pytest.fixture
def collector(tmp_path: Path, store_db_url: str | None) -> Iterator[Collector]:
    """A collector on the store's own SQLite, or (second parameter) on a PostgreSQL database."""
    c = Collector(
        CollectorConfig(store=tmp_path / "store", db=store_db_url, port=0, chunk_len=16, idle_flush_s=0.5),
        token=TOKEN,
    ).start()
    yield c
    c.stop()


# ------------------------------------------------------------------------------------------ in process
def test_roundtrip_segments_db_and_accounting(collector: Collector) -> None:
    client = RobotClient(collector.address, "arm-1", SPEC, "test/task", token=TOKEN, max_batch_frames=4)
    sent = stream_episodes(client, episodes=2, frames=30, seed=0)
    assert client.close(30)
    assert collector.drain(30)
    got = store_digests(collector.store.root)
    assert sorted(got) == sorted(sent) and set(got.values()) == {1}
    store = collector.store
    assert store.verify(db=collector.db) == []
    for eid in store.episode_ids():
        meta = store.read_metadata(eid)
        assert meta.is_closed and meta.success and meta.robot_id == "arm-1" and meta.length == 30
        assert [(s.kind.value, s.controller.label, s.start, s.end) for s in meta.segments] == [
            ("autonomous", "policy", 0, 10),
            ("intervention", "human", 10, 15),
            ("autonomous", "policy", 15, 30),
        ]
        assert meta.segments[1].reason == "stall: test"
        ep = store.read_episode(eid, cameras=False)
        np.testing.assert_array_equal(ep.controller, [0] * 10 + [1] * 5 + [0] * 15)
        assert ep.has_proposal.tolist() == [True] * 10 + [False] * 5 + [True] * 15
        rec = collector.db.episode(eid)
        assert rec is not None and rec.status == "closed" and len(rec.segments) == 3
    assert not list((store.root / "wal").iterdir())  # logs of closed episodes are gone
    stats = {r.robot_id: r for r in collector.stats().robots}
    a = stats["arm-1"]
    assert (a.frames_received, a.frames_committed, a.frames_stored, a.frames_rejected) == (60, 60, 60, 0)
    assert a.episodes_closed == 2
    text = collector.stats().prometheus_text
    assert 'vla_rl_collector_frames_committed_total{robot="arm-1"} 60.0' in text
    assert 'vla_rl_collector_episodes_closed_total{outcome="success",robot="arm-1"} 2.0' in text


def test_uncertainty_round_trip_rejects_and_old_style_batches(collector: Collector) -> None:
    """Per-frame chunk scores travel robot -> collector -> store (NaN kept for unscored frames); a bad
    uncertainty tensor is refused naming the field; a batch without one (an older client) is stored with
    an all-NaN array."""
    client = RobotClient(collector.address, "arm-u", SPEC, "test/task", token=TOKEN, max_batch_frames=4)
    rng = np.random.default_rng(3)
    scores = np.repeat(rng.uniform(0.2, 1.5, 15).astype(np.float32), 2)  # one score per 2-frame chunk
    scores[10:16] = np.nan  # a human's frames: no chunk
    cam = {"front": np.zeros((16, 16, 3), np.uint8)}
    eid = client.start_episode()
    for i in range(30):
        if i == 10:
            client.begin_segment("intervention", "human", reason="test")
        if i == 16:
            client.begin_segment("autonomous", "policy", reason="handback")
        score = None if np.isnan(scores[i]) else float(scores[i])
        client.add_frame(cam, np.zeros(5, np.float32), np.zeros(3, np.float32), uncertainty=score)
    for bad_score in (np.inf, 1e39):  # 1e39: inf once sent as float32
        with pytest.raises(SpecError, match=r"^uncertainty: expected a finite float32 score"):
            client.add_frame(cam, np.zeros(5, np.float32), np.zeros(3, np.float32), uncertainty=bad_score)
    client.end_episode("success")
    assert client.close(30) and client.stats.rejects == 0

    send, recv, close = raw_stream(collector.address)
    send(hello())
    assert recv().WhichOneof("body") == "welcome"
    send(pb.RobotMessage(start=pb.StartEpisode(episode_id="old-style")))
    assert recv().ack.committed == 0
    send(segment("old-style", 0, 0))
    assert recv().ack.segments == 1
    for bad, text in (
        (np.zeros(2, np.float64), "frames.uncertainty: expected dtype float32"),
        (np.zeros((2, 1), np.float32), "frames.uncertainty: expected shape [2]"),
        (np.zeros(3, np.float32), "frames.uncertainty: expected a tensor of at most 8 non-negative dims"),
        (np.array([0.5, np.inf], np.float32), "frames.uncertainty: expected finite scores, or NaN"),
    ):
        send(batch("old-style", 0, 2, uncertainty=bad))
        r = recv()
        assert r.WhichOneof("body") == "reject" and r.reject.code == SC.INVALID_ARGUMENT.value[0], r
        assert text in r.reject.message, r.reject.message
    send(batch("old-style", 0, 4))  # no uncertainty field at all
    assert recv().ack.committed == 4
    send(pb.RobotMessage(end=pb.EndEpisode(episode_id="old-style", length=4, outcome="success")))
    assert recv().ack.ended
    close()
    assert collector.drain(30)
    store = collector.store
    ep = store.read_episode(eid, cameras=False)
    assert ep.uncertainty is not None and ep.uncertainty.dtype == np.float32
    np.testing.assert_allclose(ep.uncertainty, scores, rtol=1e-6)  # NaN where NaN was sent
    assert np.isnan(ep.uncertainty[10:16]).all() and np.isfinite(ep.uncertainty[:10]).all()
    old = store.read_episode("old-style", cameras=False)
    assert old.uncertainty is not None and len(old.uncertainty) == 4 and np.isnan(old.uncertainty).all()
    assert store.verify(db=collector.db) == []


def test_failure_round_trip_rejects_and_old_style_batches(collector: Collector) -> None:
    """Per-frame learned failure scores travel robot -> collector -> store (NaN kept for unscored frames);
    a bad score is refused naming the field, by the client and by the collector; a batch without the field
    (an older client) is stored as all NaN."""
    client = RobotClient(collector.address, "arm-f", SPEC, "test/task", token=TOKEN, max_batch_frames=4)
    rng = np.random.default_rng(4)
    scores = np.repeat(rng.uniform(0, 1, 15).astype(np.float32), 2)  # one score per 2-frame chunk
    scores[10:16] = np.nan  # a human's frames: no chunk
    cam = {"front": np.zeros((16, 16, 3), np.uint8)}
    eid = client.start_episode()
    for i in range(30):
        if i == 10:
            client.begin_segment("intervention", "human", reason="test")
        if i == 16:
            client.begin_segment("autonomous", "policy", reason="handback")
        p = None if np.isnan(scores[i]) else float(scores[i])
        client.add_frame(cam, np.zeros(5, np.float32), np.zeros(3, np.float32), uncertainty=0.5, failure=p)
    for bad, text in (
        (1.5, r"^failure: expected a score in \[0, 1\]"),
        ("x", r"^failure: expected a number"),
    ):
        with pytest.raises(SpecError, match=text):
            client.add_frame(cam, np.zeros(5, np.float32), np.zeros(3, np.float32), failure=bad)
    client.end_episode("success")
    assert client.close(30) and client.stats.rejects == 0

    send, recv, close = raw_stream(collector.address)
    send(hello())
    assert recv().WhichOneof("body") == "welcome"
    send(pb.RobotMessage(start=pb.StartEpisode(episode_id="old-style")))
    assert recv().ack.committed == 0
    send(segment("old-style", 0, 0))
    assert recv().ack.segments == 1
    for bad_t, text in (
        (np.zeros(2, np.float64), "frames.failure: expected dtype float32"),
        (np.zeros(3, np.float32), "frames.failure: expected a tensor of at most 8 non-negative dims"),
        (np.array([0.5, 1.5], np.float32), "frames.failure: expected scores in [0, 1], or NaN"),
        (np.array([np.inf, 0.5], np.float32), "frames.failure: expected scores in [0, 1], or NaN"),
    ):
        send(batch("old-style", 0, 2, failure=bad_t))
        r = recv()
        assert r.WhichOneof("body") == "reject" and r.reject.code == SC.INVALID_ARGUMENT.value[0], r
        assert text in r.reject.message, r.reject.message
    send(batch("old-style", 0, 4, uncertainty=np.full(4, 0.3, np.float32)))  # no failure field at all
    assert recv().ack.committed == 4
    send(pb.RobotMessage(end=pb.EndEpisode(episode_id="old-style", length=4, outcome="success")))
    assert recv().ack.ended
    close()
    assert collector.drain(30)
    store = collector.store
    ep = store.read_episode(eid, cameras=False)
    assert ep.failure is not None and ep.failure.dtype == np.float32
    np.testing.assert_allclose(ep.failure, scores, rtol=1e-6)  # NaN where NaN was sent
    assert np.isnan(ep.failure[10:16]).all() and np.isfinite(ep.failure[:10]).all()
    old = store.read_episode("old-style", cameras=False)
    assert old.failure is not None and len(old.failure) == 4 and np.isnan(old.failure).all()
    np.testing.assert_allclose(old.uncertainty, 0.3, rtol=1e-6)
    assert store.verify(db=collector.db) == []


@SQLITE_ONLY
def test_auth_required(collector: Collector, tmp_path: Path) -> None:
    for token in (None, "wrong"):
        send, recv, close = raw_stream(collector.address, token)
        send(hello())
        with pytest.raises(grpc.RpcError) as e:
            recv()
        assert e.value.code() == SC.UNAUTHENTICATED and "authorization" in e.value.details()
        close()
        with grpc.insecure_channel(collector.address) as ch:
            md = (("authorization", f"Bearer {token}"),) if token else ()
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.CollectorStub(ch).GetStats(pb.StatsRequest(), metadata=md, timeout=5)
            assert e.value.code() == SC.UNAUTHENTICATED
    with pytest.raises(ValueError, match="token"):
        Collector(CollectorConfig(store=tmp_path / "other", host="0.0.0.0", port=0))
    assert EpisodeStore(collector.store.root).episode_ids() == []


@PG_SLOW
def test_bad_input_rejected_while_other_robots_stream(collector: Collector) -> None:
    good = RobotClient(collector.address, "good-1", SPEC, "test/task", token=TOKEN, max_batch_frames=2)
    produced: list[tuple[str, int, str]] = []
    t = threading.Thread(target=lambda: produced.extend(stream_episodes(good, 3, 20, seed=1)))
    t.start()

    send, recv, close = raw_stream(collector.address)

    def reject(msg: pb.RobotMessage) -> pb.Reject:
        send(msg)
        r = recv()
        assert r.WhichOneof("body") == "reject", r
        return r.reject

    r = reject(pb.RobotMessage(start=pb.StartEpisode(episode_id="e-1")))
    assert r.code == SC.FAILED_PRECONDITION.value[0] and "hello" in r.message
    send(hello())
    assert recv().WhichOneof("body") == "welcome"
    send(pb.RobotMessage(start=pb.StartEpisode(episode_id="raw-ep")))
    assert recv().ack.committed == 0
    r = reject(batch("raw-ep", 0, 2))
    assert r.code == SC.FAILED_PRECONDITION.value[0] and "SegmentMarker 0" in r.message
    send(segment("raw-ep", 0, 0))
    assert recv().ack.segments == 1
    cases = [
        (
            batch("raw-ep", 0, 2, state=np.zeros((2, 5), np.float64)),
            SC.INVALID_ARGUMENT,
            "frames.state: expected dtype float32",
        ),
        (
            batch("raw-ep", 0, 2, state=np.zeros((2, 6), np.float32)),
            SC.INVALID_ARGUMENT,
            "frames.state: expected shape [2, 5]",
        ),
        (
            batch("raw-ep", 0, 2, cameras={"front": np.zeros((2, 8, 16, 3), np.uint8)}),
            SC.INVALID_ARGUMENT,
            "frames.cameras.front: expected shape [2, 16, 16, 3]",
        ),
        (
            batch(
                "raw-ep",
                0,
                2,
                cameras={
                    "front": np.zeros((2, 16, 16, 3), np.uint8),
                    "side": np.zeros((2, 16, 16, 3), np.uint8),
                },
            ),
            SC.INVALID_ARGUMENT,
            "frames.cameras.side",
        ),
        (
            batch("raw-ep", 0, 2, action=np.full((2, 3), np.nan, np.float32)),
            SC.INVALID_ARGUMENT,
            "frames.action: expected finite",
        ),
        (batch("raw-ep", 5, 2), SC.OUT_OF_RANGE, "frames.seq: expected 0"),
        (batch("raw-ep", 0, 65), SC.RESOURCE_EXHAUSTED, "at most 64 frames per batch"),
        (batch("nope", 0, 2), SC.NOT_FOUND, "no open episode 'nope'"),
        (segment("raw-ep", 3, 0), SC.OUT_OF_RANGE, "segment.index: expected 1"),
        (
            pb.RobotMessage(end=pb.EndEpisode(episode_id="raw-ep", length=9, outcome="success")),
            SC.FAILED_PRECONDITION,
            "end.length",
        ),
    ]
    for msg, code, text in cases:
        r = reject(msg)
        assert r.code == code.value[0] and text in r.message, (code, r.message)
    # another robot's episode is off limits (open or closed)
    t.join(60)
    other = produced[0][0]
    r = reject(pb.RobotMessage(start=pb.StartEpisode(episode_id=other)))
    assert r.code == SC.PERMISSION_DENIED.value[0] and "belongs to robot 'good-1'" in r.message
    # the stream still works after all that
    send(batch("raw-ep", 0, 3))
    a = recv().ack
    assert a.committed == 3
    r = reject(batch("raw-ep", 3, 2, timestamp=np.array([5.0, 6.0])))
    assert r.code == SC.INVALID_ARGUMENT.value[0] and "frames.timestamp: expected non-decreasing" in r.message
    close()
    assert good.close(30) and good.stats.rejects == 0
    assert collector.drain(30)
    got = store_digests(collector.store.root)
    assert all(got[k] == 1 for k in produced)
    # the open episode's tail reaches Zarr by the idle flush: the 3 good frames and none of the refused
    deadline = time.monotonic() + 10
    while (
        EpisodeStore(collector.store.root).read_metadata("raw-ep").length < 3 and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert EpisodeStore(collector.store.root).read_metadata("raw-ep").length == 3
    stats = {r.robot_id: r for r in collector.stats().robots}
    assert (
        stats["raw-0"].frames_rejected == 2 + 5 * 2 + 2 + 65 + 2 + 2 and stats["good-1"].frames_rejected == 0
    )
    assert (
        'messages_rejected_total{code="INVALID_ARGUMENT",robot="raw-0"} 6.0'
        in collector.stats().prometheus_text
    )


def test_bad_settings_name_the_field_and_create_nothing(tmp_path: Path) -> None:
    for kw, field_name in (
        ({"store_writers": -1}, "store_writers"),
        ({"store_writer_nice": 20}, "store_writer_nice"),
    ):
        with pytest.raises(ValueError, match=field_name):
            CollectorConfig(store=tmp_path / "s", port=0, **kw)  # type: ignore[arg-type]
        assert not (tmp_path / "s").exists()


def test_allow_list(tmp_path: Path) -> None:
    with Collector(CollectorConfig(store=tmp_path / "s", port=0, robots="arm-1"), token=TOKEN) as c:
        send, recv, close = raw_stream(c.address)
        send(hello("intruder"))
        r = recv().reject
        assert r.code == SC.PERMISSION_DENIED.value[0] and "'intruder' is not a known robot" in r.message
        send(hello("arm-1"))
        assert recv().WhichOneof("body") == "welcome"
        close()


@PG_SLOW
def test_duplicates_and_overlaps_are_dropped(collector: Collector) -> None:
    send, recv, close = raw_stream(collector.address)
    send(hello())
    recv()
    send(pb.RobotMessage(start=pb.StartEpisode(episode_id="dup")))
    recv()
    send(segment("dup", 0, 0))
    recv()
    first = batch("dup", 0, 5, seed=1)
    send(first)
    assert recv().ack.committed == 5
    send(first)  # a resend after a lost ack
    a = recv().ack
    assert (a.committed, a.duplicates) == (5, 5)
    over = batch("dup", 3, 5, seed=2)  # frames 3, 4 again + 3 new ones
    send(over)
    a = recv().ack
    assert (a.committed, a.duplicates) == (8, 2)
    send(segment("dup", 0, 0))  # a resent marker
    assert recv().ack.segments == 1
    send(pb.RobotMessage(end=pb.EndEpisode(episode_id="dup", length=8, outcome="failure")))
    assert recv().ack.ended
    close()
    assert collector.drain(30)
    ep = EpisodeStore(collector.store.root).read_episode("dup")
    rng1, rng2 = np.random.default_rng(1), np.random.default_rng(2)
    cams1 = rng1.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    cams2 = rng2.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    np.testing.assert_array_equal(ep.cameras["front"], np.concatenate([cams1, cams2[2:]]))
    assert ep.meta.outcome == "failure" and ep.meta.success is False
    # after the close, a resend of the whole episode is acknowledged as closed and stores nothing
    send, recv, close = raw_stream(collector.address)
    send(hello())
    recv()
    send(pb.RobotMessage(start=pb.StartEpisode(episode_id="dup")))
    a = recv().ack
    assert a.closed and a.committed == 8
    send(first)
    assert recv().ack.duplicates == 5
    close()
    assert EpisodeStore(collector.store.root).read_metadata("dup").length == 8


def test_backpressure_slows_robots_without_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fleet.store_writer

    slow = fleet.store_writer.apply_record

    def slow_apply(w: Any, raw: bytes) -> bool:
        time.sleep(0.02)
        return slow(w, raw)

    # store_writers=0: the writer runs in this process, so the slow-down applies to it
    monkeypatch.setattr(fleet.store_writer, "apply_record", slow_apply)
    with Collector(
        CollectorConfig(store=tmp_path / "s", port=0, max_pending_mb=1 / MB, chunk_len=8, store_writers=0),
        token=TOKEN,
    ) as c:
        client = RobotClient(
            c.address, "arm-1", SPEC, "t", token=TOKEN, max_batch_frames=1, batch_interval_s=0
        )
        sent = stream_episodes(client, 1, 40, seed=3)
        assert client.close(60)
        assert c.drain(30)
        assert sorted(store_digests(c.store.root)) == sorted(sent)
        text = c.stats().prometheus_text
        waited = float(
            next(
                line.split()[-1]
                for line in text.splitlines()
                if line.startswith("vla_rl_collector_backpressure_seconds_total")
            )
        )
        assert waited > 0.1


@PG_SLOW
def test_killed_store_writer_is_restarted_and_every_frame_lands_once(
    tmp_path: Path, store_db_url: str | None
) -> None:
    """SIGKILL the store writer processes three times while 4 robots stream: each restart replays the logs
    from the Zarr commits; every frame is stored exactly once and nothing else appears."""
    c = Collector(
        CollectorConfig(store=tmp_path / "s", db=store_db_url, port=0, chunk_len=8, store_writers=2),
        token=TOKEN,
    ).start()
    try:
        sent: list[tuple[str, int, str]] = []
        clients = [
            RobotClient(c.address, f"arm-{i}", SPEC, "t", token=TOKEN, max_batch_frames=4) for i in range(4)
        ]
        threads = [
            threading.Thread(target=lambda cl=cl, i=i: sent.extend(stream_episodes(cl, 3, 80, i, 0.02)))
            for i, cl in enumerate(clients)
        ]
        for t in threads:
            t.start()

        def stored() -> int:
            return sum(a.frames_stored for a in c.accounts.values())

        open_at_kill: list[int] = []
        for k in (0, 1, 0):  # kill mid-stream, each time once the writers have stored more frames
            before, deadline = stored(), time.monotonic() + 30
            while stored() < before + 16 and time.monotonic() < deadline:
                time.sleep(0.01)
            victim = c._writers[k]
            assert isinstance(victim, _ProcessWriter)
            with c._episodes_lock:
                open_at_kill.append(sum(ep.writer == k for ep in c._episodes.values()))
            victim.kill()
            deadline = time.monotonic() + 30
            while c._writers[k] is victim and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c._writers[k] is not victim, "the dead writer was not replaced"
        # the writers (restarted ones too) run below the intake's priority, so acks win busy cores
        want = min(19, os.nice(0) + 10)
        for w in c._writers:
            assert isinstance(w, _ProcessWriter)
            deadline = time.monotonic() + 30  # a fresh writer lowers its priority once it has started
            while psutil.Process(w.proc.pid).nice() != want and time.monotonic() < deadline:
                time.sleep(0.05)
            assert psutil.Process(w.proc.pid).nice() == want
        assert min(open_at_kill) > 0, open_at_kill  # each writer died with episodes half written
        for t in threads:
            t.join(120)
        assert all(cl.close(60) for cl in clients)
        assert c.drain(60)
        assert collections.Counter(sent) == store_digests(c.store.root)  # exactly once, no phantoms
        assert len(sent) == 4 * 3 * 80
        assert c.store.verify(db=c.db) == []
        assert not list((c.store.root / "wal").glob("*.wal"))  # every episode closed, its log deleted
        for a in c.accounts.values():
            assert a.frames_stored == a.frames_committed == 240 and a.episodes_closed == 3
        assert "vla_rl_collector_store_writer_restarts_total 3.0" in c.stats().prometheus_text
    finally:
        c.stop()


def test_store_writer_dying_again_and_again_fails_loudly(tmp_path: Path) -> None:
    """Past 5 deaths a minute the writer is not restarted: its episodes' streams get UNAVAILABLE (no silent
    acks of frames nobody will write), and the next collector replays what was acknowledged."""
    root = tmp_path / "s"
    c = Collector(CollectorConfig(store=root, port=0, chunk_len=8), token=TOKEN).start()
    try:
        send, recv, close = raw_stream(c.address)
        send(hello())
        send(pb.RobotMessage(start=pb.StartEpisode(episode_id="doomed")))
        send(segment("doomed", 0, 0))
        send(batch("doomed", 0, 4))
        assert [recv().WhichOneof("body") for _ in range(4)] == ["welcome", "ack", "ack", "ack"]
        c._writer_deaths = [time.monotonic()] * 5  # as if it had died five times already
        victim = c._writers[0]
        assert isinstance(victim, _ProcessWriter)
        victim.kill()
        deadline = time.monotonic() + 30
        while 0 not in c._dead_writers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c._writers[0] is victim  # not restarted
        send(batch("doomed", 4, 4))
        with pytest.raises(grpc.RpcError) as err:
            recv()
        assert err.value.code() == SC.UNAVAILABLE
        close()
    finally:
        c.stop()
    with Collector(CollectorConfig(store=root, port=0, chunk_len=8), token=TOKEN) as c2:
        assert c2.drain(30)
        send, recv, close = raw_stream(c2.address)
        send(hello())
        send(pb.RobotMessage(start=pb.StartEpisode(episode_id="doomed")))
        assert [recv().WhichOneof("body") for _ in range(2)] == ["welcome", "ack"]
        close()
    assert EpisodeStore(root).read_metadata("doomed").length == 4  # flushed on stop, from the log


def test_client_buffers_offline_until_the_collector_starts(tmp_path: Path) -> None:
    port = free_port()
    client = RobotClient(
        f"127.0.0.1:{port}", "arm-1", SPEC, "t", token=TOKEN, reconnect_backoff_s=(0.05, 0.2)
    )
    sent = stream_episodes(client, 2, 12, seed=4)
    assert not client.flush(0.5) and client.stats.pending_frames == 24
    with Collector(CollectorConfig(store=tmp_path / "s", port=port), token=TOKEN) as c:
        assert client.close(30)
        assert c.drain(30)
        assert sorted(store_digests(c.store.root)) == sorted(sent)


def test_buffer_full_raises_instead_of_dropping(tmp_path: Path) -> None:
    from vla_rl_client.robot_client import BufferFull

    client = RobotClient(f"127.0.0.1:{free_port()}", "arm-1", SPEC, "t", max_buffer_bytes=4000, block_s=0.2)
    client.start_episode()
    with pytest.raises(BufferFull, match="wait for the collector"):
        for _ in range(100):
            client.add_frame(
                {"front": np.zeros((16, 16, 3), np.uint8)}, np.zeros(5, np.float32), np.zeros(3, np.float32)
            )
    assert client.stats.frames_added < 100
    client.close(0.1)


def test_drain_returns_once_ended_episodes_are_closed_in_the_db(tmp_path: Path) -> None:
    """drain() waits for the metadata DB's row too, not only for the log to be applied: the store writer's
    last report releases the log first, then the collector records the close (slowed down here)."""
    with Collector(
        CollectorConfig(store=tmp_path / "s", port=0, chunk_len=8, store_writers=0), token=TOKEN
    ) as c:
        record = c.db.record_episode_closed

        def slow_record(meta: Any) -> None:
            time.sleep(0.5)
            record(meta)

        c.db.record_episode_closed = slow_record  # type: ignore[method-assign]
        client = RobotClient(c.address, "arm-1", SPEC, "t", token=TOKEN)
        eid = client.start_episode()
        for _ in range(5):
            client.add_frame(
                {"front": np.zeros((16, 16, 3), np.uint8)}, np.zeros(5, np.float32), np.zeros(3, np.float32)
            )
        client.end_episode("success")
        assert client.close(30)
        assert c.drain(30)
        rec = c.db.episode(eid)
        assert rec is not None and (rec.status, rec.length) == ("closed", 5)


def test_recovery_replays_the_log_and_cuts_a_torn_tail(tmp_path: Path, store_db_url: str | None) -> None:
    """Frames acknowledged but not yet in Zarr survive a crash; a half-written record is cut off; the
    recovered episode's DB row closes with it."""
    root = tmp_path / "s"
    c = Collector(CollectorConfig(store=root, db=store_db_url, port=0, chunk_len=64), token=TOKEN).start()
    client = RobotClient(c.address, "arm-1", SPEC, "t", token=TOKEN)
    rng = np.random.default_rng(5)
    eid = client.start_episode(episode_id="crash-ep")
    sent = []
    for i in range(20):
        cams, state, action = (
            {"front": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)},
            rng.standard_normal(5).astype(np.float32),
            rng.uniform(-1, 1, 3).astype(np.float32),
        )
        client.add_frame(cams, state, action, timestamp=2000.0 + i, uncertainty=0.1 * i if i % 3 else None)
        sent.append(Frame(cams, state, action, controller=0, timestamp=2000.0 + i).digest())
    assert client.flush(30)
    assert EpisodeStore(root).read_metadata(eid).length == 0  # acknowledged, only in the log (chunk of 64)
    # "crash": the server and its store writer go away without writing their buffers, as after SIGKILL
    assert c._server is not None
    c._server.stop(0).wait()
    crash_writers(c)
    c._unlock_store()
    log = root / "wal" / f"{eid}.wal"
    with open(log, "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")  # a torn record: header and part of a payload
    records, good = WriteAheadLog.read(log)
    msgs = [pb.RobotMessage.FromString(r) for r in records]
    assert msgs[0].WhichOneof("body") == "segment" and good < log.stat().st_size
    assert sum(m.frames.action.shape[0] for m in msgs[1:]) == 20
    port = int(c.address.rsplit(":", 1)[1])
    c2 = Collector(CollectorConfig(store=root, db=store_db_url, port=port, chunk_len=64), token=TOKEN).start()
    try:
        assert log.stat().st_size == good
        client.end_episode("success")
        assert client.close(30)
        assert c2.drain(30)
        ep = EpisodeStore(root).read_episode(eid)
        assert ep.meta.is_closed and ep.length == 20
        want = [0.1 * i if i % 3 else np.nan for i in range(20)]
        np.testing.assert_allclose(ep.uncertainty, want, rtol=1e-6)  # replayed from the log
        rec = c2.db.episode(eid)
        assert rec is not None and (rec.status, rec.length) == ("closed", 20)
        assert EpisodeStore(root).verify(db=c2.db) == []
        got = store_digests(root)
        assert sorted(d for (_, _, d) in got) == sorted(sent)
    finally:
        c2.stop()


def crash_writers(c: Collector) -> None:
    """SIGKILL a collector's store writer processes, as if the whole collector had been killed."""
    c._stop.set()  # no restarts: this collector is "dead"
    for w in c._writers:
        assert isinstance(w, _ProcessWriter)
        w.kill()
        w.join(10)


# ------------------------------------------------------------------------------------------ real processes
class _Proxy:
    """A TCP forwarder whose connections can be cut, to drop a robot's link mid-episode."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(65536):
                y.sendall(data)
        except OSError:
            pass
        for s in (x, y):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.cuts += 1


@PG_SLOW
def test_connection_drops_mid_episode(collector: Collector) -> None:
    proxy = _Proxy(collector.port)
    client = RobotClient(
        f"127.0.0.1:{proxy.port}", "arm-9", SPEC, "t", token=TOKEN, reconnect_backoff_s=(0.05, 0.2)
    )
    produced: list[tuple[str, int, str]] = []
    t = threading.Thread(target=lambda: produced.extend(stream_episodes(client, 2, 150, seed=6)))
    t.start()
    for _ in range(3):
        time.sleep(0.3)
        proxy.cut()
    t.join(60)
    assert client.close(60)
    assert client.stats.reconnects >= 1
    assert collector.drain(30)
    got = store_digests(collector.store.root)
    assert sorted(got) == sorted(produced) and set(got.values()) == {1}
    assert all(EpisodeStore(collector.store.root).read_metadata(e).is_closed for (e, _, _) in got)


def busy_logs(store: Path) -> int:
    """Write-ahead logs holding frames (a log can vanish while we look: its episode closed)."""
    n = 0
    for f in (store / "wal").glob("*.wal"):
        with contextlib.suppress(FileNotFoundError):
            n += f.stat().st_size > 0
    return n


def start_collector_process(
    store: Path, port: int, log_path: Path, db_url: str | None = None
) -> subprocess.Popen[bytes]:
    env = child_env()
    cmd = [sys.executable, "-m", "vla_rl.cli", "--log-format", "json", "collect", "--store", str(store)]
    cmd += ["--port", str(port), "--token", TOKEN, "--chunk-len", "16"]
    cmd += ["--db", db_url] if db_url else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "ab"), env=env)  # noqa: SIM115
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "collector listening" in line, (line, log_path.read_text()[-2000:])
    return proc


@pytest.mark.parametrize(
    "episodes,frames,size",
    [pytest.param(2, 40, 16, id="short"), pytest.param(4, 150, 64, id="long", marks=pytest.mark.slow)],
)
@PG_SLOW  # ~25 s: `collect --db` runs on PostgreSQL in CI under test_up.py's loop; in-process tests here
def test_sigkill_collector_while_8_robots_stream(
    tmp_path: Path, episodes: int, frames: int, size: int, store_db_url: str | None
) -> None:
    spec = RobotSpec(
        "arm", 5, 3, 30.0, "push", cameras=(CameraSpec("front", size, size), CameraSpec("wrist", size, size))
    )
    store, port, log_path = tmp_path / "store", free_port(), tmp_path / "collector.log"
    proc = start_collector_process(store, port, log_path, store_db_url)
    ctx = mp.get_context("spawn")
    robots = []
    for i in range(8):
        cfg = SyntheticRobotConfig(
            robot_id=f"robot-{i}",
            collector=f"127.0.0.1:{port}",
            spec=spec.to_dict(),
            token=TOKEN,
            episodes=episodes,
            frames_per_episode=frames,
            hz=40.0,
            seed=i,
            record_path=str(tmp_path / f"robot-{i}.jsonl"),
            result_path=str(tmp_path / f"robot-{i}.json"),
            max_batch_frames=4,
            start_file=str(tmp_path / "go"),
        )
        p = ctx.Process(target=synthetic_robot_main, args=(cfg,), daemon=True)
        p.start()
        robots.append(p)
    try:
        # every robot connected (each client says Hello first): start them together, kill mid-episode
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and log_path.read_text().count("robot connected") < 8:
            time.sleep(0.05)
        (tmp_path / "go").touch()
        # kill once most robots have acknowledged frames of an open episode (their logs are not empty)
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline
            and sum(f.stat().st_size > 0 for f in (store / "wal").glob("*.wal")) < 6
        ):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(1.0)  # robots keep producing; their clients buffer
        proc = start_collector_process(store, port, log_path, store_db_url)
        # a malformed batch from another robot is refused while the 8 catch up
        send, recv, close = raw_stream(f"127.0.0.1:{port}")
        send(hello("bad-robot", spec))
        send(pb.RobotMessage(start=pb.StartEpisode(episode_id="bad-ep")))
        send(segment("bad-ep", 0, 0))
        send(batch("bad-ep", 0, 2))  # 16 px frames, but this spec has two cameras
        replies = [recv() for _ in range(4)]
        close()
        assert "frames.cameras" in replies[3].reject.message
        for p in robots:
            p.join(120)
            assert p.exitcode == 0
        # A robot is done once its last message is acknowledged (durable in the log); the store writers
        # apply the logs behind it. SIGTERM bounds their drain (drain_timeout_s) and leaves the rest to
        # the next start's replay, so wait for the store to catch up first (a loaded machine, and the
        # DB round trips of a PostgreSQL collector, widen that lag to seconds).
        eids = set(read_records(sorted(tmp_path.glob("robot-*.jsonl")))[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            EpisodeStore(store).read_metadata(e).is_closed for e in eids
        ):
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "episode recovered" in log_path.read_text()
    records, eps = read_records(sorted(tmp_path.glob("robot-*.jsonl")))
    assert len(records) == 8 * episodes * frames
    assert EpisodeStore(store).read_metadata("bad-ep").length == 0
    got = store_digests(store)
    produced = collections.Counter((f["episode"], f["seq"], f["digest"]) for f in records)
    assert got == produced  # every frame exactly once, nothing else
    s = EpisodeStore(store)
    db = open_db(store, store_db_url)
    assert s.verify(db=db) == []
    for eid, rec in eps.items():
        meta = s.read_metadata(eid)
        assert meta.is_closed and meta.length == rec["length"]
        assert [(g.start, g.kind.value, int(g.controller)) for g in meta.segments] == [
            (x["start"], x["kind"], x["controller"]) for x in rec["segments"]
        ]
        ctrl = s.read_episode(eid, cameras=False).controller
        want = [
            f["controller"]
            for f in sorted((f for f in records if f["episode"] == eid), key=lambda f: f["seq"])
        ]
        assert ctrl.tolist() == want
    results = [__import__("json").loads(p.read_text()) for p in sorted(tmp_path.glob("robot-*.json"))]
    assert all(r["all_acked"] and r["rejects"] == 0 for r in results)
    assert sum(r["reconnects"] for r in results) >= 8  # every robot lost its collector and came back


@SQLITE_ONLY
def test_garbage_bytes_are_refused_and_the_stream_survives(collector: Collector) -> None:
    with grpc.insecure_channel(collector.address) as ch:
        call = ch.stream_stream(
            "/vla_rl.fleet.v1.Collector/Stream",
            request_serializer=None,
            response_deserializer=pb.CollectorMessage.FromString,
        )
        msgs = [b"\xff\xff\xff not protobuf", hello().SerializeToString()]
        replies = list(call(iter(msgs), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10))
    assert (
        replies[0].reject.code == SC.INVALID_ARGUMENT.value[0]
        and "not a RobotMessage" in replies[0].reject.message
    )
    assert replies[1].WhichOneof("body") == "welcome"


def test_store_resume_episode_after_a_killed_writer(tmp_path: Path) -> None:
    """EpisodeStore.resume_episode (what recovery uses): uncommitted rows are overwritten, arrays of
    different lengths (a writer killed while resizing) are evened out, segments and times continue."""
    store = EpisodeStore(tmp_path / "s", create=True)
    w = store.create_episode(SPEC, robot_id="arm", task="t", chunk_len=8, camera_zstd_level=-1)
    rng = np.random.default_rng(0)

    def frames(n: int, t0: float) -> dict[str, Any]:
        return {
            "cameras": {"front": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)},
            "state": rng.standard_normal((n, 5), dtype=np.float32),
            "action": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
            "timestamp": t0 + np.arange(n, dtype=np.float64),
        }

    w.begin_segment("autonomous", "policy")
    first = frames(12, 100.0)
    w.add_frames(first)  # 8 committed, 4 buffered (lost with the writer)
    w.begin_segment("intervention", "human", reason="stall")
    w.add_frames(frames(6, 112.0))  # 16 committed; the intervention began at frame 12
    zarr_arrays = w._arrays
    zarr_arrays["reward"].resize((40,))  # as if killed half-way through growing the arrays
    del w
    meta = store.read_metadata(store.episode_ids()[0])
    assert meta.length == 16 and [s.start for s in meta.segments] == [0, 12]
    r = store.resume_episode(meta.episode_id)
    assert r.num_frames == 16 and r.segment_index == 1 and r.segments[1].reason == "stall"
    with pytest.raises(Exception, match="timestamp"):
        r.add_frames(frames(1, 50.0))  # before the last committed time
    r.add_frames(frames(5, 200.0))
    r.begin_segment("autonomous", "policy", reason="handback")
    r.add_frames(frames(3, 210.0))
    meta = r.close("success")
    assert meta.length == 24 and [(s.start, s.end) for s in meta.segments] == [(0, 12), (12, 21), (21, 24)]
    assert store.verify() == []
    ep = store.read_episode(meta.episode_id)
    np.testing.assert_array_equal(ep.cameras["front"][:12], first["cameras"]["front"])
    np.testing.assert_array_equal(ep.controller, [0] * 12 + [1] * 9 + [0] * 3)
    with pytest.raises(ValueError, match="closed"):
        store.resume_episode(meta.episode_id)


_EXIT_SCRIPT = """
import sys, time
import numpy as np
from vla_rl_client.robot_client import RobotClient
from vla_rl.cli.common import open_db
from vla_rl_client.spec import CameraSpec, RobotSpec

spec = RobotSpec("arm", 5, 3, 30.0, "push the cube", cameras=(CameraSpec("front", 16, 16),))
client = RobotClient(sys.argv[1], "arm-exit", spec, "t", token=sys.argv[2], reconnect_backoff_s=(0.05, 0.2))
for _ in range(2):
    client.start_episode()
    for i in range(20):
        client.add_frame(
            {"front": np.zeros((16, 16, 3), np.uint8)}, np.zeros(5, np.float32), np.zeros(3, np.float32)
        )
    client.end_episode("success")
ok = client.close(float(sys.argv[3]))
print("closed", ok, flush=True)
"""


@pytest.mark.parametrize("collector_up", [True, False], ids=["acked", "collector-down"])
def test_robot_process_exits_promptly_after_close(tmp_path: Path, collector_up: bool) -> None:
    """A robot program ends by itself once close() returns: no grpc thread keeps the interpreter alive."""
    env = child_env()
    c = (
        Collector(CollectorConfig(store=tmp_path / "s", port=0), token=TOKEN).start()
        if collector_up
        else None
    )
    address = c.address if c is not None else f"127.0.0.1:{free_port()}"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXIT_SCRIPT, address, TOKEN, "30" if collector_up else "1"],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        closed_at = time.monotonic()
        assert line.strip() == f"closed {collector_up}", line
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the robot process did not exit within 10 s after close() returned")
        assert proc.returncode == 0
        assert time.monotonic() - closed_at < 5
    finally:
        if c is not None:
            c.stop()


_SPOOL_SCRIPT = """
import json, sys, time
import numpy as np
from vla_rl_client.frame import Frame
from vla_rl_client.robot_client import RobotClient
from vla_rl.cli.common import open_db
from vla_rl_client.spec import CameraSpec, RobotSpec

spec = RobotSpec("arm", 5, 3, 30.0, "push the cube", cameras=(CameraSpec("front", 16, 16),))
address, token, spool, phase = sys.argv[1:5]
client = RobotClient(
    address, "arm-spool", spec, "t", token=token, spool_dir=spool, max_batch_frames=4,
    reconnect_backoff_s=(0.05, 0.2),
)
if phase == "resend":
    print("closed", client.close(60), flush=True)
    sys.exit(0)
rng = np.random.default_rng(11)
client.start_episode(episode_id="spool-ep")
digests = []

def frames(k):
    for _ in range(k):
        i = len(digests)
        cams = {"front": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)}
        state, action = rng.standard_normal(5).astype(np.float32), rng.uniform(-1, 1, 3).astype(np.float32)
        frame = Frame(cams, state, action, controller=0, timestamp=100.0 + i)
        client.add(frame)
        digests.append(frame.digest())

frames(8)
assert client.flush(30)
print("acked", flush=True)
sys.stdin.readline()  # the collector is down now
frames(14)  # 12 more sealed (spooled, never acknowledged), 2 still batching when the process dies
print(json.dumps(digests), flush=True)
time.sleep(600)
"""


def test_spooled_frames_survive_a_killed_robot_process(tmp_path: Path) -> None:
    """SIGKILL a robot with unacknowledged frames; its next process resends them from the spool: every
    sealed frame lands exactly once, and the episode is closed as aborted."""
    env = child_env()
    root, spool, port = tmp_path / "s", tmp_path / "spool", free_port()
    address = f"127.0.0.1:{port}"
    c = Collector(CollectorConfig(store=root, port=port, chunk_len=8), token=TOKEN).start()
    robot = subprocess.Popen(
        [sys.executable, "-c", _SPOOL_SCRIPT, address, TOKEN, str(spool), "stream"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert robot.stdin is not None and robot.stdout is not None
    try:
        assert robot.stdout.readline().decode().strip() == "acked"
        c.stop()
        robot.stdin.write(b"go\n")
        robot.stdin.flush()
        digests = json.loads(robot.stdout.readline())
        robot.send_signal(signal.SIGKILL)
        robot.wait(10)
    finally:
        robot.kill()
    assert len(digests) == 22 and len(list(spool.glob("*.spool"))) == 1
    c = Collector(CollectorConfig(store=root, port=port, chunk_len=8), token=TOKEN).start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _SPOOL_SCRIPT, address, TOKEN, str(spool), "resend"],
            capture_output=True,
            env=env,
            timeout=120,
        )
        assert out.stdout.decode().strip() == "closed True", out.stderr.decode()[-2000:]
        assert c.drain(30)
    finally:
        c.stop()
    meta = EpisodeStore(root).read_metadata("spool-ep")
    assert meta.is_closed and meta.outcome == "aborted" and meta.length == 20
    got = store_digests(root)
    assert sorted(d for (_, _, d) in got) == sorted(digests[:20])  # each once, none of the unsealed two
    assert not list(spool.glob("*.spool"))  # acknowledged: the spool is empty

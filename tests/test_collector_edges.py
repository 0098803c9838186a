"""Collector and store edges (issue 45, items 7 and 10): ids matched in full, log lines that cannot be forged,
a bounded robot spec, values the spec rules out, the store writer's memory bound, and `store verify`
telling what the write-ahead log still holds.

Real gRPC collectors on loopback and real Zarr stores in tmp_path, 16x16 cameras (helpers from
test_collector).
"""

from __future__ import annotations

import dataclasses
import gc
import io
import logging
import re
import time
import tracemalloc
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_collector import SPEC, TOKEN, batch, hello, raw_stream, segment
from vla_rl_client.codec import to_tensor
from vla_rl_client.frame import Frame
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.robot_client import RobotClient
from vla_rl_client.spec import MAX_SPEC_JSON_CHARS, CameraSpec, RobotSpec, SpecError

from fleet.collector import Collector, CollectorConfig, load_robot_tokens
from fleet.objstore import StoreURLError, normalize_url
from fleet.store import EpisodeStore
from fleet.store.layout import block_bytes
from fleet.store_writer import StoreWriter
from fleet.wal import WAL_DIR, WriteAheadLog
from vla_rl.cli.data import StoreVerify, store_verify
from vla_rl.core.logs import TextFormatter

SC = grpc.StatusCode
REPO = Path(__file__).resolve().parents[1]


def start(eid: str) -> pb.RobotMessage:
    return pb.RobotMessage(start=pb.StartEpisode(episode_id=eid))


def end(eid: str, length: int) -> pb.RobotMessage:
    return pb.RobotMessage(end=pb.EndEpisode(episode_id=eid, length=length, outcome="success"))


def _collector(tmp_path: Path, **over: object) -> Collector:
    cfg = CollectorConfig(store=tmp_path / "store", port=0, chunk_len=16, store_writers=0, **over)  # type: ignore[arg-type]
    return Collector(cfg, token=TOKEN)


# ------------------------------------------------------------------------------------------ ids
def test_ids_with_a_trailing_newline_are_refused(tmp_path: Path) -> None:
    """``re.match`` with ``$`` takes "ep\\n": robot and episode ids are matched in full everywhere."""
    with _collector(tmp_path) as c:
        send, recv, close = raw_stream(c.address)
        send(hello("robot\n"))
        r = recv().reject
        assert r.code == SC.INVALID_ARGUMENT.value[0] and r.message.startswith("hello.robot_id")
        send(hello("robot"))
        assert recv().WhichOneof("body") == "welcome"
        for eid in ("ep\n", "ep\r\n", "ep\n\n"):
            send(start(eid))
            r = recv().reject
            assert r.code == SC.INVALID_ARGUMENT.value[0] and r.message.startswith("start.episode_id"), eid
        close()
        assert c.drain(10)
    assert not [p for p in (tmp_path / "store").rglob("*") if "\n" in p.name or "\r" in p.name]
    store = EpisodeStore(tmp_path / "s2", create=True)
    with pytest.raises(ValueError, match="episode_id"):
        store.create_episode(SPEC, robot_id="r", task="t", episode_id="ep\n")
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"robot\\n": "a-token-of-sixteen-chars"}')
    with pytest.raises(ValueError, match="robot_tokens_file"):
        load_robot_tokens(tokens)
    with pytest.raises(StoreURLError):
        normalize_url("s3://bucket\n/prefix")
    with pytest.raises(StoreURLError):
        normalize_url("s3://bucket/prefix\n")


def test_fleet_code_matches_ids_with_fullmatch_only() -> None:
    """No ``re.match`` / ``$``-anchored pattern left in the collector, the store, the server or the client."""
    offenders = []
    for root in ("fleet", "server", "packages/vla-rl-client/vla_rl_client"):
        for path in sorted((REPO / root).rglob("*.py")):
            if "proto" in path.parts:
                continue
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"_RE\.match\(|re\.match\(|\$\"\)", line):
                    offenders.append(f"{path.relative_to(REPO)}:{no}: {line.strip()}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------ logs
def test_text_log_lines_cannot_be_forged() -> None:
    """A newline (or a bidi override, or a quote) in a value a client chose stays inside its record."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("test.forge")
    logger.handlers[:] = [handler]
    logger.propagate = False
    forged = "push\n12:00:00 error   vla_rl.collector: store writer died  robot=arm-1"
    logger.warning(
        "robot connected\nfake", extra={"task": forged, "who": 'a" b=c', "rtl": "x\u202ey", "n": 3}
    )
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n"), text
    assert 'task="push\\n12:00:00 error' in text and "robot connected\\x0afake" in text
    assert 'who="a\\" b=c"' in text and "\\u202e" in text and " n=3" in text
    assert "\u202e" not in text


# ------------------------------------------------------------------------------------------ spec size
def test_a_huge_robot_spec_is_refused_in_hello(tmp_path: Path) -> None:
    dim = 2048
    names = tuple(f"joint_{i}_" + "x" * 40 for i in range(dim))
    big = RobotSpec("arm", dim, 3, 30.0, "push", state_names=names)
    assert len(big.to_json()) > MAX_SPEC_JSON_CHARS
    with pytest.raises(ValueError, match="at most 65536"):
        RobotClient("127.0.0.1:1", "arm-0", big, "t", token=TOKEN)
    wordy = RobotSpec("arm", 5, 3, 30.0, "x" * (MAX_SPEC_JSON_CHARS + 1))
    with _collector(tmp_path) as c:
        send, recv, close = raw_stream(c.address)
        for spec in (big, wordy):
            send(hello("arm-0", spec))
            r = recv().reject
            assert r.code == SC.RESOURCE_EXHAUSTED.value[0], r.message
            assert "hello.robot_spec_json" in r.message and str(MAX_SPEC_JSON_CHARS) in r.message
        send(hello("arm-0"))
        assert recv().WhichOneof("body") == "welcome"  # the stream carries on
        close()


# ------------------------------------------------------------------------------------------ values
def test_values_the_spec_rules_out_are_refused(tmp_path: Path) -> None:
    """Finite but absurd: an action of 3e38 where the spec says [-1, 1], a state of 3e38. Refused, naming
    the field and the frame; nothing of them is stored; the episode carries on."""
    huge = np.float32(3e38)
    with _collector(tmp_path) as c:
        send, recv, close = raw_stream(c.address)
        send(hello())
        recv()
        for m in (start("vals"), segment("vals", 0, 0)):
            send(m)
            assert recv().WhichOneof("body") == "ack"
        cases = {
            "frames.action": dict(action=np.array([[0, 0, 0], [0, huge, 0]], np.float32)),
            "frames.action ": dict(action=np.array([[0, 0, 0], [0, 1.5, 0]], np.float32)),
            "frames.state": dict(state=np.full((2, 5), huge, np.float32)),
            "frames.proposed_action": dict(proposed_action=np.full((2, 3), -huge, np.float32)),
            "frames.reward": dict(reward=np.array([0, 1e7], np.float32)),
        }
        for field, over in cases.items():
            send(batch("vals", 0, 2, **over))
            r = recv().reject
            assert r.code == SC.INVALID_ARGUMENT.value[0], (field, r.message)
            assert r.message.startswith(field.strip() + ":"), r.message
        assert "action_range [-1, 1]" in _reject_text(send, recv, cases["frames.action"])
        assert "(frame 1)" in _reject_text(send, recv, cases["frames.action"])
        assert "max_value_abs" in _reject_text(send, recv, cases["frames.state"])
        send(
            batch("vals", 0, 2, action=np.array([[-1, 1, 0], [1, -1, 0.5]], np.float32))
        )  # the bounds are in
        assert recv().ack.committed == 2
        send(end("vals", 2))
        assert recv().ack.ended
        close()
        assert c.drain(10)
        deadline = time.monotonic() + 10
        while not c.store.read_metadata("vals").is_closed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    ep = EpisodeStore(tmp_path / "store").read_episode("vals", cameras=False)
    assert ep.length == 2 and np.abs(ep.action).max() == 1.0 and np.abs(ep.state).max() < 10


def _reject_text(send: object, recv: object, over: dict[str, np.ndarray]) -> str:
    send(batch("vals", 0, 2, **over))  # type: ignore[operator]
    return recv().reject.message  # type: ignore[operator, no-any-return]


def test_the_action_range_is_part_of_the_spec() -> None:
    """Declared by default ([-1, 1]); None for a spec in the robot's own units (a LeRobot import) and for a
    spec saved before the field existed; the robot client checks it before buffering."""
    spec = RobotSpec("arm", 2, 2, 10.0, "x")
    assert spec.action_range == (-1.0, 1.0)
    assert RobotSpec.from_json(spec.to_json()).action_range == (-1.0, 1.0)
    old = spec.to_dict()
    del old["action_range"]
    assert RobotSpec.from_dict(old).action_range is None
    raw = RobotSpec("arm", 2, 2, 10.0, "x", action_range=None)
    assert raw == spec  # a bound, not another robot
    raw.check_action_range(np.full((4, 2), 250.0, np.float32))
    with pytest.raises(SpecError, match=r"action: expected values within the spec's action_range"):
        spec.check_action_range(np.array([0.5, 1.01], np.float32))
    spec.check_action_range(np.array([1.0 + 1e-6, -1.0], np.float32))  # rounding of a clipped value
    with pytest.raises(ValueError, match="action_range"):
        RobotSpec("arm", 2, 2, 10.0, "x", action_range=(1.0, -1.0))
    client = RobotClient("127.0.0.1:1", "arm-0", SPEC, "t", token=TOKEN, block_s=0.1)
    try:
        client.start_episode()
        frame = Frame(
            cameras={"front": np.zeros((16, 16, 3), np.uint8)},
            state=np.zeros(5, np.float32),
            action=np.array([0, 3e38, 0], np.float32),
        )
        with pytest.raises(SpecError, match="action"):
            client.add(frame)
    finally:
        client.close(timeout_s=0.5)


def test_config_bounds_values() -> None:
    with pytest.raises(ValueError, match="max_value_abs"):
        CollectorConfig(store=Path("s"), max_value_abs=float("inf"))
    assert CollectorConfig(store=Path("s")).max_value_abs == 1e6


# ------------------------------------------------------------------------------------------ writer memory
BIG = RobotSpec("arm", 5, 3, 30.0, "push", cameras=(CameraSpec("front", 64, 64),))
CHUNK = 16


def _frames_msg(eid: str, seq: int, n: int, rng: np.random.Generator, side: int) -> bytes:
    fb = pb.FrameBatch(episode_id=eid, seq=seq)
    fb.cameras["front"].CopyFrom(to_tensor(rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)))
    fb.state.CopyFrom(to_tensor(rng.standard_normal((n, 5), dtype=np.float32)))
    fb.action.CopyFrom(to_tensor(rng.uniform(-1, 1, (n, 3)).astype(np.float32)))
    fb.timestamp.CopyFrom(to_tensor(1000.0 + seq + np.arange(n, dtype=np.float64)))
    return pb.RobotMessage(frames=fb).SerializeToString()


def _log_episode(
    store: EpisodeStore,
    wal_dir: Path,
    eid: str,
    frames: int,
    *,
    first: int = 0,
    end: bool = False,
    side: int = 64,
) -> int:
    """Append ``frames`` frames (from ``first``; a new episode when 0) of a ``side`` px camera, and its end if
    ``end``, to ``eid``'s write-ahead log as the collector does; returns the log's size."""
    if first == 0:
        spec = dataclasses.replace(BIG, cameras=(CameraSpec("front", side, side),))
        store.new_episode(spec, robot_id="arm-0", task="t", chunk_len=CHUNK, episode_id=eid)
    wal = WriteAheadLog(wal_dir / f"{eid}.wal", False)
    rng = np.random.default_rng(len(eid) + first)
    if first == 0:
        marker = pb.SegmentMarker(episode_id=eid, index=0, start=0, kind=pb.AUTONOMOUS, controller=pb.POLICY)
        wal.append(pb.RobotMessage(segment=marker).SerializeToString())
    for seq in range(first, first + frames, 8):
        wal.append(_frames_msg(eid, seq, min(8, first + frames - seq), rng, side))
    if end:
        done = pb.EndEpisode(episode_id=eid, length=first + frames, outcome="success")
        wal.append(pb.RobotMessage(end=done).SerializeToString())
    return wal.size


def test_the_store_writers_memory_bound_holds(tmp_path: Path) -> None:
    """``max_buffered_bytes`` bounds what a store writer holds, measured by tracemalloc (numpy's buffers and
    every bytes object are traced): a writer far behind reads its log a record at a time (it read the whole
    backlog, and copied it), and the free blocks kept for reuse count (closed episodes' blocks waited there,
    beside the live ones, for episodes of their shape)."""
    store = EpisodeStore(tmp_path / "store", create=True)
    wal_dir = tmp_path / "wal"
    wal_dir.mkdir()
    block = block_bytes(BIG, CHUNK)  # ~200 kB: 16 frames of one 64x64 camera
    bound = 4 * block
    sw = StoreWriter(store.root, max_buffered_bytes=bound, wal_dir=wal_dir)
    warm = _log_episode(
        store, wal_dir, "warm", 40
    )  # caches, threads and the block pool exist before measuring
    assert sw.handle({"op": "data", "episode": "warm", "end": warm})[0]["error"] is None
    behind = _log_episode(store, wal_dir, "behind", 200)  # 2.5 MB of log in one op
    sizes = {f"e{i}": _log_episode(store, wal_dir, f"e{i}", 40) for i in range(12)}  # 8 frames left each
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        reports = sw.handle({"op": "data", "episode": "behind", "end": behind})
        peak = tracemalloc.get_traced_memory()[1] - base
        gc.disable()  # what stays held, not when Python happens to collect
        for eid, size in sizes.items():
            reports += sw.handle({"op": "data", "episode": eid, "end": size})
        for eid in sizes:  # they end: their blocks go to the pool...
            more = _log_episode(store, wal_dir, eid, 8, first=40, end=True)
            reports += sw.handle({"op": "data", "episode": eid, "end": more})
        for i in range(3):  # ...and a robot with a larger camera cannot reuse them
            eid = f"wide{i}"
            reports += sw.handle(
                {"op": "data", "episode": eid, "end": _log_episode(store, wal_dir, eid, 24, side=80)}
            )
        numpy_domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        arrays = sum(t.size for t in tracemalloc.take_snapshot().filter_traces([numpy_domain]).traces)
    finally:
        gc.enable()
        tracemalloc.stop()
    assert [r["error"] for r in reports] == [None] * len(reports)
    # A writer far behind, at its worst moment: the bound, the block being written and one record, plus a
    # fixed allowance for zarr's own buffers (it peaked at 5 MB here before: the backlog read whole, and copied).
    assert peak <= bound + 3 * block + 1024 * 1024, (peak, bound)
    # Frame data alive once 15 episodes took turns: the bound (the pool's blocks came on top before).
    assert sw.evicted >= 8 and sw.held_bytes() <= bound
    assert arrays <= bound + block, (arrays, bound)
    for eid in sizes:  # every frame made it: an evicted episode resumes from its commit
        assert store.read_metadata(eid).length == 48 and store.read_metadata(eid).is_closed


# ------------------------------------------------------------------------------------------ store verify
def test_store_verify_reports_frames_still_only_in_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Right after a stop, acknowledged frames may be only in the write-ahead log (the next start applies
    them): verify says how many instead of a bare "consistent"."""
    root = tmp_path / "store"
    store = EpisodeStore(root, create=True)
    wal_dir = root / WAL_DIR
    wal_dir.mkdir()
    sw = StoreWriter(root, max_buffered_bytes=64 * 1024 * 1024, wal_dir=wal_dir)
    size = _log_episode(store, wal_dir, "part", 24)
    assert sw.handle({"op": "data", "episode": "part", "end": size})[0]["stored"] == 16  # one chunk in Zarr
    intact = {"none": _log_episode(store, wal_dir, "none", 40)}  # nothing applied
    size = _log_episode(store, wal_dir, "done", 16, end=True)
    assert sw.handle({"op": "data", "episode": "done", "end": size})[0]["closed"]
    (wal_dir / "done.wal").unlink()  # what the collector does once the DB has the closed episode
    with open(wal_dir / "none.wal", "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")  # a torn tail was never acknowledged: not counted
    assert store_verify(StoreVerify(path=root, check_db=False)) == 0
    out = capsys.readouterr().out
    assert "are consistent, but 48 acknowledged frames of 2 open episode(s) are pending in the log" in out, (
        out
    )
    assert "start the collector to apply them" in out
    moved = tmp_path / "logs"
    wal_dir.rename(moved)
    intact["ended"] = _log_episode(store, moved, "ended", 8, end=True)
    intact["part"] = (moved / "part.wal").stat().st_size
    assert store_verify(StoreVerify(path=root, check_db=False, wal_dir=moved)) == 0
    out = capsys.readouterr().out
    assert "56 acknowledged frames and 1 episode end(s) of 3 open episode(s)" in out, out
    for eid in ("part", "none", "ended"):  # applied: nothing pending
        sw.wal_dir = moved
        assert sw.handle({"op": "data", "episode": eid, "end": intact[eid]})[0]["error"] is None
    sw.handle({"op": "flush", "episode": "part"})
    sw.handle({"op": "flush", "episode": "none"})
    assert store_verify(StoreVerify(path=root, check_db=False, wal_dir=moved)) == 0
    assert capsys.readouterr().out.strip().endswith("are consistent")

"""packages/vla-rl-client/vla_rl_client/wire.py: the robot's hand-built FrameBatch bytes are plain protobuf, and the collector's scanner
reads the same cameras from any encoding, without crashing on bad bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from vla_rl_client import wire
from vla_rl_client.codec import to_tensor
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import CameraSpec, RobotSpec

from fleet.wal import decode_frames, parse_message

SPEC = RobotSpec("arm", 5, 3, 30.0, "push", cameras=(CameraSpec("front", 8, 8), CameraSpec("wrist", 4, 6)))


def batch(n: int, seed: int = 0) -> tuple[pb.FrameBatch, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    cams = {c.name: rng.integers(0, 256, (n, *c.shape), dtype=np.uint8) for c in SPEC.cameras}
    fb = pb.FrameBatch(episode_id="ep-1", seq=7)
    fb.state.CopyFrom(to_tensor(rng.standard_normal((n, 5)).astype(np.float32)))
    fb.action.CopyFrom(to_tensor(rng.uniform(-1, 1, (n, 3)).astype(np.float32)))
    fb.timestamp.CopyFrom(to_tensor(np.arange(n, dtype=np.float64)))
    fb.revision.append("rev")
    return fb, cams


def hand_built(fb: pb.FrameBatch, cams: dict[str, np.ndarray], msg_id: int) -> bytes:
    parts = [(wire.camera_entry(k, v.shape, v.nbytes), v.data) for k, v in cams.items()]
    return wire.frames_message(msg_id, fb.SerializeToString(), parts)


def with_protobuf(fb: pb.FrameBatch, cams: dict[str, np.ndarray], msg_id: int) -> bytes:
    full = pb.FrameBatch()
    full.CopyFrom(fb)
    for k, v in cams.items():
        full.cameras[k].CopyFrom(to_tensor(v))
    return pb.RobotMessage(msg_id=msg_id, frames=full).SerializeToString()


@pytest.mark.parametrize("msg_id", [1, 300, 2**40])
def test_hand_built_bytes_are_the_protobuf_message(msg_id: int) -> None:
    fb, cams = batch(3)
    got = pb.RobotMessage.FromString(hand_built(fb, cams, msg_id))
    assert got == pb.RobotMessage.FromString(with_protobuf(fb, cams, msg_id))
    assert got.msg_id == msg_id and got.frames.cameras["wrist"].data == cams["wrist"].tobytes()


@pytest.mark.parametrize("build", [hand_built, with_protobuf])
def test_scanner_reads_cameras_in_place_from_either_encoding(build: Callable[..., bytes]) -> None:
    fb, cams = batch(4, seed=1)
    raw = build(fb, cams, 9)
    msg, wire_cams = parse_message(raw)
    assert wire_cams is not None and set(wire_cams) == {"front", "wrist"}
    assert msg.msg_id == 9 and not msg.frames.cameras and msg.frames.seq == 7
    out = decode_frames(msg.frames, SPEC, 64, -math.inf, wire_cams)
    for k, v in cams.items():
        np.testing.assert_array_equal(out["cameras"][k], v)
        assert out["cameras"][k].base is not None  # a view of the received bytes, not a copy
    np.testing.assert_array_equal(out["action"], np.frombuffer(fb.action.data, np.float32).reshape(4, 3))


def test_scanner_leaves_other_messages_and_bad_bytes_to_protobuf() -> None:
    start = pb.RobotMessage(msg_id=1, start=pb.StartEpisode(episode_id="e")).SerializeToString()
    assert wire.split_cameras(start) is None
    fb, cams = batch(2, seed=2)
    raw = hand_built(fb, cams, 5)
    # every truncation and a few corruptions: the scanner never raises, it gives up or reads something
    # protobuf would read the same way
    for cut in range(len(raw)):
        assert wire.split_cameras(raw[:cut]) is None
    rng = np.random.default_rng(0)
    for _ in range(300):
        bad = bytearray(raw)
        bad[int(rng.integers(0, 40))] = int(rng.integers(0, 256))
        wire.split_cameras(bytes(bad))


def test_a_wrong_camera_shape_is_refused_naming_the_field() -> None:
    fb, cams = batch(2, seed=3)
    cams["front"] = np.ascontiguousarray(cams["front"][:, :4])
    msg, wire_cams = parse_message(hand_built(fb, cams, 1))
    from vla_rl_client.spec import SpecError

    with pytest.raises(SpecError, match=r"frames.cameras.front.*shape \[2, 8, 8, 3\]"):
        decode_frames(msg.frames, SPEC, 64, -math.inf, wire_cams)

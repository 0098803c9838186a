"""Policy server hardening (issue 16): each class of attack input is refused cheaply, names what was wrong,
leaks nothing without the token, and leaves the server (and the stream it came on) serving.

Real servers and gRPC clients on 127.0.0.1 with the tiny checkpoints of ``test_server``; attack inputs
are crafted headers and config fields, never large allocations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from test_server import SPEC, TOKEN, A, H, make_checkpoint, make_obs, start_server
from vla_rl_client.codec import encode_image, image_header_size, to_tensor
from vla_rl_client.policy_client import PolicyClient, PolicyError, build_request
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc
from vla_rl_client.spec import CameraSpec, RobotSpec

from policies.loading import load_policy
from server.batching import BatchQueue, _Pending
from server.config import ServerConfig
from server.guard import request_bytes_for
from server.policy_server import PolicyServer
from server.service import SERVICE_NAME
from server.slots import ModelSlot, ServedVersion
from vla_rl.core.rpc import RateLimitedLog, bad_field
from vla_rl.hub.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    LoadLimits,
    load_checkpoint,
    member_path,
)

torch.set_num_threads(1)
SC = grpc.StatusCode


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hardening")
    return {"a": make_checkpoint(root / "a", 0), "b": make_checkpoint(root / "b", 1)}


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]) -> Iterator[PolicyServer]:
    srv = start_server({"arm": ckpts["a"]}, max_batch=4, max_wait_us=2000)
    yield srv
    srv.stop()


def _edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    edit(cfg)
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    return folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _stream(
    address: str, requests: list[pb.ActRequest | bytes], timeout_s: float = 20
) -> list[pb.ActResponse]:
    """Send ``requests`` (messages or raw bytes) on one StreamAct call; every reply, in order."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(
            f"/{SERVICE_NAME}/StreamAct",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=pb.ActResponse.FromString,
        )
        return list(call(iter(requests), timeout=timeout_s))


def _good(seed: int = 1) -> pb.ActRequest:
    return build_request(
        make_obs(np.random.default_rng(seed)), model_id="arm", seed=seed, request_id=f"good-{seed}"
    )


# ------------------------------------------------------------------------------------- 1. checkpoint names
OUTSIDE_NAMES = ["../../etc/passwd", "/etc/passwd", "sub/../../outside.bin", "./config.json", "a\\..\\b", ""]


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_listed_names_must_stay_inside_the_folder(ckpts: dict[str, Path], tmp_path: Path, name: str) -> None:
    folder = _edit_config(_copy(ckpts["a"], tmp_path / "c"), lambda c: c["files"].update({name: "0" * 64}))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert "files:" in str(err.value)


def test_links_out_fifos_and_big_files_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(ckpts["a"], tmp_path / "c")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (folder / "link").symlink_to(secret)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        member_path(folder, "link")
    os.mkfifo(folder / "fifo")  # a read would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        member_path(folder, "fifo")
    (folder / "sub").mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        member_path(folder, "sub")
    with pytest.raises(CheckpointError, match="max_file_bytes"):
        load_checkpoint(folder, LoadLimits(max_file_bytes=1000))
    # the Hugging Face cache layout (snapshots/<sha>/f -> ../../blobs/x) is allowed
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_bytes(b"weights")
    snap = repo / "snapshots" / "0123"
    snap.mkdir(parents=True)
    (snap / "w.bin").symlink_to("../../blobs/abc")
    assert member_path(snap, "w.bin").read_bytes() == b"weights"


def test_a_load_deadline_stops_hashing(ckpts: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="load_timeout_s"):
        load_checkpoint(ckpts["a"], LoadLimits(deadline=time.monotonic() - 1))
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(CheckpointError, match="cancelled"):
        load_checkpoint(ckpts["a"], LoadLimits(cancelled=cancelled))


def test_load_errors_leak_nothing_without_the_token(ckpts: dict[str, Path], tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"server secret")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    evil = _edit_config(
        _copy(ckpts["a"], tmp_path / "evil" / "ckpt"),
        lambda c: c["files"].update({"../../outside.bin": "0" * 64, "/etc/hostname": "1" * 64}),
    )
    srv = start_server({"arm": ckpts["a"]})
    try:
        with PolicyClient(srv.address, token=TOKEN, timeout_s=10, model_id="arm") as admin:
            with pytest.raises(PolicyError) as err:
                admin.load_checkpoint(str(evil))
            assert err.value.code == SC.FAILED_PRECONDITION and "files:" in err.value.message
            detail = admin.info()["arm"].last_load_error  # token holders get the reason...
            assert "inside the checkpoint folder" in detail
        with PolicyClient(srv.address, timeout_s=10, model_id="arm") as anyone:
            public = anyone.info()["arm"].last_load_error  # ...everybody else only that it failed
            assert "refused" in public and "server log" in public
            for leak in ("outside", "hostname", "passwd", digest[:12], "sha256"):
                assert leak not in public and digest[:12] not in detail
            assert anyone.act(make_obs(np.random.default_rng(0)), seed=1).actions.shape == (H, A)
    finally:
        srv.stop()


def _slow_hashing(monkeypatch: pytest.MonkeyPatch, block_s: float) -> None:
    import types

    import vla_rl.hub.checkpoint as ck

    class Slow:
        def __init__(self) -> None:
            self.h = hashlib.sha256()

        def update(self, data: bytes) -> None:
            time.sleep(block_s)
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    monkeypatch.setattr(ck, "hashlib", types.SimpleNamespace(sha256=Slow))


def test_slow_loads_do_not_wedge_control_calls(
    ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads that would take minutes are abandoned at load_timeout_s; meanwhile (and after) Rollback
    answers at once and a normal load still works."""
    slow = _copy(ckpts["b"], tmp_path / "slow")
    (slow / "big.bin").write_bytes(b"\0" * (6 << 20))  # 6 blocks of 1 MiB, each made slow below
    _edit_config(
        slow, lambda c: c["files"].update({"big.bin": hashlib.sha256(b"\0" * (6 << 20)).hexdigest()})
    )
    srv = start_server({"arm": ckpts["a"]}, load_timeout=1.0)
    try:
        with PolicyClient(srv.address, token=TOKEN, timeout_s=30, model_id="arm") as c:
            c.load_checkpoint(str(ckpts["b"]))  # so there is something to roll back to
            _slow_hashing(monkeypatch, 0.5)
            errors: list[PolicyError] = []

            def load() -> None:
                with PolicyClient(srv.address, token=TOKEN, timeout_s=30, model_id="arm") as other:
                    try:
                        other.load_checkpoint(str(slow))
                    except PolicyError as e:
                        errors.append(e)

            threads = [threading.Thread(target=load) for _ in range(3)]  # more than the 2 load threads
            for t in threads:
                t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            c.rollback()  # does not queue behind the loads
            assert time.monotonic() - t0 < 0.5
            for t in threads:
                t.join(20)
            assert len(errors) == 3 and all("load_timeout_s" in e.message for e in errors), errors
            monkeypatch.undo()
            t0 = time.monotonic()
            assert c.load_checkpoint(str(ckpts["b"])).commit == c.info()["arm"].commit
            assert time.monotonic() - t0 < 5
    finally:
        srv.stop()


def test_follower_refuses_an_evil_revision_and_keeps_following(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """What a registry push reaches without any token: the follower refuses it and takes the next one."""
    from vla_rl.hub.registry import resolve

    live = _copy(ckpts["a"], tmp_path / "prod")
    srv = start_server({"arm": live}, follow={"arm": str(live)}, follow_interval=0.1)
    try:
        with PolicyClient(srv.address, timeout_s=10, model_id="arm") as c:
            first = c.info()["arm"].commit
            _edit_config(live, lambda cfg: cfg["files"].update({"../../../../etc/passwd": "0" * 64}))
            deadline = time.monotonic() + 20
            while not c.info()["arm"].last_load_error and time.monotonic() < deadline:
                time.sleep(0.1)
            info = c.info()["arm"]
            assert info.commit == first and "refused" in info.last_load_error
            assert "passwd" not in info.last_load_error
            for name in (WEIGHTS_FILE, "README.md", CONFIG_FILE):
                shutil.copy2(ckpts["b"] / name, live / name)
            want = resolve(str(live))
            while c.info()["arm"].commit != want and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.info()["arm"].commit == want and c.info()["arm"].last_load_error == ""
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------- 2. image decoding
def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG file whose header claims ``width x height`` (a decompression bomb's shape, no pixels)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _with_image(data: bytes, encoding: int = pb.Image.PNG) -> pb.ActRequest:
    req = _good(3)
    req.request_id = "bad"
    req.observation.cameras["front"].CopyFrom(pb.Image(encoding=encoding, encoded=data))
    return req


def test_image_headers_are_read_before_decoding() -> None:
    assert image_header_size(_png_claiming(40000, 30000), "PNG") == (40000, 30000)
    jpeg = encode_image(np.zeros((16, 24, 3), np.uint8), "jpeg").encoded
    assert image_header_size(jpeg, "JPEG") == (24, 16)
    assert image_header_size(b"\xff\xd8\xff\xda\x00\x02", "JPEG") is None
    assert image_header_size(b"\x89PNG", "PNG") is None


def test_image_bombs_and_broken_images_keep_the_stream_open(
    server: PolicyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    good_png = encode_image(np.zeros((16, 16, 3), np.uint8), "png").encoded
    bad = [
        (_with_image(_png_claiming(40000, 30000)), ["observation.cameras.front", "30000x40000"]),
        (_with_image(good_png[: len(good_png) // 2]), ["observation.cameras.front", "PNG"]),
        (_with_image(_png_claiming(16, 16)), ["observation.cameras.front", "decode"]),
        (_with_image(b"\xff\xd8\xff\xc0\x00\x11\x08\x7f\xff\x7f\xff", pb.Image.JPEG), ["32767x32767"]),
    ]
    reqs: list[pb.ActRequest | bytes] = []
    for req, _ in bad:
        reqs += [req, _good(len(reqs))]
    replies = _stream(server.address, reqs)
    assert len(replies) == len(reqs)
    for (_, words), err, ok in zip(bad, replies[::2], replies[1::2], strict=True):
        assert err.error.code == SC.INVALID_ARGUMENT.value[0], err
        assert all(w in err.error.message for w in words), err.error.message
        assert not ok.HasField("error") and ok.actions.shape == [H, A]
    # PIL's own bomb check (DecompressionBombError) is an INVALID_ARGUMENT reply too
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)
    replies = _stream(server.address, [_with_image(good_png), _good(9)])
    assert (
        replies[0].error.code == SC.INVALID_ARGUMENT.value[0]
        and "DecompressionBomb" in replies[0].error.message
    )
    assert not replies[1].HasField("error")


# ------------------------------------------------------------------------------------- 3. undecodable bytes
def test_undecodable_requests_are_invalid_argument_naming_the_field(
    server: PolicyServer, caplog: pytest.LogCaptureFixture
) -> None:
    good = _good(4).SerializeToString()
    truncated_obs = b"\x1a\x7f" + b"\x0a\x05"  # field 3 (observation), length 127, 4 bytes follow
    bad_utf8 = b"\x12\x02\xff\xfe"  # field 2 (request_id), not UTF-8
    assert bad_field(truncated_obs, pb.ActRequest.DESCRIPTOR) == "observation"
    assert bad_field(bad_utf8, pb.ActRequest.DESCRIPTOR) == "request_id"
    assert bad_field(good, pb.ActRequest.DESCRIPTOR) is None
    with grpc.insecure_channel(server.address) as ch:
        act = ch.unary_unary(f"/{SERVICE_NAME}/Act", request_serializer=None, response_deserializer=None)
        info = ch.unary_unary(f"/{SERVICE_NAME}/GetInfo", request_serializer=None, response_deserializer=None)
        with caplog.at_level(logging.WARNING, logger="vla_rl.server"):
            for payload, field in [(truncated_obs, "observation"), (bad_utf8, "request_id")] * 25:
                with pytest.raises(grpc.RpcError) as err:
                    act(payload, timeout=10)
                assert err.value.code() == SC.INVALID_ARGUMENT and err.value.details().startswith(field)
            with pytest.raises(grpc.RpcError) as err:
                info(b"\x0a\x05ab", timeout=10)
            assert err.value.code() == SC.INVALID_ARGUMENT and "model_id" in err.value.details()
    records = [r for r in caplog.records if r.name == "vla_rl.server"]
    assert len(records) <= 2 and not any(r.exc_info for r in records)  # one per peer per interval
    replies = _stream(server.address, [truncated_obs, _good(5)])  # a stream survives garbage too
    assert replies[0].error.code == SC.INVALID_ARGUMENT.value[0] and "observation" in replies[0].error.message
    assert not replies[1].HasField("error")


def test_rate_limited_log_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    rl = RateLimitedLog(logging.getLogger("vla_rl.server"), interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="vla_rl.server"):
        logged = [rl.warning("peer-a", "kind", "bad") for _ in range(100)]
        assert rl.warning("peer-b", "kind", "bad")  # another peer is not silenced by peer-a
        time.sleep(0.25)
        assert rl.warning("peer-a", "kind", "bad")
    assert sum(logged) == 1
    assert caplog.records[-1].suppressed == 99  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- 4. resource limits
def test_message_limit_is_derived_from_the_spec(ckpts: dict[str, Path], server: PolicyServer) -> None:
    big = RobotSpec("arm", 7, 7, 10.0, "x", cameras=(CameraSpec("a", 480, 640), CameraSpec("b", 480, 640)))
    # cameras (2x raw), state, noise [50, 7], RTC's queued actions [50, 7 robot dims], slack
    assert request_bytes_for(big, (50, 7)) == 2 * 2 * 480 * 640 * 3 + 28 + 1400 + 1400 + 64 * 1024
    assert server._message_limit == 1024 * 1024  # tiny spec: the 1 MiB floor
    with grpc.insecure_channel(server.address) as ch:
        act = pb_grpc.PolicyServiceStub(ch).Act
        req = _good(6)
        req.observation.instruction = "x" * (2 * 1024 * 1024)  # refused by grpc before our code runs
        with pytest.raises(grpc.RpcError) as err:
            act(req, timeout=10)
        assert err.value.code() == SC.RESOURCE_EXHAUSTED


def test_concurrent_rpcs_are_capped(ckpts: dict[str, Path]) -> None:
    srv = start_server({"arm": ckpts["a"]}, max_concurrent_rpcs=2)
    release = threading.Event()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)

            def held() -> Iterator[pb.ActRequest]:
                yield _good(1)
                release.wait(10)

            streams = [stub.StreamAct(held(), timeout=20) for _ in range(2)]
            for s in streams:
                assert not next(s).HasField("error")  # both open and answered
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(pb.GetInfoRequest(), timeout=10)
            assert err.value.code() == SC.RESOURCE_EXHAUSTED
            release.set()
            for s in streams:
                list(s)
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).models
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
    finally:
        release.set()
        srv.stop()


def test_one_connection_cannot_fill_the_queue(ckpts: dict[str, Path]) -> None:
    version = ServedVersion(load_policy(ckpts["a"], device="cpu"))
    queue = BatchQueue("arm", max_batch=1, max_wait_us=0, max_queue=10, max_peer_queued=2)
    slot = ModelSlot("arm", version, queue)
    item = dict(state=np.zeros(5, np.float32), cameras={}, instruction="", seed=0, noise=None, deadline=None)
    for _ in range(2):
        slot.submit(_Pending(**item, enqueued_ns=0, peer="flood"))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="max_peer_queued"):
        slot.submit(_Pending(**item, enqueued_ns=0, peer="flood"))  # type: ignore[arg-type]
    slot.submit(_Pending(**item, enqueued_ns=0, peer="robot"))  # type: ignore[arg-type]
    assert [p.peer for p in slot.queue.take() or []] == ["flood"]  # FIFO among equals...
    assert [p.peer for p in slot.queue.take() or []] == [
        "robot"
    ]  # ...but the least-served connection goes first


ATTACKER = """
import sys, grpc
address, n, req = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
def gen():
    while True:
        yield req
calls = []
for _ in range(n):
    ch = grpc.insecure_channel(address)
    method = ch.stream_stream("/vla_rl.v1.PolicyService/StreamAct", request_serializer=None, response_deserializer=None)
    calls.append((ch, method(gen())))  # replies never read
print("started", flush=True)
sys.stdin.read()
"""


def _paced_robot(srv: PolicyServer, n: int = 25) -> tuple[float, float]:
    """A robot asking at ~40 Hz (closed loop: the next request after the reply): its median latency, and
    the median number of forward passes the server ran while it waited (its own included)."""
    obs = make_obs(np.random.default_rng(7))
    slot = srv.slots["arm"]
    times, batches = [], []
    with PolicyClient(srv.address, timeout_s=20, model_id="arm") as c:
        c.act(obs, seed=0)
        for i in range(n):
            b0, t0 = slot.batches, time.perf_counter()
            c.act(obs, seed=i)
            times.append(time.perf_counter() - t0)
            batches.append(slot.batches - b0)
            time.sleep(0.025)
    return statistics.median(times), statistics.median(batches)


FLOODERS = 24


# Timing under a real flood: on a 2-core machine shared with the rest of the suite it measured 8 batches
# waited once (3 alone), so it runs with `-m slow`; CI keeps the deterministic ordering check above
# (test_one_connection_cannot_fill_the_queue).
@pytest.mark.slow
def test_streams_that_never_read_do_not_slow_a_robot(ckpts: dict[str, Path], tmp_path: Path) -> None:
    srv = start_server({"arm": ckpts["a"]}, max_batch=4, max_wait_us=2000)
    proc = None
    (tmp_path / "req.bin").write_bytes(_good(1).SerializeToString())
    try:
        baseline, _ = _paced_robot(srv)
        proc = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, srv.address, str(FLOODERS), str(tmp_path / "req.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        slot = srv.slots["arm"]
        before = slot.served
        deadline = time.monotonic() + 30
        while slot.served - before < 200:  # the flood is on
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        flooded, waited = _paced_robot(srv)
        assert slot.served - before > 300  # the attackers kept the model busy throughout
        # First in line, whatever the flood: the batch running when it arrived, then its own (FIFO would
        # put it behind every flooder's request: FLOODERS / max_batch = 6 batches). Counted, not timed.
        assert waited <= 3, waited
        # Latency: without least-served-first batching ~12-16x here (13x in the attack report); with it
        # ~5-10x, the rest being the flood's CPU on this shared machine (the attacker runs on the same
        # cores). A generous bound, not a flaky one.
        assert flooded < max(20 * baseline, baseline + 0.1), (baseline, flooded)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        srv.stop(0.5)


def test_a_stream_whose_replies_are_not_read_is_closed(ckpts: dict[str, Path]) -> None:
    """Replies the robot does not read fill its flow-control window (small here: no BDP growth); the
    server then holds one reply for that stream, reads no more of its requests, and closes it after
    stream_write_timeout_s. Other robots are served meanwhile and after."""
    srv = start_server({"arm": ckpts["a"]}, stream_write_timeout=0.5)
    stop = threading.Event()
    req = _good(1).SerializeToString()

    def flood() -> Iterator[bytes]:
        while not stop.is_set():
            yield req

    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    try:
        with grpc.insecure_channel(srv.address, options=opts) as ch:
            call = ch.stream_stream(f"/{SERVICE_NAME}/StreamAct", request_serializer=None)(
                flood(), timeout=20
            )
            slot = srv.slots["arm"]
            time.sleep(1.0)
            served = slot.served
            time.sleep(0.5)
            assert slot.served == served < 200  # bounded, then nothing more for a robot that does not read
            with PolicyClient(srv.address, timeout_s=10, model_id="arm") as c:
                assert c.act(make_obs(np.random.default_rng(0)), seed=1).actions.shape == (H, A)
            stop.set()
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert (
                err.value.code() == SC.RESOURCE_EXHAUSTED and "stream_write_timeout_s" in err.value.details()
            )
    finally:
        stop.set()
        srv.stop(0.5)


# ------------------------------------------------------------------------------------- 5. config vs weights
@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda mc: mc.update(d_model=4096), ["model_config implies", "shape"]),
        (lambda mc: mc.update(n_layers=12), ["weights do not match the config", "missing"]),
        (lambda mc: mc.update(d_model=10**9), ["model_config.d_model", "16384"]),
        (lambda mc: mc.update(n_layers=-1), ["model_config.n_layers"]),
        (lambda mc: mc.update(noise_head_hidden=[10**8]), ["model_config.noise_head_hidden"]),
        (lambda mc: mc.update(num_inference_steps=10**7), ["model_config.num_inference_steps"]),
    ],
)
def test_config_is_checked_against_the_weights_before_building(
    ckpts: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None], words: list[str]
) -> None:
    folder = _edit_config(_copy(ckpts["a"], tmp_path / "c"), lambda c: edit(c["model_config"]))
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        load_policy(folder, device="cpu")
    assert time.monotonic() - t0 < 5  # nothing of the implied (GB) size was built
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_malformed_safetensors_header_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(ckpts["a"], tmp_path / "c")
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # claims a 1 TB header
    _edit_config(
        folder, lambda c: c["files"].update({WEIGHTS_FILE: hashlib.sha256(weights.read_bytes()).hexdigest()})
    )
    with pytest.raises(CheckpointError, match="header length"):
        load_policy(folder, device="cpu")


# ------------------------------------------------------------------------------------- 6. sampler inputs
def test_absurd_inputs_and_non_finite_actions_are_errors(server: PolicyServer) -> None:
    def with_noise(value: float) -> pb.ActRequest:
        req = _good(8)
        req.ClearField("seed")
        req.noise.CopyFrom(to_tensor(np.full((H, A), value, np.float32)))
        return req

    big_state = _good(9)
    big_state.observation.state.CopyFrom(to_tensor(np.full(SPEC.state_dim, 1e30, np.float32)))
    replies = _stream(server.address, [with_noise(1e30), _good(1), big_state, with_noise(3.0)])
    assert replies[0].error.code == SC.INVALID_ARGUMENT.value[0]
    assert "noise" in replies[0].error.message and "max_noise_abs" in replies[0].error.message
    assert not replies[1].HasField("error")
    assert "max_state_abs" in replies[2].error.message
    assert (
        not replies[3].HasField("error") and np.isfinite(np.frombuffer(replies[3].actions.data, "<f4")).all()
    )

    slot = server.slots["arm"]
    real = slot.active.infer_scored  # what the batcher calls

    def nan_for_odd_seeds(
        states: Any, cams: Any, instr: Any, noise: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        out, score = real(states, cams, instr, noise)
        out[noise[:, 0, 0] < 0] = np.nan  # some rows non-finite, as a broken model would give
        return out, score

    slot.active.infer_scored = nan_for_odd_seeds  # type: ignore[method-assign]
    try:
        got = _stream(server.address, [with_noise(-1.0), with_noise(1.0)])
    finally:
        slot.active.infer_scored = real  # type: ignore[method-assign]
    assert got[0].error.code == SC.INTERNAL.value[0] and "NaN or inf" in got[0].error.message
    assert not got[1].HasField("error")


def test_sampler_validates_its_inputs(ckpts: dict[str, Path]) -> None:
    policy = load_policy(ckpts["a"], device="cpu").policy
    obs = make_obs(np.random.default_rng(0))
    batch = {"state": obs["state"][None], "cameras": {k: v[None] for k, v in obs["cameras"].items()}}
    batch["instruction"] = [SPEC.instruction]
    with pytest.raises(ValueError, match="noise: expected finite"):
        policy.predict_action_chunk(batch, noise=torch.full((1, H, A), float("nan")))
    with pytest.raises(ValueError, match="num_steps"):
        policy.predict_action_chunk(batch, num_steps=10**6)


# ------------------------------------------------------------------------------------- 7. CLI: token + limits
def test_serve_token_file_and_limit_errors(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from vla_rl.cli.common import CliError, build_config
    from vla_rl.cli.services import _read_token_file, serve

    good = tmp_path / "token"
    good.write_text("s3cret\n")
    assert _read_token_file(good) == "s3cret"
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path):
        with pytest.raises(CliError, match="--token-file"):
            serve(ServerConfig(checkpoint=str(ckpts["a"]), token_file=path))
    with pytest.raises(CliError, match="--load-timeout"):  # how the CLI builds its config from the flags
        serve(build_config(ServerConfig, {"checkpoint": str(ckpts["a"]), "load_timeout": 0}))
    with pytest.raises(CliError, match="--max-concurrent-rpcs"):
        serve(build_config(ServerConfig, {"checkpoint": str(ckpts["a"]), "max_concurrent_rpcs": 0}))
    with pytest.raises(ValueError, match="max_peer_queued"):
        ServerConfig(checkpoint=str(ckpts["a"]), max_peer_queued=0)

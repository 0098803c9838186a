"""The local transport (``--local-socket``: ActRequest / ActResponse frames on a Unix socket, without gRPC):
the same chunks, routing, errors and timing fields as a gRPC stream, its bounds (the frame size, the
greeting, the number of connections), reconnecting after a restart, and the socket's rules."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_server import make_checkpoint, make_obs, start_server
from test_server_timing import check_timing
from vla_rl_client.action_queue import QueuedPolicy
from vla_rl_client.local_client import HEADER, MAGIC, LocalPolicyClient
from vla_rl_client.policy_client import PolicyClient, PolicyError
from vla_rl_client.policy_common import build_request
from vla_rl_client.proto import policy_service_pb2 as pb

from server.config import ServerConfig
from server.policy_server import PolicyServer

SC = grpc.StatusCode


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("local")
    return {"arm": make_checkpoint(root / "a", 0), "arm_b": make_checkpoint(root / "b", 1)}


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    path = tmp_path_factory.mktemp("run") / "vla" / "local.sock"
    srv = start_server(ckpts, local_socket=path, max_message_bytes=1024 * 1024)
    yield srv
    srv.stop()


def _raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def _read_reply(s: socket.socket) -> pb.ActResponse:
    f = s.makefile("rb")
    (size,) = HEADER.unpack(f.read(HEADER.size))
    return pb.ActResponse.FromString(f.read(size))


def test_same_chunks_routing_and_timing_as_grpc(server: PolicyServer) -> None:
    path = server.local_socket
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    obs = make_obs(np.random.default_rng(0))
    with PolicyClient(server.address, timeout_s=10) as g, LocalPolicyClient(path, timeout_s=10) as c:
        for model in ("arm", "arm_b"):
            want = g.act(obs, seed=5, model_id=model)
            got = c.act(obs, seed=5, model_id=model)
            np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-6)
            assert (got.commit, got.model_id, got.seed, got.n_exec) == (want.commit, model, 5, want.n_exec)
            check_timing(got.timing)
        # a refused request is an error naming the field; the connection stays and serves the next
        with pytest.raises(PolicyError) as err:
            c.act(obs, seed=1, model_id="nope")
        assert err.value.code == SC.NOT_FOUND and "model_id" in err.value.message
        with pytest.raises(PolicyError) as err:
            c.act({**obs, "state": np.zeros(2, np.float32)}, model_id="arm")
        assert err.value.code == SC.INVALID_ARGUMENT and "observation.state" in err.value.message
        assert c.act(obs, seed=1, model_id="arm").actions.shape == (4, 3)
        assert c.retries == 0, "one connection throughout"
    # a control loop's queue takes it as its fetch, as it takes PolicyClient.act
    with LocalPolicyClient(path, timeout_s=10, model_id="arm") as c, QueuedPolicy(c.act) as qp:
        actions = [qp.act(obs) for _ in range(5)]
    assert all(a.shape == (3,) and np.isfinite(a).all() for a in actions) and qp.requests >= 2


def test_frames_it_refuses(server: PolicyServer, ckpts: dict[str, Path]) -> None:
    path = server.local_socket
    assert path is not None
    with _raw(path) as s:  # bytes that are not an ActRequest: an error reply, the connection stays
        s.sendall(MAGIC)
        assert s.recv(len(MAGIC)) == MAGIC
        (limit,) = HEADER.unpack(s.recv(HEADER.size))
        assert limit == server.max_request_bytes
        s.sendall(HEADER.pack(3) + b"\xff\xff\xff")
        reply = _read_reply(s)
        assert reply.error.code == SC.INVALID_ARGUMENT.value[0] and "not a valid" in reply.error.message
    with _raw(path) as s:  # a frame over the server's limit: answered, then closed unread
        s.sendall(MAGIC + HEADER.pack(limit + 1))
        f = s.makefile("rb")
        assert f.read(len(MAGIC) + HEADER.size)[: len(MAGIC)] == MAGIC
        (size,) = HEADER.unpack(f.read(HEADER.size))
        reply = pb.ActResponse.FromString(f.read(size))
        assert reply.error.code == SC.RESOURCE_EXHAUSTED.value[0] and str(limit) in reply.error.message
        assert f.read(1) == b"", "closed"
    with _raw(path) as s:  # no greeting (a gRPC client, say): closed without a word
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert s.recv(64) == b""
    # the client refuses a request over the server's limit before sending it
    with LocalPolicyClient(path, timeout_s=10, model_id="arm") as c:
        big = {"state": np.zeros(5, np.float32), "cameras": {"front": np.zeros((600, 600, 3), np.uint8)}}
        with pytest.raises(PolicyError) as err:
            c.act(big)
        assert err.value.code == SC.RESOURCE_EXHAUSTED and f"server's limit of {limit}" in err.value.message
    # a gRPC socket is not a local socket: said plainly, not retried until the deadline
    grpc_only = start_server({"arm": ckpts["arm"]}, tcp=False, unix_socket=path.parent / "grpc.sock")
    try:
        t0 = time.monotonic()
        with (
            LocalPolicyClient(path.parent / "grpc.sock", timeout_s=5) as c,
            pytest.raises(PolicyError) as err,
        ):
            c.act(make_obs(np.random.default_rng(0)))
        assert err.value.code == SC.FAILED_PRECONDITION and "--local-socket" in err.value.message
        assert time.monotonic() - t0 < 4
    finally:
        grpc_only.stop()


def test_requests_sent_together_are_answered_one_by_one_in_order(server: PolicyServer) -> None:
    path = server.local_socket
    assert path is not None
    reqs = [
        build_request(make_obs(np.random.default_rng(k)), model_id="arm", seed=k, request_id=f"r{k}")
        for k in range(3)
    ]
    with _raw(path) as s:
        s.sendall(MAGIC)
        f = s.makefile("rb")
        assert f.read(len(MAGIC) + HEADER.size)[: len(MAGIC)] == MAGIC
        frames = [req.SerializeToString() for req in reqs]
        s.sendall(b"".join(HEADER.pack(len(d)) + d for d in frames))  # in one write: read as it comes
        for req in reqs:
            (size,) = HEADER.unpack(f.read(HEADER.size))
            reply = pb.ActResponse.FromString(f.read(size))
            assert (reply.request_id, reply.seed) == (req.request_id, req.seed) and not reply.HasField(
                "error"
            )


def test_a_robot_that_does_not_read_its_replies_is_dropped(
    ckpts: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s" / "l.sock"
    srv = start_server({"arm": ckpts["arm"]}, local_socket=path, stream_write_timeout=0.5)
    transport = srv._local
    assert transport is not None and srv._loop is not None

    async def small_buffers() -> None:  # on the server's loop: its buffers fill after a few replies
        for conn in transport._connections:
            conn._transport.set_write_buffer_limits(high=1)  # type: ignore[union-attr]
            sock = conn._transport.get_extra_info("socket")  # type: ignore[union-attr]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    frame = build_request(make_obs(np.random.default_rng(0)), model_id="arm", seed=1).SerializeToString()
    try:
        with _raw(path) as s:
            s.sendall(MAGIC)
            assert s.recv(len(MAGIC) + HEADER.size)[: len(MAGIC)] == MAGIC
            asyncio.run_coroutine_threadsafe(small_buffers(), srv._loop).result(5)
            s.setblocking(False)
            deadline, pending = time.monotonic() + 60, b""
            while transport.connections:  # requests sent whole, replies never read
                assert time.monotonic() < deadline, "still served"
                pending = pending or HEADER.pack(len(frame)) + frame
                with contextlib.suppress(BlockingIOError):
                    pending = pending[s.send(pending) :]
                time.sleep(0.002)
        assert any("replies not read" in r.getMessage() for r in caplog.records)
        with LocalPolicyClient(path, timeout_s=10, model_id="arm") as c:  # the others are served as before
            assert c.act(make_obs(np.random.default_rng(0)), seed=1).actions.shape == (4, 3)
    finally:
        srv.stop()


def test_connections_beyond_the_limit_are_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    srv = start_server({"arm": ckpts["arm"]}, local_socket=tmp_path / "s" / "l.sock", max_concurrent_rpcs=1)
    try:
        obs = make_obs(np.random.default_rng(0))
        with LocalPolicyClient(tmp_path / "s" / "l.sock", timeout_s=10) as first:
            first.act(obs, seed=0)
            with LocalPolicyClient(tmp_path / "s" / "l.sock", timeout_s=10) as second:
                with pytest.raises(PolicyError) as err:
                    second.act(obs, seed=0)
                assert err.value.code == SC.RESOURCE_EXHAUSTED and "max_concurrent_rpcs" in err.value.message
            first.act(obs, seed=1)
    finally:
        srv.stop()


def test_reconnects_after_a_restart_and_socket_rules(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "s" / "l.sock"
    path.parent.mkdir(mode=0o700)
    obs = make_obs(np.random.default_rng(0))
    with LocalPolicyClient(
        path, timeout_s=0.3, model_id="arm"
    ) as c:  # nothing there: retried, then UNAVAILABLE
        with pytest.raises(PolicyError) as err:
            c.act(obs, seed=2)
        assert err.value.code == SC.UNAVAILABLE and c.retries > 0, err.value
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(path))  # a socket nobody listens on: refused, the same
            with pytest.raises(PolicyError) as err:
                c.act(obs, seed=2)
            assert err.value.code == SC.UNAVAILABLE, err.value
    with pytest.raises(ValueError, match="local_socket: expected a path other than unix_socket's"):
        ServerConfig(checkpoint="x", unix_socket=path, local_socket=path)
    with pytest.raises(ValueError, match=r"local_socket: expected a path without '\.\.'"):
        ServerConfig(checkpoint="x", local_socket=tmp_path / ".." / "l.sock")
    srv = start_server({"arm": ckpts["arm"]}, local_socket=path)  # the stale socket replaced
    with LocalPolicyClient(path, timeout_s=30, model_id="arm") as c:
        first = c.act(obs, seed=2).actions
        srv.stop()
        assert not path.exists(), "removed on stop"
        srv = start_server({"arm": ckpts["arm"]}, local_socket=path)
        try:
            np.testing.assert_allclose(c.act(obs, seed=2).actions, first, rtol=0, atol=1e-6)
            assert c.retries >= 1
        finally:
            srv.stop()
    path.parent.chmod(0o755)
    with pytest.raises(ValueError, match="open to other users"):
        start_server({"arm": ckpts["arm"]}, local_socket=path)


def test_a_draining_server_closes_after_each_reply(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "s" / "l.sock"
    srv = start_server({"arm": ckpts["arm"]}, local_socket=path)
    try:
        obs = make_obs(np.random.default_rng(0))
        with LocalPolicyClient(path, timeout_s=10) as c:
            c.act(obs, seed=0)
            srv.drain()
            # answered (on a new connection if the server saw the drain before it went back to reading the
            # connection that answered seed 0); then the server closes the connection
            c.act(obs, seed=1)
            after_first = c.retries
            assert after_first <= 1
            c.act(obs, seed=2)  # served again on a new connection (no replica to move to here)
            assert c.retries == after_first + 1
    finally:
        srv.stop()


def test_stop_answers_the_request_in_flight_and_ends_every_connection(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "s" / "l.sock"
    srv = start_server({"arm": ckpts["arm"]}, local_socket=path)
    transport = srv._local
    assert transport is not None
    answer = transport.service._stream_reply

    async def slow_reply(req: pb.ActRequest, ctx: object) -> pb.ActResponse:
        await asyncio.sleep(0.5)
        return await answer(req, ctx)  # type: ignore[arg-type]

    obs = make_obs(np.random.default_rng(0))
    with (
        LocalPolicyClient(path, timeout_s=10, model_id="arm", backoff=None) as c,
        _raw(path) as idle,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        c.act(obs, seed=0)
        idle.sendall(MAGIC)
        assert idle.recv(len(MAGIC) + HEADER.size)[: len(MAGIC)] == MAGIC  # greeted, then idle
        with pytest.raises(
            RuntimeError, match="event loop"
        ):  # off the server's loop: refused, nothing touched
            asyncio.run(transport.stop(1.0))
        transport.service._stream_reply = slow_reply  # type: ignore[method-assign]
        in_flight = pool.submit(c.act, obs, seed=1)
        deadline = time.monotonic() + 10
        while not any(conn.busy for conn in transport._connections):
            assert time.monotonic() < deadline, "the request never reached the server"
            time.sleep(0.01)
        srv.stop(grace_s=5.0)
        assert in_flight.result(10).actions.shape == (4, 3), "answered before its connection closed"
        assert c.retries == 0
        assert idle.recv(1) == b"", "the idle connection closed"
    assert not transport._connections and not srv._thread.is_alive() and not path.exists()

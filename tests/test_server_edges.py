"""Policy server edges (issue 45, item 9): what one connection may have in flight over streams that never
read, errors that quote a client's value without echoing megabytes, and the request size limit reported
in GetInfo and checked by the client library before sending.

Real servers and gRPC clients on 127.0.0.1 with the tiny checkpoints of ``test_server``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from test_server import A, H, make_checkpoint, make_obs, start_server
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import PolicyClient, PolicyError, build_request
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc

from server.guard import MIN_DERIVED_MESSAGE_BYTES
from server.policy_server import PolicyServer
from server.service import SERVICE_NAME
from vla_rl.core.rpc import echo

torch.set_num_threads(1)
SC = grpc.StatusCode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("edges") / "a", 0)


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[PolicyServer]:
    srv = start_server({"arm": ckpt}, max_batch=4, max_wait_us=2000)
    yield srv
    srv.stop()


def _good(seed: int = 1) -> pb.ActRequest:
    return build_request(
        make_obs(np.random.default_rng(seed)), model_id="arm", seed=seed, request_id=f"g{seed}"
    )


# ------------------------------------------------------------------------------------------ in flight
def _batch_share_of_non_readers(srv: PolicyServer, streams: int) -> float:
    """Open ``streams`` StreamAct calls on one connection that send and never read, until the server stops
    serving them: the mean batch size of what it ran for them (one connection: its share of each batch).
    A robot on another connection must still be answered meanwhile."""
    stop = threading.Event()
    req = _good(1).SerializeToString()

    def flood() -> Iterator[bytes]:
        while not stop.is_set():
            yield req

    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]  # small windows
    slot = srv.slots["arm"]
    served, batches = slot.served, slot.batches
    try:
        with grpc.insecure_channel(srv.address, options=opts) as ch:
            method = ch.stream_stream(f"/{SERVICE_NAME}/StreamAct", request_serializer=None)
            calls = [method(flood(), timeout=30) for _ in range(streams)]
            counts = [0]
            deadline = time.monotonic() + 15
            while len(counts) < 4 or counts[-1] != counts[-4]:  # until 0.75 s without a request served
                assert time.monotonic() < deadline, counts
                time.sleep(0.25)
                counts.append(slot.served - served)
            share = counts[-1] / max(slot.batches - batches, 1)
            with PolicyClient(srv.address, timeout_s=10, model_id="arm") as c:
                t0 = time.perf_counter()
                assert c.act(make_obs(np.random.default_rng(0)), seed=1).actions.shape == (H, A)
                assert time.perf_counter() - t0 < 5
            stop.set()
            for call in calls:
                call.cancel()
    finally:
        stop.set()
    return share


def test_one_connection_holds_at_most_its_in_flight_slots(ckpt: Path) -> None:
    """8 streams on one connection that send and never read: each request holds one of the connection's
    max_peer_in_flight slots from before it is decoded until its reply is written, so the connection never
    has more than 2 requests in a batch (batches wait up to 20 ms to fill to 8 here). Without the cap its
    streams filled every batch, and a robot that reads waited behind them."""
    knobs = {"max_batch": 8, "max_wait_us": 20_000, "adaptive_wait": False}
    capped = start_server({"arm": ckpt}, max_peer_in_flight=2, **knobs)
    try:
        share = _batch_share_of_non_readers(capped, streams=8)
    finally:
        capped.stop(0.5)
    roomy = start_server({"arm": ckpt}, max_peer_in_flight=1000, **knobs)
    try:
        uncapped = _batch_share_of_non_readers(roomy, streams=8)
    finally:
        roomy.stop(0.5)
    assert share <= 2.0 < uncapped, (share, uncapped)


def test_a_connection_over_its_slots_waits_instead_of_failing(server: PolicyServer) -> None:
    """A client that multiplexes more robots than max_peer_in_flight (16) over one channel is served, only
    in turns: nothing is refused."""

    async def many() -> list[int]:
        async with AsyncPolicyClient(server.address, timeout_s=30, model_id="arm") as c:
            obs = make_obs(np.random.default_rng(3))
            results = await asyncio.gather(*(c.act(obs, seed=i) for i in range(40)))
        return [r.actions.shape[0] for r in results]

    assert asyncio.run(many()) == [H] * 40


# ------------------------------------------------------------------------------------------ echoes
def test_errors_quote_a_long_value_cut_short(server: PolicyServer) -> None:
    """A 512 KiB model_id was echoed into the status details (trailing metadata) until the reply broke
    gRPC's metadata limit; it is quoted cut to 64 characters, with its length."""
    long_id = "m" * (512 * 1024)
    req = _good(2)
    req.model_id = long_id
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.PolicyServiceStub(ch).Act(req, timeout=10)
    assert err.value.code() == SC.NOT_FOUND
    details = err.value.details() or ""
    assert details.startswith("model_id: expected one of ['arm'], got 'mmmm") and len(details) < 200, details[
        :300
    ]
    assert f"({len(long_id)} characters)" in details
    reply = list(
        grpc.insecure_channel(server.address).stream_stream(
            f"/{SERVICE_NAME}/StreamAct",
            request_serializer=pb.ActRequest.SerializeToString,
            response_deserializer=pb.ActResponse.FromString,
        )(iter([req, _good(3)]), timeout=10)
    )
    assert reply[0].error.code == SC.NOT_FOUND.value[0] and len(reply[0].error.message) < 200
    assert not reply[1].HasField("error")  # the stream carries on
    assert echo("abc") == "'abc'" and echo("x" * 100, limit=4) == "'xxxx'... (100 characters)"


# ------------------------------------------------------------------------------------------ request size
def _oversize_obs() -> dict[str, object]:
    """A raw 800x600 frame where the spec wants 16x16: 1.4 MB, over the server's 1 MiB limit."""
    obs = make_obs(np.random.default_rng(4))
    obs["cameras"] = {"front": np.zeros((600, 800, 3), np.uint8)}
    return obs


def test_the_request_limit_is_reported_and_checked_by_the_client(server: PolicyServer) -> None:
    with PolicyClient(server.address, timeout_s=10, model_id="arm") as c:
        info = c.get_info()
        assert info.max_request_bytes == server.max_request_bytes == MIN_DERIVED_MESSAGE_BYTES  # tiny spec
        with pytest.raises(PolicyError) as err:
            c.act(_oversize_obs(), seed=1)
        assert err.value.code == SC.RESOURCE_EXHAUSTED and "max_request_bytes" in err.value.message
        assert str(MIN_DERIVED_MESSAGE_BYTES) in err.value.message
        with c.stream() as s:
            with pytest.raises(PolicyError, match="over the server's limit"):
                s.act(_oversize_obs(), seed=1)
            # Refused before sending: the stream was not ended by gRPC and serves the next request as is.
            assert s.act(make_obs(np.random.default_rng(5)), seed=2).actions.shape == (H, A)
            assert s.reopened == 0

    async def aio() -> None:
        async with AsyncPolicyClient(server.address, timeout_s=10, model_id="arm") as c:
            with pytest.raises(PolicyError, match="max_request_bytes"):
                await c.act(_oversize_obs(), seed=1)
            s = c.stream()
            with pytest.raises(PolicyError, match="max_request_bytes"):
                await s.act(_oversize_obs(), seed=1)
            assert (await s.act(make_obs(np.random.default_rng(5)), seed=2)).actions.shape == (H, A)
            assert s.reopened == 0
            await s.close()

    asyncio.run(aio())

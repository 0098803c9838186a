"""The shared gRPC service shell (vla_rl/core/rpc.py): each piece alone, then together in a real grpc.aio
server on loopback (garbage bytes answered INVALID_ARGUMENT naming the field, tokens checked)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest
from vla_rl_client.proto import policy_service_pb2 as pb

from vla_rl.core.rpc import (
    MAX_FIELDS_WALKED,
    RateLimitedLog,
    RequestError,
    SigtermFlag,
    Undecodable,
    abort,
    bad_field,
    bearer_credential,
    bearer_matches,
    read_varint,
    require_bearer,
    safe_deserializer,
    stream_handler,
    unary_handler,
    unauthenticated,
    wait_for_stop,
)

SC = grpc.StatusCode
LOG = logging.getLogger("vla_rl.test_rpc")
TRUNCATED_OBSERVATION = (
    b"\x1a\x7f" + b"\x0a\x05"
)  # ActRequest field 3 (observation), length 127, 4 bytes follow
BAD_UTF8 = b"\x12\x02\xff\xfe"  # ActRequest field 2 (request_id), not UTF-8


# ----------------------------------------------------------------------------------------------- errors
def test_request_error_carries_code_and_message() -> None:
    e = RequestError(SC.NOT_FOUND, "model_id: expected one of ['a'], got 'b'")
    assert e.code == SC.NOT_FOUND and e.message.startswith("model_id:")
    assert str(e) == "NOT_FOUND: model_id: expected one of ['a'], got 'b'"


def test_rate_limited_log_per_peer_and_kind(caplog: pytest.LogCaptureFixture) -> None:
    rl = RateLimitedLog(LOG, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert [rl.warning("p1", "undecodable", "bad", error="x") for _ in range(5)] == [True] + [False] * 4
        assert rl.warning("p1", "slow-reader", "slow")  # another kind of the same peer is not held back
        assert rl.warning("p2", "undecodable", "bad")  # nor another peer
        time.sleep(0.25)
        assert rl.warning("p1", "undecodable", "bad again", exc_info=False)
    records = [r for r in caplog.records if r.name == LOG.name]
    assert [r.getMessage() for r in records] == ["bad", "slow", "bad", "bad again"]
    last: Any = records[-1]
    assert (last.peer, last.kind, last.suppressed) == ("p1", "undecodable", 4)
    assert records[0].error == "x" and not any(r.exc_info for r in records)  # type: ignore[attr-defined]


def test_rate_limited_log_forgets_quiet_keys_past_its_bound() -> None:
    rl = RateLimitedLog(LOG, interval_s=0.05)
    rl.MAX_KEYS = 10  # type: ignore[misc]
    for i in range(10):
        rl.warning(f"p{i}", "k", "x")
    time.sleep(0.06)
    rl.warning("new", "k", "x")
    assert set(rl._last) == {("new", "k")}  # the quiet ones were dropped, not the map grown
    with pytest.raises(ValueError, match="interval_s: expected seconds >= 0"):
        RateLimitedLog(LOG, interval_s=-1)


# ----------------------------------------------------------------------------------------------- bytes
def test_read_varint() -> None:
    assert read_varint(b"\x05", 0) == (5, 1)
    assert read_varint(b"\xff\xac\x02\x00", 1) == (300, 3)  # 0xac 0x02 = 300, read from position 1
    assert read_varint(memoryview(b"\x96\x01"), 0) == (150, 2)
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\x80\x80", 0)  # continuation bit on the last byte
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\xac\x02", 0, end=1)  # runs past ``end``
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\xff" * 11, 0)  # more than 64 bits


def test_bad_field_names_the_first_broken_field() -> None:
    desc = pb.ActRequest.DESCRIPTOR
    good = pb.ActRequest(request_id="r", model_id="m", seed=3).SerializeToString()
    assert bad_field(good, desc) is None
    assert bad_field(TRUNCATED_OBSERVATION, desc) == "observation"
    assert bad_field(BAD_UTF8, desc) == "request_id"
    assert bad_field(b"\x80", desc) == "request"  # the first key itself is cut off
    assert bad_field(b"\xfa\x3e\x05ab", desc) == "field 1007"  # an unknown field, its length past the end
    dtype = b"\x0a\x01\xff"  # Tensor.dtype, not UTF-8
    state = b"\x0a" + bytes([len(dtype)]) + dtype  # Observation.state
    assert bad_field(b"\x1a" + bytes([len(state)]) + state, desc) == "observation.state.dtype"


def test_bad_field_reads_a_bounded_number_of_fields() -> None:
    """Tiny unknown fields before a broken one: each costs a step of the walk (which runs on the event
    loop, for anyone), so past ``max_fields`` the broken field goes unnamed instead of costing seconds."""
    desc = pb.ActRequest.DESCRIPTOR
    crafted = b"\x78\x01" * 50 + TRUNCATED_OBSERVATION  # 50 x unknown field 15 (a varint), then the break
    assert bad_field(crafted, desc, max_fields=51) == "observation"
    assert bad_field(crafted, desc, max_fields=50) is None
    inner = b"\x78\x01" * 10 + b"\x80"  # 10 unknown fields, then a key cut off
    nested = b"\x1a" + bytes([len(inner)]) + inner  # inside observation: nested fields count too
    assert bad_field(nested, desc, max_fields=12) == "observation"
    assert bad_field(nested, desc, max_fields=11) is None
    flood = b"\x78\x01" * MAX_FIELDS_WALKED + TRUNCATED_OBSERVATION
    assert bad_field(flood, desc) is None
    assert safe_deserializer(pb.ActRequest)(flood) == Undecodable(
        "vla_rl.v1.ActRequest", "request", len(flood)
    )


def test_safe_deserializer_returns_undecodable_instead_of_raising() -> None:
    parse = safe_deserializer(pb.ActRequest)
    req = pb.ActRequest(request_id="r")
    assert parse(req.SerializeToString()) == req
    got = parse(BAD_UTF8)
    assert got == Undecodable("vla_rl.v1.ActRequest", "request_id", len(BAD_UTF8))
    assert got.message == "request_id: the request is not a valid vla_rl.v1.ActRequest protobuf (4 bytes)"


# ----------------------------------------------------------------------------------------------- tokens
def test_bearer_tokens() -> None:
    assert bearer_credential(None) == ""
    assert bearer_credential([("x-other", "1"), ("authorization", "Bearer t")]) == "Bearer t"
    assert bearer_credential((("authorization", b"Bearer t"),)) == "Bearer t"  # bytes values too
    assert bearer_matches("Bearer t0ken", "t0ken") and not bearer_matches("Bearer t0kem", "t0ken")
    assert not bearer_matches("t0ken", "t0ken")  # the scheme is part of it
    require_bearer([("authorization", "Bearer t0ken")], "t0ken")
    with pytest.raises(RequestError, match="got none") as none:
        require_bearer([], "t0ken")
    assert none.value.code == SC.UNAUTHENTICATED
    with pytest.raises(RequestError, match="got a wrong token"):
        require_bearer([("authorization", "Bearer nope")], "t0ken")
    assert (
        unauthenticated("").message
        == "authorization: expected metadata 'authorization: Bearer <token>', got none"
    )


# ----------------------------------------------------------------------------------------------- together
SERVICE = "vla_rl.test.Shell"
TOKEN = "shell-token"


class _Shell:
    """A service built from the shell alone: GetInfo needs the token; Echo streams request ids back."""

    def __init__(self) -> None:
        self.ratelog = RateLimitedLog(LOG, interval_s=60.0)

    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        try:
            if isinstance(request, Undecodable):
                self.ratelog.warning(
                    context.peer() or "", "undecodable", "undecodable", error=request.message
                )
                raise RequestError(SC.INVALID_ARGUMENT, request.message)
            require_bearer(context.invocation_metadata(), TOKEN)
        except RequestError as e:
            await abort(context, e)
        return pb.GetInfoResponse(server_version=request.model_id)

    async def Echo(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for req in requests:
            if isinstance(req, Undecodable):
                yield pb.ActResponse(
                    error=pb.ActError(code=SC.INVALID_ARGUMENT.value[0], message=req.message)
                )
            else:
                yield pb.ActResponse(request_id=req.request_id)

    async def Raw(self, request: bytes, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(server_version=f"{type(request).__name__} {len(request)}")


async def _exercise_shell() -> dict[str, Any]:
    shell = _Shell()
    server = grpc.aio.server()
    handlers = {
        "GetInfo": unary_handler(shell.GetInfo, pb.GetInfoRequest, pb.GetInfoResponse),
        "Echo": stream_handler(shell.Echo, pb.ActRequest, pb.ActResponse),
        "Raw": unary_handler(shell.Raw, None, pb.GetInfoResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = ch.unary_unary(f"/{SERVICE}/GetInfo", request_serializer=None, response_deserializer=None)
            raw = ch.unary_unary(
                f"/{SERVICE}/Raw",
                request_serializer=None,
                response_deserializer=pb.GetInfoResponse.FromString,
            )
            echo = ch.stream_stream(f"/{SERVICE}/Echo", request_serializer=None, response_deserializer=None)
            ok = pb.GetInfoRequest(model_id="m").SerializeToString()
            reply = await info(ok, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
            out["ok"] = pb.GetInfoResponse.FromString(reply).server_version
            for name, payload, metadata in [
                ("garbage", b"\x0a\x05ab", ()),
                ("no_token", ok, ()),
                ("wrong_token", ok, (("authorization", "Bearer wrong"),)),
            ]:
                try:
                    await info(payload, metadata=metadata, timeout=10)
                except grpc.aio.AioRpcError as e:
                    out[name] = (e.code(), e.details())
            out["raw"] = (await raw(b"\xff\xfe\xfd", timeout=10)).server_version
            call = echo(iter([pb.ActRequest(request_id="a").SerializeToString(), BAD_UTF8]), timeout=10)
            out["echo"] = [pb.ActResponse.FromString(r) async for r in call]
    finally:
        await server.stop(0)
    return out


def test_a_service_built_from_the_shell(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        out = asyncio.run(_exercise_shell())
    assert out["ok"] == "m"
    assert out["garbage"][0] == SC.INVALID_ARGUMENT and out["garbage"][1].startswith("model_id: ")
    assert out["no_token"][0] == SC.UNAUTHENTICATED and "got none" in out["no_token"][1]
    assert out["wrong_token"][0] == SC.UNAUTHENTICATED and "wrong token" in out["wrong_token"][1]
    assert out["raw"] == "bytes 3"  # request None: the handler gets the bytes as they came
    first, second = out["echo"]
    assert first.request_id == "a" and not first.HasField("error")
    assert second.error.code == SC.INVALID_ARGUMENT.value[0] and second.error.message.startswith("request_id")
    assert len([r for r in caplog.records if r.name == LOG.name]) == 1  # logged once, no traceback


# ----------------------------------------------------------------------------------------------- stopping
def _sigterm_in(delay_s: float) -> threading.Timer:
    t = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
    t.start()
    return t


def test_sigterm_flag_counts_instead_of_killing_and_restores() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with SigtermFlag() as flag:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.count == 1
    assert signal.getsignal(signal.SIGTERM) is before
    off_main: list[Any] = []
    t = threading.Thread(target=lambda: off_main.append(SigtermFlag().__enter__()._installed))
    t.start()
    t.join()
    assert off_main == [False] and signal.getsignal(signal.SIGTERM) is before  # signals: main thread only


def test_wait_for_stop_drains_on_sigterm() -> None:
    drained: list[float] = []
    with SigtermFlag() as flag:
        _sigterm_in(0.1)
        t0 = time.monotonic()
        ok = wait_for_stop(lambda: True, flag, drain=lambda: drained.append(time.monotonic()), drain_s=0.5)
        took = time.monotonic() - t0
    assert ok and len(drained) == 1
    assert 0.5 <= took < 3.0 and drained[0] - t0 >= 0.05  # drained after the signal, then waited drain_s


def test_wait_for_stop_second_signal_ctrl_c_and_no_drain() -> None:
    with SigtermFlag() as flag:  # a second SIGTERM cuts the drain short
        _sigterm_in(0.05)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        t0 = time.monotonic()
        assert not wait_for_stop(lambda: True, flag, drain=lambda: None, drain_s=30.0)
        assert time.monotonic() - t0 < 5.0
        timer.join()
    with SigtermFlag() as flag:  # SIGTERM without a drain: stop now
        _sigterm_in(0.05)
        drains: list[int] = []
        assert not wait_for_stop(lambda: True, flag, drain=lambda: drains.append(1), drain_s=0.0)
        assert not drains

    def ctrl_c() -> bool:
        raise KeyboardInterrupt

    with SigtermFlag() as flag:
        assert not wait_for_stop(ctrl_c, flag, drain=lambda: None, drain_s=30.0)  # Ctrl-C: at once
        ends = iter([True, False])
        assert not wait_for_stop(lambda: next(ends), flag, poll_s=0.01)  # the service ended by itself

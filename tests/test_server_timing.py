"""Where a chunk's time goes: the per-stage timing every reply carries (server stages on the wire, the
client's own encode / network / decode / TTFA), checked on real loopback gRPC replies, and the in-place
encoding the clients use (byte-identical to the nested messages it replaced, exact round trips)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_server import SPEC, TOKEN, make_checkpoint, make_obs, start_server
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.codec import WIRE_DTYPES, encode_image, fill_image, fill_tensor, from_tensor, to_tensor
from vla_rl_client.policy_client import PolicyClient, Timing, build_request
from vla_rl_client.proto import policy_service_pb2 as pb

from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from server.policy_server import PolicyServer
from server.stage_timing import PrefixClock, flow_policy_of, timed_prefix

SERVER_STAGES = ("decode_us", "queue_us", "batch_us", "inference_us", "wake_us", "encode_us")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    srv = start_server({"arm": make_checkpoint(tmp_path_factory.mktemp("timing") / "a", 0)})
    yield srv
    srv.stop()


def check_timing(t: Timing) -> None:
    """Every stage present and non-negative, the server's stages within its total, the total within the
    round trip, prefix + denoise = the forward, the client's parts within its time to first action."""
    fields = {k: getattr(t, k) for k in Timing.__dataclass_fields__}
    assert all(v >= 0 for v in fields.values()), fields
    assert t.decode_us > 0 and t.inference_us > 0 and t.prefix_us > 0 and t.denoise_us > 0, fields
    assert sum(getattr(t, k) for k in SERVER_STAGES) <= t.total_us, fields
    assert t.prefix_us + t.denoise_us == t.inference_us, fields
    assert t.total_us <= t.round_trip_us + 1, fields  # whole microseconds on two clocks' readings
    assert t.network_us == t.round_trip_us - t.total_us or (
        t.network_us == 0 and t.round_trip_us <= t.total_us
    )
    assert t.client_encode_us + t.round_trip_us + t.client_decode_us <= t.ttfa_us, fields
    assert t.overhead_us == t.ttfa_us - t.inference_us, fields


def test_stage_timing_in_unary_and_stream_replies(server: PolicyServer) -> None:
    obs = make_obs(np.random.default_rng(0))
    with PolicyClient(server.address, token=TOKEN, timeout_s=10) as c:
        check_timing(c.act(obs, seed=1).timing)
        with c.stream() as s:
            for i in range(3):
                check_timing(s.act(obs, seed=i).timing)
        # a request sent prepared: its encoding is the caller's, not counted
        t = c.act_request(build_request(obs, seed=1)).timing
        assert t.client_encode_us == 0 and t.ttfa_us >= t.round_trip_us


def test_stage_timing_on_the_asyncio_client(server: PolicyServer) -> None:
    obs = make_obs(np.random.default_rng(1))

    async def main() -> list[Timing]:
        async with AsyncPolicyClient(server.address, timeout_s=10) as c:
            s = c.stream()
            got = [(await c.act(obs, seed=1)).timing, (await s.act(obs, seed=2)).timing]
            await s.close()
            return got

    for t in asyncio.run(main()):
        check_timing(t)


def test_timed_prefix_counts_encode_prefix_and_restores_it() -> None:
    cfg = FlowVLAConfig.from_robot_spec(
        SPEC, d_model=32, n_layers=1, expert_n_layers=1, n_heads=2, instruction_encoder="none", chunk_len=4,
        n_exec=2, num_inference_steps=2, image_encoder_width=8, image_encoder_stages=2,
    )  # fmt: skip
    policy = FlowVLAPolicy(cfg)

    class Model:  # a served model as the server sees one: the flow policy behind ``loaded``
        class loaded:
            pass

    Model.loaded.policy = policy  # type: ignore[attr-defined]
    assert flow_policy_of(Model()) is policy and flow_policy_of(object()) is None
    obs = {
        "state": torch.zeros(2, SPEC.state_dim),
        "cameras": {c.name: torch.zeros(2, *c.shape, dtype=torch.uint8) for c in SPEC.cameras},
        "instruction": ["push", "push"],
    }
    with timed_prefix(Model()) as clock:
        assert "encode_prefix" in vars(policy)  # shadowed while inside
        policy.sample(obs)
        policy.sample(obs)
    assert "encode_prefix" not in vars(policy)  # the class's method again
    assert clock.calls == 2 and clock.ns > 0
    assert clock.split_us(10**9) == (clock.ns // 1000, 10**9 - clock.ns // 1000)
    assert clock.split_us(0) == (0, 0)  # capped at the forward it is part of
    with timed_prefix(object()) as none:
        pass
    assert none.calls == 0 and PrefixClock().split_us(500) == (0, 0)  # nothing to split: all inference


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_fill_tensor_round_trips_exactly(dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 4, 2)) * 50).astype(dtype)
    msg = pb.Tensor()
    fill_tensor(msg, x[:, ::2])  # a non-contiguous view is written C-order
    got = from_tensor(msg, "x", dtype=dtype, shape=(3, 2, 2))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, x[:, ::2])
    assert msg.SerializeToString() == to_tensor(x[:, ::2]).SerializeToString()


def test_fill_tensor_refuses_what_cannot_travel() -> None:
    for bad in (np.array(["a"]), np.array([object()]), np.zeros(2, np.complex64)):
        with pytest.raises(TypeError, match="cannot travel on the wire; use one of"):
            fill_tensor(pb.Tensor(), bad)
    with pytest.raises(ValueError, match="image format must be one of"):
        fill_image(pb.Image(), np.zeros((2, 2, 3), np.uint8), "gif")


@pytest.mark.parametrize("fmt", ["raw", "png", "jpeg"])
def test_requests_built_in_place_equal_the_nested_messages(fmt: str) -> None:
    """build_request writes each array into its field; the bytes on the wire are those the nested
    construction (a Tensor / Image copied into its parent) gave."""
    rng = np.random.default_rng(2)
    obs = make_obs(rng) | {"instruction": "push it"}
    noise = rng.normal(size=(4, 3)).astype(np.float32)
    o = pb.Observation(instruction="push it", state=to_tensor(obs["state"]))
    for name, img in obs["cameras"].items():
        o.cameras[name].CopyFrom(encode_image(img, fmt))
    nested = pb.ActRequest(
        model_id="arm", request_id="r", observation=o, timeout_ms=5, noise=to_tensor(noise)
    )
    built = build_request(obs, model_id="arm", request_id="r", timeout_ms=5, noise=noise, image_format=fmt)
    assert built.SerializeToString() == nested.SerializeToString()
    if fmt == "raw":
        cam = built.observation.cameras["front"].raw
        np.testing.assert_array_equal(from_tensor(cam, "cam", dtype="uint8"), obs["cameras"]["front"])


def test_a_client_sends_serialised_bytes_as_they_are(server: PolicyServer, tmp_path: Path) -> None:
    """Act takes a request already serialised (what act() sends): the same chunk as the message."""
    obs = make_obs(np.random.default_rng(3))
    req = build_request(obs, seed=4)
    with PolicyClient(server.address, timeout_s=10) as c:
        a = c.act_request(req).actions
        b = c.act_request(req.SerializeToString()).actions
    np.testing.assert_array_equal(a, b)


def _forward_threads(srv: PolicyServer, model_id: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that run ``model_id``'s forward passes from now on (appended per batch)."""
    version, names = srv.slots[model_id].active, []
    infer = version.infer_scored

    def recorded(*args: object) -> object:
        names.append(threading.current_thread().name)
        return infer(*args)

    monkeypatch.setattr(version, "infer_scored", recorded)
    return names


def _wait_batcher_idle(slot: Any, timeout_s: float = 30.0) -> None:
    """Until the batcher thread has finished its batch (the reply goes out before it releases the forward
    lock; a request arriving in between is queued for it, which is right but not what a test expects)."""
    deadline = time.monotonic() + timeout_s
    while not slot._forward.acquire(blocking=False):
        assert time.monotonic() < deadline, "the batcher did not finish its batch"
        time.sleep(0.005)
    slot._forward.release()


def test_a_lone_robot_is_served_on_the_event_loop_and_a_crowd_by_the_batcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one robot (after one forward through the batcher has timed the model) the request runs on the
    event loop's thread; once a second robot is active, each request goes to the batcher thread again."""
    srv = start_server({"arm": make_checkpoint(tmp_path / "a", 0)}, lone_inline_ms=60_000)
    try:
        srv.slots["arm"].queue.activity_window_s = 60.0  # "active" cannot lapse on a slow machine
        ran = _forward_threads(srv, "arm", monkeypatch)
        obs = make_obs(np.random.default_rng(0))
        with PolicyClient(srv.address, timeout_s=30) as one, PolicyClient(srv.address, timeout_s=30) as two:
            first = one.act(obs, seed=1)  # untimed model: the batcher
            _wait_batcher_idle(srv.slots["arm"])  # it answers before it lets go of the forward
            lone = one.act(obs, seed=1)
            with one.stream() as s:
                check_timing(s.act(obs, seed=2).timing)
            crowd = [two.act(obs, seed=1), one.act(obs, seed=1)]
        loop, batcher = srv._thread.name, srv.slots["arm"]._thread.name  # type: ignore[union-attr]
        assert ran == [batcher, loop, loop, batcher, batcher]
        check_timing(lone.timing)
        for r in (lone, *crowd):  # the same chunk whichever thread ran it
            np.testing.assert_allclose(r.actions, first.actions, atol=1e-5)
        assert srv.slots["arm"].served == 5 and srv.slots["arm"].queue.active_clients() == 2
    finally:
        srv.stop()


def test_no_lone_requests_on_the_event_loop_when_switched_off_or_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lone_inline_ms`` 0, a forward slower than it, or adaptive wait off: every forward on the batcher."""
    obs = make_obs(np.random.default_rng(0))
    for config in ({"lone_inline_ms": 0}, {"lone_inline_ms": 1e-3}, {"adaptive_wait": False}):
        srv = start_server({"arm": make_checkpoint(tmp_path / "a", 0)}, max_wait_us=0, **config)
        try:
            ran = _forward_threads(srv, "arm", monkeypatch)
            with PolicyClient(srv.address, timeout_s=30) as c:
                for i in range(3):
                    c.act(obs, seed=i)
            assert ran == [srv.slots["arm"]._thread.name] * 3, config
        finally:
            srv.stop()

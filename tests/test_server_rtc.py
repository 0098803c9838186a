"""Real-time chunking through the policy server on loopback: a robot with RTC and one without share a batch,
the reply says how RTC shaped the chunk, and requests RTC cannot honour are refused naming the field."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_server import SPEC, H, expected, make_checkpoint, make_obs, start_server
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.action_queue import ActionQueue, AsyncQueuedPolicy, QueuedPolicy, RTCOptions
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import ActResult, PolicyClient, PolicyError, RTCInfo, RTCInput, Timing

from policies.loading import load_policy
from policies.rtc import DEFAULT_MAX_GUIDANCE_WEIGHT as RTC_DEFAULT
from server.batching import RTCRequest
from server.config import DEFAULT_MAX_GUIDANCE_WEIGHT, ServerConfig
from server.policy_server import PolicyServer
from server.slots import ServedVersion, initial_noise


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("rtc") / "a", 0)


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[PolicyServer]:
    srv = start_server({"arm": ckpt}, max_batch=2, max_wait_us=2_000_000, rtc_max_guidance_weight=5.0)
    yield srv
    srv.stop()


def queued_actions(rng: np.random.Generator, n: int = H) -> np.ndarray:
    return rng.uniform(-0.5, 0.5, (n, SPEC.action_dim)).astype(np.float32)


def test_robots_with_and_without_rtc_share_a_batch(ckpt: Path) -> None:
    rng = np.random.default_rng(0)
    obs = [make_obs(rng), make_obs(rng)]
    queued = queued_actions(rng)
    asks: list[dict[str, Any]] = [{"rtc": RTCInput(2, queued)}, {}]
    results: dict[int, Any] = {}
    barrier = threading.Barrier(2)
    # a batch waits for its second request (no adaptive early start), however loaded the machine
    srv = start_server(
        {"arm": ckpt}, max_batch=2, max_wait_us=5_000_000, adaptive_wait=False, rtc_max_guidance_weight=5.0
    )

    def robot(i: int) -> None:
        with PolicyClient(srv.address, timeout_s=30, model_id="arm") as c:
            barrier.wait()
            results[i] = c.act(obs[i], seed=10 + i, **asks[i])

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(robot, range(2)))
    finally:
        srv.stop()
    assert results[0].batch_size == results[1].batch_size == 2
    ref = ServedVersion(load_policy(ckpt, device="cpu"))
    plain_a = expected(ref, obs[0], 10)
    np.testing.assert_allclose(results[1].actions, expected(ref, obs[1], 11), atol=RECOMPUTED_ATOL)
    assert results[1].rtc is None

    info = results[0].rtc
    assert info is not None
    assert (info.mode, info.inference_delay, info.queued, info.execution_horizon) == ("guided", 2, H, H)
    assert info.max_guidance_weight == pytest.approx(3.0)  # 5, capped at the checkpoint's 3 denoising steps
    ref.model.rtc_settings = type(ref.model.rtc_settings)(max_guidance_weight=5.0)  # type: ignore[attr-defined]
    cams = {k: v[None] for k, v in obs[0]["cameras"].items()}
    local, _ = ref.infer_scored(
        obs[0]["state"][None],
        cams,
        [SPEC.instruction],
        initial_noise(10, H, 3)[None],
        [RTCRequest(2, queued)],
    )
    np.testing.assert_allclose(results[0].actions, local[0], atol=RECOMPUTED_ATOL)
    guided_err = np.abs(results[0].actions[:2] - queued[:2]).mean()
    assert guided_err < 0.5 * np.abs(plain_a[:2] - queued[:2]).mean()


def test_getinfo_says_the_model_runs_guided_rtc(server: PolicyServer) -> None:
    with PolicyClient(server.address, timeout_s=10) as c:
        info = c.info()["arm"]
    assert (info.rtc_mode, info.rtc_max_delay) == ("guided", 0)


def test_a_delay_without_queued_actions_is_a_plain_chunk(server: PolicyServer) -> None:
    rng = np.random.default_rng(1)
    obs = make_obs(rng)
    with PolicyClient(server.address, timeout_s=30, model_id="arm") as c:
        first = c.act(obs, seed=3, rtc=RTCInput(1))
        plain = c.act(obs, seed=3)
    assert first.rtc is None
    np.testing.assert_allclose(first.actions, plain.actions, atol=RECOMPUTED_ATOL)


@pytest.mark.parametrize(
    ("rtc", "field"),
    [
        (RTCInput(H, np.zeros((H, 3), np.float32)), "inference_delay"),  # delay >= chunk_len
        (RTCInput(1, np.zeros((H + 1, 3), np.float32)), "queued_actions"),  # longer than a chunk
        (RTCInput(1, np.zeros((2, 4), np.float32)), "queued_actions"),  # not the robot's action_dim
        (RTCInput(1, np.full((2, 3), np.nan, np.float32)), "queued_actions"),
    ],
)
def test_requests_rtc_cannot_honour_are_refused_naming_the_field(
    server: PolicyServer, rtc: RTCInput, field: str
) -> None:
    obs = make_obs(np.random.default_rng(2))
    with PolicyClient(server.address, timeout_s=10, model_id="arm", backoff=None) as c:
        with pytest.raises(PolicyError) as e:
            c.act(obs, seed=1, rtc=rtc)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in str(e.value)
        c.act(obs, seed=1)  # still serving


def test_queued_actions_without_a_delay_are_refused(server: PolicyServer) -> None:
    from vla_rl_client.codec import fill_tensor
    from vla_rl_client.policy_client import build_request

    req = build_request(make_obs(np.random.default_rng(3)), model_id="arm", seed=1)
    fill_tensor(req.queued_actions, np.zeros((2, 3), np.float32))
    with (
        PolicyClient(server.address, timeout_s=10, backoff=None) as c,
        pytest.raises(PolicyError, match="inference_delay"),
    ):
        c.act_request(req)


def test_rtc_settings_are_validated_and_defaults_agree() -> None:
    assert DEFAULT_MAX_GUIDANCE_WEIGHT == RTC_DEFAULT
    with pytest.raises(ValueError, match="rtc_execution_horizon"):
        ServerConfig(checkpoint="x", rtc_execution_horizon=0)
    with pytest.raises(ValueError, match="rtc_max_guidance_weight"):
        ServerConfig(checkpoint="x", rtc_max_guidance_weight=0.0)


# ---------------------------------------------------------------------------------------------- the robot side
def fake_reply(actions: np.ndarray, rtc: RTCInput | None) -> ActResult:
    info = None if rtc is None else RTCInfo("guided", rtc.delay, len(rtc.queued), len(rtc.queued), 10.0)
    return ActResult(actions, "c", Timing(0, 0, 0, 0, 0), 1, 0, 2, "arm", "r", rtc=info)


def test_queued_policy_sends_the_queue_and_delay_and_takes_rtc_chunks_whole() -> None:
    sent: list[RTCInput | None] = []

    def fetch(obs: dict[str, Any], rtc: RTCInput | None = None) -> ActResult:
        sent.append(rtc)
        return fake_reply(np.full((4, 1), 10.0 * len(sent), np.float32), rtc)

    qp = QueuedPolicy(fetch, ActionQueue("average", 0.5), rtc=RTCOptions(delay_steps=1))
    with qp:
        got = [float(qp.act({})[0]) for _ in range(3)]
        time.sleep(0.2)  # the second chunk (asked at step 2, 2 actions queued) has arrived
        got += [float(qp.act({})[0]) for _ in range(2)]
    assert sent[0] is None  # nothing queued yet: a plain request
    assert sent[1] is not None and sent[1].delay == 1
    np.testing.assert_array_equal(sent[1].queued, np.full((2, 1), 10.0, np.float32))  # steps 2 and 3
    # the RTC chunk for the observation of step 2 replaces the queue from step 3 on (no averaging)
    assert got == [10.0, 10.0, 10.0, 20.0, 20.0]


def test_rtc_options_auto_is_on_only_when_the_delay_is_known_and_the_server_can() -> None:
    assert not RTCOptions().enabled  # no delay, no control period
    assert RTCOptions(control_period_s=0.1).enabled
    assert not RTCOptions(control_period_s=0.1, server_rtc="").enabled
    assert not RTCOptions(mode="off", delay_steps=2).enabled
    with pytest.raises(ValueError, match="delay_steps or control_period_s"):
        RTCOptions(mode="on")
    with pytest.raises(ValueError, match="cannot run real-time chunking"):
        RTCOptions(mode="on", delay_steps=1, server_rtc="")
    with pytest.raises(ValueError, match="rtc: expected one of"):
        RTCOptions(mode="always")  # type: ignore[arg-type]


def test_the_delay_is_estimated_from_round_trips_and_the_control_period() -> None:
    def slow(obs: dict[str, Any], rtc: RTCInput | None = None) -> ActResult:
        time.sleep(0.12)
        return fake_reply(np.zeros((4, 1), np.float32), rtc)

    with QueuedPolicy(slow, ActionQueue("latest_only", 1.0), rtc=RTCOptions(control_period_s=0.05)) as qp:
        qp.act({})
        assert qp.rtc.delay(qp.queue) == 3  # ceil(0.12+ s / 0.05 s), below the chunk length 4


def test_a_queued_loop_runs_rtc_through_the_server(server: PolicyServer) -> None:
    rng = np.random.default_rng(4)
    with PolicyClient(server.address, timeout_s=30, model_id="arm") as c:
        mode = c.info()["arm"].rtc_mode
        options = RTCOptions(control_period_s=0.05, server_rtc=mode)
        with QueuedPolicy(c.act, ActionQueue("weighted_average", 0.5), rtc=options) as qp:
            for _ in range(10):
                assert np.isfinite(qp.act(make_obs(rng))).all()
                time.sleep(0.05)
        assert qp.last is not None and qp.last.rtc is not None and qp.last.rtc.mode == "guided"


def test_fleet_sim_and_up_take_the_rtc_knob() -> None:
    from sim.fleet_robot import fleet_rtc
    from sim.fleet_runner import FleetConfig
    from vla_rl.up.config import UpConfig

    assert FleetConfig().rtc == UpConfig().rtc == "auto"
    assert not fleet_rtc("auto", "guided")  # a simulated robot waits for its chunks: no delay to hide
    assert fleet_rtc("on", "guided") and not fleet_rtc("off", "guided")
    with pytest.raises(ValueError, match="cannot run real-time chunking"):
        fleet_rtc("on", "")
    for config in (FleetConfig, UpConfig):
        with pytest.raises(ValueError, match="rtc: expected one of"):
            config(rtc="sometimes")  # type: ignore[arg-type]


def test_streams_carry_rtc_both_ways(server: PolicyServer) -> None:
    rng = np.random.default_rng(5)
    queued = queued_actions(rng, 3)
    with PolicyClient(server.address, timeout_s=30, model_id="arm") as c, c.stream() as s:
        res = s.act(make_obs(rng), seed=2, rtc=RTCInput(1, queued))
    assert res.rtc is not None and (res.rtc.inference_delay, res.rtc.queued) == (1, 3)

    async def main() -> Any:
        async with AsyncPolicyClient(server.address, timeout_s=30, model_id="arm") as ac:
            s = ac.stream()
            try:
                return await s.act(make_obs(rng), seed=2, rtc=RTCInput(2, queued))
            finally:
                await s.close()

    res = asyncio.run(main())
    assert res.rtc is not None and res.rtc.inference_delay == 2


def test_the_async_queued_policy_sends_rtc_too() -> None:
    sent: list[RTCInput | None] = []

    async def fetch(obs: dict[str, Any], rtc: RTCInput | None = None) -> ActResult:
        sent.append(rtc)
        return fake_reply(np.full((4, 1), float(len(sent)), np.float32), rtc)

    async def main() -> list[float]:
        aq = AsyncQueuedPolicy(fetch, ActionQueue("average", 0.5), rtc=RTCOptions(delay_steps=2))
        got = []
        for _ in range(5):
            got.append(float((await aq.act({}))[0]))
            await asyncio.sleep(0.01)
        await aq.close()
        return got

    got = asyncio.run(main())
    assert sent[0] is None and sent[1] is not None and sent[1].delay == 2 and len(sent[1].queued) == 2
    assert got[:3] == [1.0, 1.0, 1.0] and got[3] == 2.0  # the RTC chunk replaced the queue


def test_fleet_sim_robots_ask_for_rtc_when_it_is_on(tmp_path: Path) -> None:
    from test_sim_fleet import TOKEN, task_spec, tiny_checkpoint

    from fleet.collector import Collector, CollectorConfig
    from sim.fleet_runner import FleetConfig, run_sim_fleet
    from sim.operator import OperatorRules

    ckpt = tiny_checkpoint(tmp_path / "ckpt", task_spec())
    srv = start_server({"push": ckpt}, token=None)
    collector = Collector(
        CollectorConfig(store=tmp_path / "store", port=0, chunk_len=16), token=TOKEN
    ).start()
    try:
        cfg = FleetConfig(
            progress=False,
            robots=1,
            server=srv.address,
            collector=collector.address,
            episodes=1,
            max_episode_steps=12,
            rules=OperatorRules(max_takeovers=0),  # the policy drives every step
            collector_token=TOKEN,
            rtc="on",
        )
        result = run_sim_fleet(cfg)
        assert result.errors == [] and collector.drain(60)
    finally:
        collector.stop()
        srv.stop()
    slot = srv.slots["push"]
    assert slot.rtc_served >= 1 and slot.rtc_served < slot.served  # every chunk but each episode's first

"""Client library against real servers on loopback: asyncio client, action queue, reconnects, TLS, adaptive
batching, and a server following a ref on the real Hub-compatible registry.

Tiny flow-VLA checkpoints (the helpers of test_server.py); torch single-threaded. The action-queue merge
rules are checked against LeRobot's own code (AGGREGATE_FUNCTIONS, ACTTemporalEnsembler).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from test_server import SPEC, TOKEN, H, expected, local_accel, make_checkpoint, make_obs, start_server
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.action_queue import AGGREGATES, ActionQueue, AsyncQueuedPolicy, QueuedPolicy
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import Backoff, PolicyClient, PolicyError

from policies.loading import load_policy
from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.slots import ServedVersion
from vla_rl.core.version import __version__

torch.set_num_threads(1)
SC = grpc.StatusCode
FAST = Backoff(initial_s=0.02, max_s=0.3)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {"a": make_checkpoint(root / "a", 0), "b": make_checkpoint(root / "b", 1)}


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> dict[str, ServedVersion]:
    return {k: ServedVersion(load_policy(v, device="cpu")) for k, v in ckpts.items()}


def start(models: dict[str, Path], **kw: Any) -> PolicyServer:
    return start_server(models, **kw)


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]) -> Iterator[PolicyServer]:
    srv = start({"arm": ckpts["a"]}, max_batch=8, max_wait_us=5000)
    yield srv
    srv.stop()


# ---------------------------------------------------------------------------------------------- asyncio
def test_async_client_act_stream_info_and_errors(
    server: PolicyServer, reference: dict[str, ServedVersion]
) -> None:
    async def main() -> None:
        async with AsyncPolicyClient(server.address, token=TOKEN, timeout_s=10) as c:
            obs = make_obs(np.random.default_rng(0))
            info = await c.info()
            assert info["arm"].commit == reference["a"].commit and info["arm"].adaptive_wait
            whole = await c.get_info()  # the whole reply: the models and the server's version
            assert whole.server_version == __version__ and [m.model_id for m in whole.models] == ["arm"]
            # many concurrent robots from one event loop: each gets the chunk for its own observation
            rngs = [np.random.default_rng(10 + k) for k in range(6)]
            obss = [make_obs(r) for r in rngs]
            results = await asyncio.gather(*(c.act(o, seed=k) for k, o in enumerate(obss)))
            for k, (o, r) in enumerate(zip(obss, results, strict=True)):
                np.testing.assert_allclose(r.actions, expected(reference["a"], o, k), atol=RECOMPUTED_ATOL)
            async with c.stream() as s:
                first = await s.act(obs, seed=5)
                with pytest.raises(PolicyError) as err:
                    await s.act({**obs, "state": np.zeros(3, np.float32)})
                assert err.value.code == SC.INVALID_ARGUMENT and "observation.state" in err.value.message
                again = await s.act(obs, seed=5)
            np.testing.assert_allclose(first.actions, expected(reference["a"], obs, 5), atol=RECOMPUTED_ATOL)
            np.testing.assert_allclose(again.actions, first.actions, atol=RECOMPUTED_ATOL)
            # every chunk carries its uncertainty, unary and streamed, batched or not
            assert first.uncertainty_kind == results[0].uncertainty_kind == "accel"
            want = local_accel(reference["a"], obs, 5)
            np.testing.assert_allclose([first.uncertainty, again.uncertainty], want, atol=RECOMPUTED_ATOL)
            for k, (o, r) in enumerate(zip(obss, results, strict=True)):
                np.testing.assert_allclose(
                    r.uncertainty, local_accel(reference["a"], o, k), atol=RECOMPUTED_ATOL
                )
            with pytest.raises(PolicyError) as err:
                await c.act(obs, model_id="nope")
            assert err.value.code == SC.NOT_FOUND
            assert await c.health() == "SERVING"
        with PolicyClient(server.address, timeout_s=10) as sync:
            whole = sync.get_info()
            assert whole.server_version == __version__ and whole.models[0].commit == reference["a"].commit
            assert list(sync.info()) == ["arm"] and sync.info()["arm"].commit == whole.models[0].commit
        async with AsyncPolicyClient(server.address, timeout_s=10) as anon:  # control needs the token
            with pytest.raises(PolicyError) as err:
                await anon.rollback()
            assert err.value.code == SC.UNAUTHENTICATED

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- adaptive wait
def test_lone_client_does_not_pay_max_wait(ckpts: dict[str, Path]) -> None:
    """max_wait_us = 300 ms: with adaptive wait a lone robot's request goes at once; without, it waits."""
    obs = make_obs(np.random.default_rng(1))
    for adaptive in (True, False):
        srv = start({"arm": ckpts["a"]}, max_batch=8, max_wait_us=300_000, adaptive_wait=adaptive)
        try:
            with PolicyClient(srv.address, timeout_s=10) as c:
                c.act(obs, seed=1)  # registers this connection as the one active client
                queue_us = [c.act(obs, seed=1).timing.queue_us for _ in range(3)]
                assert c.info()["arm"].active_clients == 1
        finally:
            srv.stop()
        if adaptive:
            assert max(queue_us) < 100_000, queue_us
        else:
            assert min(queue_us) >= 290_000, queue_us


def test_adaptive_wait_still_batches_a_crowd(ckpts: dict[str, Path]) -> None:
    """Four robots in one process: each client is its own connection, so the server sees four robots and
    waits for them (with a shared gRPC connection it saw one and dispatched batches of 1-2)."""
    srv = start({"arm": ckpts["a"]}, max_batch=8, max_wait_us=100_000)
    sizes: list[int] = []
    seen: list[int] = []
    barrier = threading.Barrier(4)

    def robot(k: int) -> None:
        rng = np.random.default_rng(k)
        with PolicyClient(srv.address, timeout_s=30) as c:
            c.act(make_obs(rng))  # be seen once
            barrier.wait()
            seen.append(c.info()["arm"].active_clients)
            barrier.wait()
            for _ in range(4):
                sizes.append(c.act(make_obs(rng)).batch_size)

    try:
        threads = [threading.Thread(target=robot, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    assert seen == [4, 4, 4, 4], seen
    assert len(sizes) == 16 and np.mean(sizes) > 2, sizes


# ---------------------------------------------------------------------------------------------- reconnect
def test_reconnect_with_backoff_when_the_server_restarts(ckpts: dict[str, Path], free_port: int) -> None:
    port = free_port
    obs = make_obs(np.random.default_rng(2))
    srv = start({"arm": ckpts["a"]}, port=port)
    box: dict[str, PolicyServer] = {}

    def restart_later() -> None:
        time.sleep(1.0)
        box["srv"] = start({"arm": ckpts["a"]}, port=port)

    c = PolicyClient(f"127.0.0.1:{port}", timeout_s=10, backoff=FAST)
    s = c.stream()
    try:
        want = c.act(obs, seed=3).actions
        np.testing.assert_allclose(s.act(obs, seed=3).actions, want, atol=RECOMPUTED_ATOL)
        srv.stop()
        # server gone and not coming back within the budget: an error at the deadline, not a hang
        t0 = time.monotonic()
        with pytest.raises(PolicyError) as err:
            c.act(obs, seed=3, timeout_s=0.5)
        assert err.value.code == SC.UNAVAILABLE and time.monotonic() - t0 < 3
        t = threading.Thread(target=restart_later)
        t.start()
        retries = c.retries
        np.testing.assert_allclose(c.act(obs, seed=3, timeout_s=60).actions, want, atol=RECOMPUTED_ATOL)
        assert c.retries > retries
        t.join()
        np.testing.assert_allclose(s.act(obs, seed=3, timeout_s=30).actions, want, atol=RECOMPUTED_ATOL)
        assert s.reopened >= 1
    finally:
        s.close()
        c.close()
        if "srv" in box:
            box["srv"].stop()


def test_async_reconnect(ckpts: dict[str, Path], free_port: int) -> None:
    port = free_port
    obs = make_obs(np.random.default_rng(3))

    async def main() -> None:
        srv = start({"arm": ckpts["a"]}, port=port)
        loop = asyncio.get_running_loop()
        async with AsyncPolicyClient(f"127.0.0.1:{port}", timeout_s=10, backoff=FAST) as c:
            s = c.stream()
            want = (await c.act(obs, seed=4)).actions
            await s.act(obs, seed=4)
            await loop.run_in_executor(None, srv.stop)
            with pytest.raises(PolicyError) as err:
                await c.act(obs, seed=4, timeout_s=0.5)
            assert err.value.code == SC.UNAVAILABLE
            later = loop.run_in_executor(
                None, lambda: (time.sleep(1.0), start({"arm": ckpts["a"]}, port=port))[1]
            )
            got = await c.act(obs, seed=4, timeout_s=60)
            np.testing.assert_allclose(got.actions, want, atol=RECOMPUTED_ATOL)
            new = await later
            try:
                np.testing.assert_allclose(
                    (await s.act(obs, seed=4, timeout_s=30)).actions, want, atol=RECOMPUTED_ATOL
                )
                assert s.reopened >= 1 and c.retries >= 1
            finally:
                await s.close()
                await loop.run_in_executor(None, new.stop)

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- TLS
OPENSSL = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        [*OPENSSL, "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost", "-addext", SAN],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls(ckpts: dict[str, Path], tmp_path: Path, reference: dict[str, ServedVersion]) -> None:
    cert, key = _self_signed(tmp_path, "server")
    other, _ = _self_signed(tmp_path, "other")
    srv = start({"arm": ckpts["a"]}, tls_cert=cert, tls_key=key)
    obs = make_obs(np.random.default_rng(4))
    try:
        with PolicyClient(srv.address, token=TOKEN, timeout_s=10, tls_ca=cert) as c:
            r = c.act(obs, seed=2)
            np.testing.assert_allclose(r.actions, expected(reference["a"], obs, 2), atol=RECOMPUTED_ATOL)
            with pytest.raises(PolicyError) as err:
                c.rollback()  # the token travels (encrypted); nothing to roll back to
            assert err.value.code == SC.FAILED_PRECONDITION
        for kw in ({}, {"tls_ca": other}):  # plaintext, or a CA that did not sign the server's cert
            with PolicyClient(srv.address, timeout_s=1, backoff=None, **kw) as bad:
                with pytest.raises(PolicyError) as err:
                    bad.act(obs, seed=2)
                assert err.value.code == SC.UNAVAILABLE

        async def over_tls() -> np.ndarray:
            async with AsyncPolicyClient(srv.address, timeout_s=10, tls_ca=cert.read_bytes()) as ac:
                return (await ac.act(obs, seed=2)).actions

        np.testing.assert_allclose(asyncio.run(over_tls()), r.actions, atol=RECOMPUTED_ATOL)
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="both"):
        ServerConfig(checkpoint=str(ckpts["a"]), tls_cert=cert)


# ---------------------------------------------------------------------------------------------- action queue
def test_aggregates_match_lerobot() -> None:
    from lerobot.async_inference.configs import AGGREGATE_FUNCTIONS

    old, new = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 5.0])
    assert set(AGGREGATES) == set(AGGREGATE_FUNCTIONS)
    for name, fn in AGGREGATE_FUNCTIONS.items():
        np.testing.assert_allclose(
            AGGREGATES[name](old.numpy(), new.numpy()), fn(old, new).numpy(), rtol=1e-6
        )


def test_action_queue_merges_by_step_and_drops_stale() -> None:
    q = ActionQueue("average", chunk_size_threshold=0.5)
    assert q.needs_chunk()
    q.add_chunk(np.arange(4, dtype=np.float32)[:, None], start_step=0)  # steps 0..3 = 0, 1, 2, 3
    assert not q.needs_chunk() and len(q) == 4
    assert q.pop()[0] == 0 and q.pop()[0] == 1
    assert q.needs_chunk()  # 2 of a 4-chunk left: at the threshold, ask now
    # the chunk answering the observation of step 1 arrives at step 2: its step-1 action is stale
    q.add_chunk(np.full((4, 1), 10, np.float32), start_step=1)
    assert q.stats.stale_dropped == 1 and q.stats.merged == 2
    assert [q.pop()[0] for _ in range(3)] == [6.0, 6.5, 10.0]  # avg(2, 10), avg(3, 10), new only
    assert q.pop() is None and q.step == 5
    with pytest.raises(ValueError, match="aggregate"):
        ActionQueue("median")
    assert ActionQueue("latest").aggregate == "latest_only"


def test_temporal_ensemble_matches_act() -> None:
    from lerobot.policies.act.modeling_act import ACTTemporalEnsembler

    rng = np.random.default_rng(5)
    h, coeff = 5, 0.1
    ens = ACTTemporalEnsembler(coeff, h)
    q = ActionQueue("temporal_ensemble", chunk_size_threshold=1.0, ensemble_coeff=coeff)
    for step in range(12):  # a new chunk every step, as ACT with temporal ensembling runs
        chunk = rng.normal(size=(h, 2)).astype(np.float32)
        assert q.needs_chunk()
        q.add_chunk(chunk, start_step=step)
        want = ens.update(torch.from_numpy(chunk)[None])[0].numpy()
        np.testing.assert_allclose(q.pop(), want, atol=RECOMPUTED_ATOL)


def test_queued_policy_sync_and_async(server: PolicyServer, reference: dict[str, ServedVersion]) -> None:
    """A control loop stepping through a real server: asks early, never waits once primed (slow control)."""
    rng = np.random.default_rng(6)
    observations = [make_obs(rng) for _ in range(12)]
    with PolicyClient(server.address, timeout_s=10, model_id="arm") as c:
        seeds = iter(range(1000))
        qp = QueuedPolicy(lambda o: c.act(o, seed=next(seeds)), ActionQueue("latest_only", 0.5))
        with qp:
            actions = []
            for obs in observations:
                actions.append(qp.act(obs))
                time.sleep(0.15)  # a slow control loop: each chunk arrives before the queue runs dry
        assert qp.queue.step == 12 and qp.requests >= 12 // H
        assert qp.queue.stats.starved == 1  # only the very first step waited
        # latest_only: step 0 is the first chunk's first action for the first observation (seed 0)
        np.testing.assert_allclose(
            actions[0], expected(reference["a"], observations[0], 0)[0], atol=RECOMPUTED_ATOL
        )

    async def main() -> int:
        async with AsyncPolicyClient(server.address, timeout_s=10, model_id="arm") as ac:
            s = ac.stream()
            aq = AsyncQueuedPolicy(lambda o: s.act(o), ActionQueue("weighted_average", 0.5))
            for obs in observations:
                a = await aq.act(obs)
                assert a.shape == (SPEC.action_dim,) and np.isfinite(a).all()
                await asyncio.sleep(0.05)
            await aq.close()
            await s.close()
            return aq.requests

    assert asyncio.run(main()) >= 12 // H


# ---------------------------------------------------------------------------------------------- hub follower
@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Any]:
    """The embedded Hub-compatible registry, with the client's global settings restored afterwards."""
    from vla_rl.hub.registry import configure_hub
    from vla_rl.hub.server import HubServer

    keys = ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_TOKEN", "HF_HOME", "HF_HUB_DISABLE_TELEMETRY")
    saved_env = {k: os.environ.get(k) for k in keys}
    os.environ["HF_HOME"] = str(tmp_path / "hf_home")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ.pop("HF_TOKEN", None)
    from huggingface_hub import constants

    saved = {
        k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_DISABLE_XET")
    }
    try:
        with HubServer(tmp_path / "hub", token=TOKEN) as h:
            configure_hub(h.url)
            yield h
    finally:
        for k, v in saved.items():
            setattr(constants, k, v)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_follows_prod_on_the_hub_without_failed_requests(
    hub: Any, ckpts: dict[str, Path], reference: dict[str, ServedVersion], tmp_path: Path
) -> None:
    from vla_rl.hub.registry import move_ref, push_folder

    kw = {"endpoint": hub.url, "token": TOKEN}
    v1 = push_folder(ckpts["a"], "fleet/arm", message="round 1", tag="prod", **kw)
    srv = start(
        {"arm": "hub://fleet/arm@prod"},
        follow={"arm": "hub://fleet/arm@prod"},
        follow_interval=0.2,
        cache_dir=tmp_path / "cache",
    )
    log: list[tuple[dict[str, Any], int, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def robot(k: int) -> None:
        rng = np.random.default_rng(20 + k)
        with PolicyClient(srv.address, timeout_s=30) as c:
            while not stop.is_set():
                obs, seed = make_obs(rng), int(rng.integers(1 << 31))
                try:
                    log.append((obs, seed, c.act(obs, seed=seed)))
                except BaseException as e:
                    errors.append(e)

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(3)]
    try:
        with PolicyClient(srv.address, timeout_s=10) as c:
            first = c.info()["arm"]
            assert first.commit == v1 and first.followed_ref == "hub://fleet/arm@prod"
            for t in threads:
                t.start()
            time.sleep(0.5)
            v2 = push_folder(ckpts["b"], "fleet/arm", message="round 2", tag="round-2", **kw)
            time.sleep(0.5)
            assert c.info()["arm"].commit == v1, "pushing v2 alone must not change what prod serves"
            move_ref("fleet/arm", "prod", "round-2", **kw)
            deadline = time.monotonic() + 60
            while c.info()["arm"].commit != v2 and time.monotonic() < deadline:
                time.sleep(0.1)
            info = c.info()["arm"]
            assert info.commit == v2 and info.previous_commit == v1 and info.last_load_error == ""
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        srv.stop()
    assert not errors, errors[:3]
    commits = [r.commit for _, _, r in log]
    assert commits[0] == v1 and commits[-1] == v2 and set(commits) == {v1, v2}
    for obs, seed, r in log:  # every chunk came from the commit it names
        np.testing.assert_allclose(
            r.actions, expected(reference["a" if r.commit == v1 else "b"], obs, seed), atol=RECOMPUTED_ATOL
        )


def test_robot_side_modules_do_not_import_torch() -> None:
    """Robots install numpy, grpcio and Pillow only: the clients and the action queue must not pull in torch."""
    import sys

    code = "import sys, vla_rl_client.policy_client, vla_rl_client.aio_policy_client, vla_rl_client.action_queue; assert 'torch' not in sys.modules"
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )

"""Policy server replicas behind gRPC's own client-side load balancing (issue 22, item 3).

Clients given several addresses (``a:1,b:2`` or ``dns:///name:port``) use ``round_robin`` with health
checking on ``grpc.health.v1``: a replica that dies, or drains (NOT_SERVING from SIGTERM until it stops), gets
no new calls, and a call that fails UNAVAILABLE is retried on another replica within the client's budget.

The fast tests use in-process servers (threads of this process); the fleet test runs two real ``vla-rl
serve`` processes following ``prod`` on the embedded Hub-compatible registry, with 8 robots streaming
(6 blocking clients, 2 asyncio clients), and kills, restarts, moves ``prod`` and drains under them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import _free_port
from test_server import make_checkpoint, make_obs
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import Backoff, PolicyClient, PolicyError
from vla_rl_client.policy_common import HEALTH_SERVICE, channel_target

from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.service import SERVICE_NAME
from vla_rl.cli import main

torch.set_num_threads(1)
CLI = [sys.executable, "-m", "vla_rl.cli"]
FAST = Backoff(initial_s=0.02, max_s=0.3)
BUDGET_S = 10.0  # each robot request's retry budget (the client's timeout_s)
FOLLOW_S = 1.0  # the replicas' --follow-interval
DRAIN_S = 5.0  # the replicas' --drain
HUB_TOKEN = "replicas-hub-token"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {"a": make_checkpoint(root / "a", 0), "b": make_checkpoint(root / "b", 1)}


def _start(ckpt: Path) -> PolicyServer:
    return PolicyServer(_config(ckpt)).start()


def _config(ckpt: Path, **kw: Any) -> ServerConfig:
    """Model ``arm`` on a free loopback port, CPU, one torch thread; ``kw``: more fields."""
    return ServerConfig(checkpoint=str(ckpt), model_id="arm", port=0, torch_threads=1, device="cpu", **kw)


def _served(*servers: PolicyServer) -> list[int]:
    return [s.slots["arm"].served for s in servers]


def _delta(before: list[int], *servers: PolicyServer) -> list[int]:
    return [n - b for n, b in zip(_served(*servers), before, strict=True)]


# --------------------------------------------------------------------------------------------- addresses
def test_address_lists_become_balanced_static_targets() -> None:
    assert HEALTH_SERVICE == SERVICE_NAME  # the client watches the service the server reports on
    one = channel_target("127.0.0.1:50061")
    assert one.target == "127.0.0.1:50061" and not one.balanced  # one server: as before (pick_first)
    two = channel_target(" localhost:1, 127.0.0.1:2 ")
    assert two.target == "ipv4:127.0.0.1:1,127.0.0.1:2" and two.balanced and two.authority == "localhost:1"
    assert channel_target("[::1]:5,[::1]:6").target == "ipv6:[::1]:5,[::1]:6"
    assert channel_target("dns:///policy.internal:50061").balanced
    assert not channel_target("unix:/run/vla.sock").balanced
    for bad, why in [
        ("", "expected host:port"),
        ("127.0.0.1:1,", "empty entry"),
        ("127.0.0.1:x,127.0.0.1:2", "port 1-65535"),
        ("127.0.0.1:1,127.0.0.1:1", "more than once"),
        ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
        ("no-such-host.invalid:1,127.0.0.1:2", "dns:///no-such-host.invalid:1"),
    ]:
        with pytest.raises(ValueError, match=why) as err:
            channel_target(bad)
        assert str(err.value).startswith("address: ")
    with pytest.raises(ValueError, match=r"^address: "):
        PolicyClient("127.0.0.1:1,")


def test_cli_refuses_a_bad_server_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["client", "act", "--server", "127.0.0.1:1,,127.0.0.1:2"]) == 2
    assert "--server: address: an empty entry" in capsys.readouterr().err
    assert main(["fleet", "sim", "--server", "127.0.0.1:0,127.0.0.1:2", "--no-progress"]) == 2
    assert "--server: address: each server in a list is host:port" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", "x", "--drain", "-1"]) == 2
    assert "--drain: expected seconds >= 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- in-process replicas
def test_round_robin_skips_a_draining_and_a_stopped_replica(ckpts: dict[str, Path]) -> None:
    servers = [_start(ckpts["a"]), _start(ckpts["a"])]
    rng = np.random.default_rng(0)
    try:
        addresses = ",".join(s.address for s in servers)
        with PolicyClient(addresses, timeout_s=BUDGET_S, backoff=FAST) as c:
            assert c.balanced and c.target.startswith("ipv4:")
            _wait(lambda: c.act(make_obs(rng)) and min(_served(*servers)) > 0, 10, "both replicas ready", 0)
            before = _served(*servers)
            for _ in range(10):
                c.act(make_obs(rng))
            assert _delta(before, *servers) == [5, 5]  # round_robin: every other call to each replica
            before = _served(*servers)
            for _ in range(4):  # new streams alternate too
                with c.stream() as s:
                    s.act(make_obs(rng))
            assert _delta(before, *servers) == [2, 2]

            before = _served(*servers)
            with c.stream() as s:  # a stream open on the replica that drains
                s.act(make_obs(rng))
                on = _delta(before, *servers).index(1)
                draining, other = servers[on], servers[1 - on]
                draining.drain()
                time.sleep(0.2)  # the health watch reports NOT_SERVING to the channel
                before = _served(draining, other)
                for _ in range(6):  # the stream's next request is answered, then it ends and is reopened
                    s.act(make_obs(rng))
                    c.act(make_obs(rng))
                # (0 when the stream ended between its last reply and drain(): that reply was already out)
                on_draining, on_other = _delta(before, draining, other)
                assert on_draining <= 1 and on_draining + on_other == 12 and s.reopened == 1
            # a dns:/// target is health-checked too: its only replica drains, so nothing takes the call;
            # one plain host:port (pick_first, no health checking) is still answered until the stop
            with PolicyClient(f"dns:///127.0.0.1:{draining.port}", timeout_s=1.0, backoff=FAST) as d:
                assert d.balanced
                with pytest.raises(PolicyError) as err:
                    d.act(make_obs(rng))
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
            with PolicyClient(draining.address, timeout_s=BUDGET_S) as plain:
                assert not plain.balanced and plain.act(make_obs(rng)).actions.shape == (4, 3)
            with PolicyClient(f"dns:///127.0.0.1:{other.port}", timeout_s=BUDGET_S) as d:
                assert d.act(make_obs(rng)).actions.shape == (4, 3)
            before = _served(other)
            draining.stop(0)
            servers.remove(draining)
            for _ in range(6):  # stopped: still only the other one, and nothing failed on the way
                c.act(make_obs(rng))
            assert _delta(before, other) == [6] and c.retries == 1
    finally:
        for s in servers:
            s.stop(0)


def test_async_client_balances_and_survives_a_stopped_replica(ckpts: dict[str, Path]) -> None:
    servers = [_start(ckpts["a"]), _start(ckpts["a"])]
    rng = np.random.default_rng(1)

    async def run() -> None:
        async with AsyncPolicyClient(
            ",".join(s.address for s in servers), timeout_s=BUDGET_S, backoff=FAST
        ) as c:
            assert c.balanced
            while min(_served(*servers)) == 0:
                await c.act(make_obs(rng))
            before = _served(*servers)
            for _ in range(6):
                await c.act(make_obs(rng))
            assert _delta(before, *servers) == [3, 3]
            before = _served(*servers)
            s = c.stream()
            await s.act(make_obs(rng))
            on = _delta(before, *servers).index(1)
            before = _served(servers[1 - on])
            gone = servers.pop(on)
            await asyncio.get_running_loop().run_in_executor(None, gone.stop, 0)
            for _ in range(5):  # the stream's replica is gone: reopened on the other, within the budget
                await s.act(make_obs(rng))
            await s.close()
            assert _delta(before, *servers) == [5] and s.reopened == 1

    try:
        asyncio.run(run())
    finally:
        for s in servers:
            s.stop(0)


def test_async_stream_reads_aios_ended_stream_write_as_closed() -> None:
    """grpc.aio turns a write to a stream a stopped replica ended into INTERNAL "Internal error from Core"
    (grpc/grpc#36066); the stream reopens on that (UNAVAILABLE) but keeps every real server error."""
    from vla_rl_client.aio_policy_client import _stream_error

    def aio(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    ended = _stream_error(aio(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert ended.code == grpc.StatusCode.UNAVAILABLE and "stream closed" in ended.message
    real = _stream_error(aio(grpc.StatusCode.INTERNAL, "inference failed: RuntimeError: x"))
    assert real.code == grpc.StatusCode.INTERNAL and real.message == "inference failed: RuntimeError: x"
    assert _stream_error(asyncio.InvalidStateError()).code == grpc.StatusCode.UNAVAILABLE


def test_replicas_over_tls(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A list over TLS: the certificate is checked against the first entry's name (here one certificate
    for localhost and 127.0.0.1 on both replicas); a client that trusts another CA is refused."""
    from test_serving_client import _self_signed

    cert, key = _self_signed(tmp_path, "replicas")
    other, _ = _self_signed(tmp_path, "other")
    servers = [PolicyServer(_config(ckpts["a"], tls_cert=cert, tls_key=key)).start() for _ in range(2)]
    rng = np.random.default_rng(2)
    try:
        target = ",".join(f"localhost:{s.port}" for s in servers)
        with PolicyClient(target, timeout_s=BUDGET_S, backoff=FAST, tls_ca=cert) as c:
            for _ in range(20):
                c.act(make_obs(rng))
                if min(_served(*servers)) > 0:
                    break
            assert min(_served(*servers)) > 0  # both replicas, over TLS
        with PolicyClient(target, timeout_s=2, backoff=None, tls_ca=other) as c, pytest.raises(PolicyError):
            c.act(make_obs(rng))
    finally:
        for s in servers:
            s.stop(0)


# ------------------------------------------------------------------------------------ the replica fleet
@dataclass
class Replica:
    """One `vla-rl serve` process following ``prod``; ``probe`` talks to it alone (no balancing)."""

    name: str
    port: int
    home: Path
    hub_url: str | None = None  # None: serve the local checkpoint folder ``checkpoint``, no follow
    checkpoint: str = "hub://fleet/arm@prod"
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Replica:
        self.starts += 1
        args = ["serve", "--checkpoint", self.checkpoint, "--drain", str(DRAIN_S), "--device", "cpu"]
        args += ["--max-wait-us", "500", "--port", str(self.port)]
        env = os.environ | {"HF_HOME": str(self.home), "OMP_NUM_THREADS": "1"}
        env.pop("HF_ENDPOINT", None)
        if self.hub_url is not None:
            args += ["--follow", "self", "--follow-interval", str(FOLLOW_S)]
            env["VLA_RL_HUB"] = self.hub_url
        log = open(self.home / f"serve-{self.starts}.log", "wb")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen([*CLI, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def log(self) -> str:
        return (self.home / f"serve-{self.starts}.log").read_text(errors="replace")[-3000:]

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        with PolicyClient(self.address, timeout_s=2.0) as probe:
            while True:
                try:
                    if probe.health(SERVICE_NAME) == "SERVING":
                        return
                except PolicyError:
                    pass
                assert self.proc is not None and self.proc.poll() is None, self.log()
                assert time.monotonic() < deadline, f"{self.name} did not come up:\n{self.log()}"
                time.sleep(0.2)

    def info(self) -> Any:
        with PolicyClient(self.address, timeout_s=5.0) as probe:
            return probe.info()["default"]

    def health(self) -> str:
        with PolicyClient(self.address, timeout_s=2.0) as probe:
            return probe.health(SERVICE_NAME)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Robot:
    """A robot streaming chunks: one stream per episode of ``steps`` requests, each with its budget."""

    index: int
    steps: int = 5
    replies: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, commit)
    errors: list[BaseException] = field(default_factory=list)
    max_latency_s: float = 0.0
    retries: int = 0

    def record(self, t0: float, commit: str) -> None:
        now = time.monotonic()
        self.max_latency_s = max(self.max_latency_s, now - t0)
        self.replies.append((now, commit))

    def run_sync(self, target: str, stop: threading.Event) -> None:
        rng = np.random.default_rng(100 + self.index)
        with PolicyClient(target, timeout_s=BUDGET_S, backoff=FAST) as c:
            while not stop.is_set():
                with c.stream() as s:
                    for _ in range(self.steps):
                        t0 = time.monotonic()
                        try:
                            self.record(t0, s.act(make_obs(rng), seed=int(rng.integers(1 << 31))).commit)
                        except BaseException as e:
                            self.errors.append(e)
                        time.sleep(0.02)
            self.retries = c.retries

    def run_async(self, target: str, stop: threading.Event) -> None:
        rng = np.random.default_rng(100 + self.index)

        async def go() -> None:
            async with AsyncPolicyClient(target, timeout_s=BUDGET_S, backoff=FAST) as c:
                while not stop.is_set():
                    async with c.stream() as s:
                        for _ in range(self.steps):
                            t0 = time.monotonic()
                            try:
                                self.record(
                                    t0, (await s.act(make_obs(rng), seed=int(rng.integers(1 << 31)))).commit
                                )
                            except BaseException as e:
                                self.errors.append(e)
                            await asyncio.sleep(0.02)
                self.retries = c.retries

        asyncio.run(go())


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Any]:
    """The embedded registry (in this process), the Hub client's global settings restored afterwards."""
    from huggingface_hub import constants

    from vla_rl.hub.registry import configure_hub
    from vla_rl.hub.server import HubServer

    keys = ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_TOKEN", "HF_HOME", "HF_HUB_DISABLE_TELEMETRY")
    saved_env = {k: os.environ.get(k) for k in keys}
    saved = {
        k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_DISABLE_XET")
    }
    os.environ["HF_HOME"] = str(tmp_path / "hf_home")
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ.pop("HF_TOKEN", None)
    try:
        with HubServer(tmp_path / "hub", token=HUB_TOKEN) as h:
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


def _wait(cond: Any, timeout_s: float, what: str, step_s: float = 0.05) -> float:
    """Poll ``cond()`` until true; the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(step_s)
    return time.monotonic()


def _robots(
    n: int, target: str, stop: threading.Event, n_async: int = 2
) -> tuple[list[Robot], list[threading.Thread]]:
    """``n`` robots on ``target``, the last ``n_async`` of them asyncio clients; started."""
    robots = [Robot(i) for i in range(n)]
    threads = [
        threading.Thread(
            target=r.run_async if r.index >= n - n_async else r.run_sync, args=(target, stop), daemon=True
        )
        for r in robots
    ]
    for t in threads:
        t.start()
    return robots, threads


def _check_robots(robots: list[Robot], t_end: float) -> None:
    """No robot failed a request (each was answered within its budget) and each was still served at ``t_end``."""
    errors = [e for r in robots for e in r.errors]
    assert not errors, errors[:3]
    assert all(r.max_latency_s < BUDGET_S for r in robots)
    assert all(any(t > t_end for t, _ in r.replies) for r in robots), "a robot stalled"


def _check_drain(replica: Replica, survivor: Any) -> dict[str, float]:
    """SIGTERM ``replica``: NOT_SERVING at once, no new requests while it drains, then it exits 0; the
    ``survivor`` (``() -> served``) takes the load. Returns when things happened (s after the signal)."""
    assert replica.proc is not None
    replica.proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    _wait(lambda: replica.health() == "NOT_SERVING", 3, "the draining replica still says SERVING")
    times = {"not_serving_after_s": time.monotonic() - t_term}
    time.sleep(0.5)  # open streams end after their current reply
    before, other_before = replica.info().served, survivor()
    time.sleep(2.0)
    assert replica.proc.poll() is None, "the replica exited before its drain ended"
    assert replica.info().served == before, "a draining replica got new requests"
    assert survivor() > other_before + 50, "the other replica did not take the load"
    assert replica.proc.wait(DRAIN_S + 20) == 0, replica.log()
    times["drain_exit_s"] = time.monotonic() - t_term
    return times


# slow: kept out of CI's short run for time (make test <= 15 min on 2 cores); run with -m slow
@pytest.mark.slow
def test_a_vla_rl_serve_replica_drains_on_sigterm(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """The short version of the fleet test below: one `vla-rl serve` process next to an in-process replica,
    4 robots streaming; SIGTERM drains the process (skipped before it exits) without a failed request."""
    replica = Replica("cli", _free_port(), tmp_path, checkpoint=str(ckpts["a"])).start()
    local = _start(ckpts["a"])
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        replica.wait_serving()
        robots, threads = _robots(4, f"{replica.address},{local.address}", stop, n_async=1)
        _wait(lambda: replica.info().served > 20 and _served(local)[0] > 20, 60, "both replicas serve")
        times = _check_drain(replica, lambda: _served(local)[0])
        t_end = time.monotonic()
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        replica.stop()
        local.stop(0)
    _check_robots(robots, t_end)
    print(
        f"\n{sum(len(r.replies) for r in robots)} chunks, 0 failed; "
        + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
    )


@pytest.mark.slow
def test_two_replicas_eight_robots_kill_restart_move_prod_drain(
    hub: Any, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    from vla_rl.hub.registry import move_ref, push_folder

    kw = {"endpoint": hub.url, "token": HUB_TOKEN}
    v1 = push_folder(ckpts["a"], "fleet/arm", message="round 1", tag="prod", **kw)
    replicas = []
    for name in ("r0", "r1"):
        (tmp_path / name).mkdir()
        replicas.append(Replica(name, _free_port(), tmp_path / name, hub.url))
    a, b = replicas
    for r in replicas:
        r.start()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    timeline: dict[str, float] = {}
    try:
        for r in replicas:
            r.wait_serving()
        assert a.info().commit == b.info().commit == v1
        t_start = time.monotonic()
        robots, threads = _robots(8, f"{a.address},{b.address}", stop)
        _wait(lambda: all(len(r.replies) >= 10 for r in robots), 60, "robots did not get going")
        _wait(lambda: a.info().served > 0 and b.info().served > 0, 20, "both replicas serve")

        # 1. SIGKILL one replica: the survivor takes the load, no robot fails a request
        served_a = a.info().served
        b.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        b.proc.wait()  # type: ignore[union-attr]
        t_kill = time.monotonic()
        time.sleep(2.0)
        assert a.info().served > served_a + 50, "the survivor did not take the load"
        assert all(any(t > t_kill + 1.0 for t, _ in r.replies) for r in robots), "a robot stalled"

        # 2. restart it on the same port: it rejoins (serves requests again; its counters start at 0)
        b.start()
        b.wait_serving()
        t_rejoin = _wait(lambda: b.info().served > 20, 30, "the restarted replica did not rejoin", 0.2)
        timeline["rejoin_s"] = t_rejoin - t_kill

        # 3. move prod: both replicas follow and serve the new commit within one follow interval
        v2 = push_folder(ckpts["b"], "fleet/arm", message="round 2", tag="round-2", **kw)
        assert a.info().commit == b.info().commit == v1
        t_move = time.monotonic()
        move_ref("fleet/arm", "prod", "round-2", **kw)
        switched: dict[str, float] = {}

        def both_on_v2() -> bool:
            for r in replicas:
                if r.name not in switched and r.info().commit == v2:
                    switched[r.name] = time.monotonic()
            return len(switched) == 2

        _wait(both_on_v2, 30, "prod did not reach both replicas")
        timeline["prod_first_s"] = min(switched.values()) - t_move
        timeline["prod_both_s"] = max(switched.values()) - t_move
        gap = max(switched.values()) - min(switched.values())
        assert gap < FOLLOW_S + 0.5, f"replicas switched {gap:.2f} s apart ({timeline})"
        assert timeline["prod_both_s"] < FOLLOW_S + 5.0, timeline  # one poll + a (tiny) checkpoint load
        t_both = max(switched.values())
        time.sleep(1.0)
        late = [c for r in robots for t, c in r.replies if t > t_both + 0.3]
        assert late and set(late) == {v2}, "a robot got the old commit after both replicas switched"

        # 4. SIGTERM one replica: it drains (NOT_SERVING, no new work) before it exits
        timeline |= _check_drain(a, lambda: b.info().served)
        t_end = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for r in replicas:
            r.stop()
    _check_robots(robots, t_end)
    n = sum(len(r.replies) for r in robots)
    print(
        f"\n8 robots, {n} chunks in {t_end - t_start:.1f} s, 0 failed; retries {sum(r.retries for r in robots)}; "
        f"worst request {max(r.max_latency_s for r in robots) * 1000:.0f} ms; "
        + ", ".join(f"{k} {v:.2f}" for k, v in timeline.items())
    )

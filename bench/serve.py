"""Policy serving: our gRPC server vs LeRobot's async policy server, same LeRobot ACT model, in one run.

1. **Concurrency.** One randomly initialised LeRobot ACT (default size, 51.6M params, no pretrained
   backbone; 3x224x224 camera + 6-d state, chunk 100) saved with ``save_pretrained`` and its processors, served
   by LeRobot's ``lerobot.async_inference.policy_server`` and by ours (the LeRobot adapter), each in its own
   process with the same torch thread count. 1, 4 and 16 closed-loop clients (threads of this process, one
   gRPC channel each) ask for chunks for ``--duration`` seconds. LeRobot's side is driven with its own
   message format and calls, as its ``RobotClient`` makes them: ``Ready`` + ``SendPolicyInstructions`` once
   (each robot client would reload the policy), then per request ``SendObservations`` (a pickled
   ``TimedObservation`` with ``must_go=True``, so none is filtered out) and ``GetActions`` until a chunk
   comes back (re-sending the observation after an empty reply, as a control loop keeps sending them).
   Its ``inference_latency`` pacing is set to 0. Reported: p50/p99 latency of a request
   (observation sent -> chunk received) and aggregate chunks/s, ours/LeRobot ratios; for LeRobot also how
   many chunks answered *another* client's observation (its single-slot observation queue is shared).
   Ours: one ``StreamAct`` stream per client, dynamic batching (max batch 16, adaptive wait).
2. **Overhead.** One client, one request at a time: the client's whole call (encoding the observation,
   gRPC both ways, decoding the chunk) minus the server's measured forward pass (``timing.inference_us``),
   for the same ACT request and for our flow VLA (3x224x224 + state, K=10 denoising steps); with adaptive
   batching wait on, and off (the batcher waits ``max_wait_us`` = 2 ms). Each point also reports the
   median of every stage the reply's timing carries (client encode, network, decode, queue, batch,
   prefix, denoise, wake, encode, client decode, TTFA) and an empty unary call's round trip on the same
   channel, the floor gRPC Python itself sets. ``--overhead-only`` runs just these (on a fresh server,
   ``--overhead-rounds`` interleaved repeats) and writes ``serve_overhead.json``. ``--overhead-models``
   adds a tiny flow VLA (d_model 32, K=2), ``--overhead-modes`` the asyncio client's stream and unary
   calls, and ``--overhead-inline-ab`` measures every point also on a second server with
   ``lone_inline_ms`` 0 (a lone robot's forward on the batcher thread), alternating which goes first.

The bench client unpickles LeRobot's replies: that is LeRobot's protocol (ours never unpickles anything),
acceptable only because the LeRobot server is our own child process on loopback.

    nice -n 19 .venv/bin/python bench/serve.py [--duration 20] [--threads 2] [--clients 1,4,16]
    nice -n 19 .venv/bin/python bench/serve.py --overhead-only --overhead-requests 100 --overhead-rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import pickle  # nosec: only to speak LeRobot's protocol to our own child process, see the docstring
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import PolicyClient, PolicyError, Timing
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import loadavg, table, write_results

ROOT = Path(__file__).resolve().parent.parent

SPEC = RobotSpec("so100", 6, 6, 30.0, "", cameras=(CameraSpec("front", 224, 224),))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# ------------------------------------------------------------------------------------------------ models
def make_models(folder: Path) -> dict[str, Path]:
    import torch

    from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
    from policies.lerobot_adapter import save_random_policy
    from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint

    out = {"act": save_random_policy(folder / "act", "act", SPEC, seed=0)}
    # the bench's flow VLA (K = 10) and a tiny one (d_model 32, K = 2): a short forward, for the overhead
    for name, size in (
        ("flow", {"num_inference_steps": 10}),
        ("tiny", {"num_inference_steps": 2, "d_model": 32}),
    ):
        cfg = FlowVLAConfig.from_robot_spec(SPEC, instruction_encoder="none", **size)
        torch.manual_seed(0)
        out[name] = folder / name
        save_checkpoint(
            out[name],
            FlowVLAPolicy(cfg).state_dict(),
            CheckpointInfo("flow_vla", cfg.to_dict(), SPEC, {}, Lineage("bench")),
        )
    return out


def obs(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "state": rng.normal(size=SPEC.state_dim).astype(np.float32),
        "cameras": {"front": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)},
    }


# ------------------------------------------------------------------------------------------------ servers
def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # this checkout's client package too: the installed one may be another checkout's (a git worktree)
    path = os.pathsep.join((str(ROOT), str(ROOT / "packages" / "vla-rl-client")))
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=path)
    return env


def serve_ours_main(args: argparse.Namespace) -> None:
    """``--serve-ours``: host the bench models in this (child) process until SIGTERM."""
    import torch

    from server.config import ServerConfig
    from server.policy_server import PolicyServer

    torch.set_num_threads(args.threads)
    models = dict(kv.split("=", 1) for kv in args.serve_ours.split(","))
    config = ServerConfig(
        checkpoint=next(iter(models.values())),
        port=args.port,
        device="cpu",
        max_batch=16,
        max_wait_us=2000,
        adaptive_wait=not args.no_adaptive,
        **({} if args.lone_inline_ms is None else {"lone_inline_ms": args.lone_inline_ms}),
    )
    srv = PolicyServer(config, models=models).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    srv.stop()


def wait_until_serving(
    address: str, proc: subprocess.Popen[bytes], timeout_s: float, output: Callable[[], str]
) -> None:
    """Poll the gRPC health check until SERVING; raise with the server's ``output()`` if it exits or
    does not come up within ``timeout_s``."""
    with PolicyClient(address, timeout_s=2) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(PolicyError):
                if c.health() == "SERVING":
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                state = "exited" if proc.poll() is not None else f"not serving after {timeout_s:.0f} s"
                raise RuntimeError(f"server at {address} {state}:\n{output()}")
            time.sleep(0.5)


@contextlib.contextmanager
def our_server(
    models: dict[str, Path], threads: int, adaptive: bool, lone_inline_ms: float | None = None
) -> Iterator[str]:
    """Our server in a child process (``lone_inline_ms``: that setting of it; None = its default)."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve-ours", ",".join(f"{k}={v}" for k, v in models.items())]
    cmd += ["--port", str(port), "--threads", str(threads)] + ([] if adaptive else ["--no-adaptive"])
    cmd += [] if lone_inline_ms is None else ["--lone-inline-ms", str(lone_inline_ms)]
    proc = subprocess.Popen(cmd, env=child_env(threads), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(
            address,
            proc,
            600,
            lambda: proc.stderr.read().decode()[-2000:],  # type: ignore[union-attr]
        )
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def lerobot_server(threads: int, workdir: Path) -> Iterator[str]:
    import grpc

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "lerobot.async_inference.policy_server",
        "--host=127.0.0.1",
        f"--port={port}",
    ]
    cmd += ["--fps=30", "--inference_latency=0", "--obs_queue_timeout=2"]
    proc = subprocess.Popen(
        cmd, env=child_env(threads), cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=300)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ------------------------------------------------------------------------------------------------ load
def run_clients(
    n: int,
    duration: float,
    make_client: Callable[[int], tuple[Callable[[int], dict[str, Any]], Callable[[], None]]],
) -> dict[str, Any]:
    """``n`` closed-loop clients for ``duration`` s after one warm-up request each; per-request records."""
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)
    box: dict[str, float] = {}

    def worker(k: int) -> None:
        request, close = make_client(k)
        try:
            request(0)  # warm-up (connection, first batch), not recorded
        except Exception as e:
            errors.append(f"warm-up: {type(e).__name__}: {e}")
        barrier.wait()
        i = 1
        while time.monotonic() < box["end"]:
            try:
                rec = request(i)
            except Exception as e:  # counted, not fatal: a server that fails requests shows it here
                with lock:
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                time.sleep(0.05)
                continue
            with lock:
                records.append(rec)
            i += 1
        close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    box["end"] = float("inf")
    barrier.wait()
    start = time.monotonic()
    box["end"] = start + duration
    load0 = loadavg()
    for t in threads:
        t.join(duration + 120)
    elapsed = time.monotonic() - start
    lat = [r["latency_ms"] for r in records]
    own = [r for r in records if r.get("own", True)]
    # our server reports its forward pass and the commit that answered (LeRobot's does not)
    inference = [r["inference_ms"] for r in records if "inference_ms" in r]
    ours: dict[str, Any] = {}
    if inference:
        ours["inference_p50_ms"] = round(pct(inference, 50), 2)
        ours["commits"] = dict(collections.Counter(r["commit"] for r in records))
    return {
        "clients": n,
        "seconds": round(elapsed, 2),
        "chunks": len(records),
        "chunks_per_s": round(len(records) / elapsed, 3),
        "own_chunks_per_s": round(len(own) / elapsed, 3),
        "p50_ms": round(pct(lat, 50), 1),
        "p99_ms": round(pct(lat, 99), 1),
        "mean_batch": round(statistics.fmean(r.get("batch", 1) for r in records), 2) if records else None,
        "empty_replies": sum(r.get("empty", 0) for r in records),
        "errors": len(errors),
        "error_samples": errors[:3],
        "loadavg_start": load0,
        "loadavg_end": loadavg(),
        **ours,
    }


def our_client(
    address: str, model_id: str
) -> Callable[[int], tuple[Callable[[int], dict[str, Any]], Callable[[], None]]]:
    def make(k: int) -> tuple[Callable[[int], dict[str, Any]], Callable[[], None]]:
        rng = np.random.default_rng(k)
        o = obs(rng)
        c = PolicyClient(address, timeout_s=600, model_id=model_id)
        s = c.stream()

        def request(i: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            r = s.act(o, seed=i, timeout_s=600)
            return {
                "latency_ms": (time.perf_counter() - t0) * 1000,
                "batch": r.batch_size,
                "inference_ms": r.timing.inference_us / 1000,
                "commit": r.commit,
            }

        def close() -> None:
            s.close()
            c.close()

        return request, close

    return make


def lerobot_setup(address: str, folder: Path) -> dict[str, Any]:
    """What RobotClient.start() does once: Ready, then SendPolicyInstructions (loads the policy)."""
    import grpc
    from lerobot.async_inference.helpers import RemotePolicyConfig
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.utils.feature_utils import hw_to_dataset_features

    hw = {f"j{i}.pos": float for i in range(SPEC.state_dim)} | {"front": (224, 224, 3)}
    features = hw_to_dataset_features(hw, "observation", use_video=False)
    with grpc.insecure_channel(address) as ch:
        stub = services_pb2_grpc.AsyncInferenceStub(ch)
        stub.Ready(services_pb2.Empty(), timeout=60)
        cfg = RemotePolicyConfig("act", str(folder), features, actions_per_chunk=100, device="cpu")
        stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(cfg)), timeout=600)
    return features


def lerobot_client(
    address: str,
) -> Callable[[int], tuple[Callable[[int], dict[str, Any]], Callable[[], None]]]:
    import grpc
    from lerobot.async_inference.helpers import TimedObservation
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.transport.utils import send_bytes_in_chunks

    def make(k: int) -> tuple[Callable[[int], dict[str, Any]], Callable[[], None]]:
        rng = np.random.default_rng(k)
        o = obs(rng)
        raw = {f"j{i}.pos": float(v) for i, v in enumerate(o["state"])} | {"front": o["cameras"]["front"]}
        ch = grpc.insecure_channel(address)
        stub = services_pb2_grpc.AsyncInferenceStub(ch)

        def request(i: int) -> dict[str, Any]:
            timestep = k * 1_000_000 + i
            t0 = time.perf_counter()
            timed = TimedObservation(timestamp=time.time(), timestep=timestep, observation=raw, must_go=True)
            payload = pickle.dumps(timed)
            empty = 0
            while True:
                pieces = send_bytes_in_chunks(payload, services_pb2.Observation, silent=True)
                stub.SendObservations(pieces, timeout=600)
                reply = stub.GetActions(services_pb2.Empty(), timeout=600)
                if reply.data:
                    break
                # Empty after obs_queue_timeout: another client's observation replaced ours in the server's
                # one-slot queue. A robot's control loop keeps sending observations; so do we.
                empty += 1
                if time.perf_counter() - t0 > 600:
                    raise TimeoutError("no chunk in 600 s")
            actions = pickle.loads(reply.data)  # nosec: our own child process, LeRobot's protocol
            return {
                "latency_ms": (time.perf_counter() - t0) * 1000,
                "own": actions[0].get_timestep() == timestep,
                "empty": empty,
            }

        return request, ch.close

    return make


STAGES = (
    "client_encode_us",
    "network_us",
    "decode_us",
    "queue_us",
    "batch_us",
    "prefix_us",
    "denoise_us",
    "wake_us",
    "encode_us",
    "client_decode_us",
    "ttfa_us",
)
"""The per-stage timing every reply carries (``vla_rl_client.policy_common.Timing``), in the order a request
lives through them; their medians are reported per overhead point."""


def empty_call_floor(client: PolicyClient, n: int) -> float:
    """p50 ms of an empty unary call on the same channel (the health service's Check): what gRPC Python's own
    round trip on this machine costs, the floor under any overhead."""
    for _ in range(3):
        client.health()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        client.health()
        xs.append((time.perf_counter_ns() - t0) / 1e6)
    return pct(xs, 50)


Calls = list[tuple[float, Timing]]
"""Each request's wall time (µs, the whole ``act()`` call) and its reply's timing."""


def sync_calls(address: str, model_id: str, n: int, stream: bool, o: dict[str, Any]) -> tuple[Calls, float]:
    """``n`` sequential ``act()`` calls of the blocking client (a stream or unary calls), after 3 warm-up
    ones, and the empty-call floor on the same channel."""
    with PolicyClient(address, timeout_s=600, model_id=model_id) as c:
        floor = empty_call_floor(c, n)
        s = c.stream() if stream else None
        act = s.act if s is not None else c.act
        calls: Calls = []
        for i in range(-3, n):
            t0 = time.perf_counter_ns()
            r = act(o, seed=max(i, 0))
            calls.append(((time.perf_counter_ns() - t0) / 1000, r.timing))
        if s is not None:
            s.close()
    return calls[3:], floor


async def aio_calls(
    address: str, model_id: str, n: int, stream: bool, o: dict[str, Any]
) -> tuple[Calls, float]:
    """:func:`sync_calls` with the asyncio client, on this thread's own event loop: requests are written and
    replies read on the caller's loop, with no request-iterator or reply-reader thread (gRPC's completion
    queue poller thread still wakes the loop when a reply arrives)."""
    async with AsyncPolicyClient(address, timeout_s=600, model_id=model_id) as c:
        floor: list[float] = []
        for _ in range(-3, n):
            t0 = time.perf_counter_ns()
            await c.health()
            floor.append((time.perf_counter_ns() - t0) / 1e6)
        s = c.stream() if stream else None
        act = s.act if s is not None else c.act
        calls: Calls = []
        for i in range(-3, n):
            t0 = time.perf_counter_ns()
            r = await act(o, seed=max(i, 0))
            calls.append(((time.perf_counter_ns() - t0) / 1000, r.timing))
        if s is not None:
            await s.close()
    return calls[3:], pct(floor[3:], 50)


ACTIVITY_WINDOW_S = 1.0
"""``server.batching.BatchQueue``'s default ``activity_window_s``."""

MODES = ("stream", "unary", "aio-stream", "aio-unary")
"""The client paths an overhead point can measure: the blocking client's stream and unary calls, and the
asyncio client's (``aio-``)."""


def overhead(address: str, model_id: str, n: int, mode: str) -> dict[str, Any]:
    """One client, ``n`` sequential requests (``mode``: one of :data:`MODES`). The overhead is everything but
    the model: the client's call (encoding the observation, gRPC both ways, decoding the chunk) minus the
    server's forward pass; also the older round trip minus forward (the encoding and decoding left out),
    the in-server part, each stage's median and an empty call's round trip on the same channel."""
    o = obs(np.random.default_rng(123))
    stream = mode.endswith("stream")
    # the previous point's connection must be forgotten first (the server's 1 s activity window), or this
    # lone client waits max_wait_us for it (adaptive wait) and is not served as a lone robot
    time.sleep(ACTIVITY_WINDOW_S + 0.2)
    if mode.startswith("aio-"):
        calls, floor = asyncio.run(aio_calls(address, model_id, n, stream, o))
    else:
        calls, floor = sync_calls(address, model_id, n, stream, o)
    e2e = [(wall_us - t.inference_us) / 1000 for wall_us, t in calls]
    rtt = [(t.round_trip_us - t.inference_us) / 1000 for _, t in calls]
    srv = [(t.total_us - t.inference_us) / 1000 for _, t in calls]
    inf = [t.inference_us / 1000 for _, t in calls]
    stages = {k: [getattr(t, k) for _, t in calls] for k in STAGES}
    return {
        "model": model_id,
        "mode": mode,
        "requests": n,
        "overhead_p50_ms": round(pct(e2e, 50), 3),
        "overhead_p99_ms": round(pct(e2e, 99), 3),
        "round_trip_overhead_p50_ms": round(pct(rtt, 50), 3),
        "server_overhead_p50_ms": round(pct(srv, 50), 3),
        "forward_p50_ms": round(pct(inf, 50), 1),
        "empty_call_p50_ms": round(floor, 3),
        "stages_p50_us": {k: round(pct(v, 50)) for k, v in stages.items()},
        "loadavg": loadavg(),
    }


def overhead_table(overheads: list[dict[str, Any]]) -> str:
    """The overhead points, then each one's stage medians."""
    points = table(
        [
            [
                o["model"],
                o["mode"],
                o["adaptive_wait"],
                o["lone_inline"],
                o["overhead_p50_ms"],
                o["overhead_p99_ms"],
                o["round_trip_overhead_p50_ms"],
                o["server_overhead_p50_ms"],
                o["empty_call_p50_ms"],
                o["forward_p50_ms"],
                o["loadavg"][0],
            ]
            for o in overheads
        ],
        [
            "model",
            "call",
            "adaptive",
            "lone inline",
            "overhead p50 ms",
            "p99 ms",
            "round trip - forward p50 ms",
            "in-server p50 ms",
            "empty call p50 ms",
            "forward p50 ms",
            "load",
        ],
    )
    stages = table(
        [
            [o["model"], o["mode"], o["lone_inline"], *(o["stages_p50_us"][k] for k in STAGES)]
            for o in overheads
        ],
        ["model", "call", "lone inline", *(k.removesuffix("_us") for k in STAGES)],
    )
    return (
        f"{points}\n\nstage medians, us:\n{stages}\n\nper point over the rounds:\n{round_medians(overheads)}"
    )


def overhead_points(
    models: dict[str, Path],
    threads: int,
    n: int,
    rounds: int,
    *,
    adaptive_off: bool = True,
    model_ids: tuple[str, ...] = ("act", "flow"),
    modes: tuple[str, ...] = ("stream", "unary"),
    inline_ab: bool = False,
) -> list[dict[str, Any]]:
    """The overhead points on our server alone: each of ``model_ids`` and ``modes`` (:data:`MODES`),
    ``rounds`` times interleaved (load drifts on a shared machine: each point's rounds spread over the run),
    then the flow VLA with adaptive wait off. ``inline_ab``: a second server with ``lone_inline_ms`` 0 (a
    lone robot's forward on the batcher thread) runs beside the first, and every point is measured on both,
    alternating which goes first (an interleaved A/B)."""
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = [(True, stack.enter_context(our_server(models, threads, adaptive=True)))]
        if inline_ab:
            servers.append((False, stack.enter_context(our_server(models, threads, True, lone_inline_ms=0))))
        for r in range(rounds):
            for model in model_ids:
                for mode in modes:
                    for inline, addr in servers[:: -1 if r % 2 else 1]:
                        point = overhead(addr, model, n, mode)
                        out.append({"adaptive_wait": True, "lone_inline": inline, "round": r, **point})
    if adaptive_off:
        with our_server({"flow": models["flow"]}, threads, adaptive=False) as address:
            for mode in ("stream", "unary"):
                point = overhead(address, "flow", n, mode)
                out.append({"adaptive_wait": False, "lone_inline": False, "round": 0, **point})
    return out


def round_medians(overheads: list[dict[str, Any]]) -> str:
    """Per point (model, call, adaptive wait, lone inline): its rounds' overhead p50s and their median."""
    rounds: dict[tuple[Any, ...], list[float]] = collections.defaultdict(list)
    for o in overheads:
        rounds[(o["model"], o["mode"], o["adaptive_wait"], o["lone_inline"])].append(o["overhead_p50_ms"])
    rows = [
        [*k, " / ".join(f"{x:.2f}" for x in v), round(statistics.median(v), 3)] for k, v in rounds.items()
    ]
    return table(rows, ["model", "call", "adaptive", "lone inline", "rounds' p50 ms", "median"])


def ratio_rows(compare: list[dict[str, Any]], clients: list[int]) -> list[dict[str, Any]]:
    """Ours relative to LeRobot at each client count: chunks/s (all, and LeRobot's own-observation
    ones), p50 and p99."""

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 2) if b else None

    out = []
    for n in clients:
        le = next(r for r in compare if r["server"] == "lerobot" and r["clients"] == n)
        ou = next(r for r in compare if r["server"] == "ours" and r["clients"] == n)
        out.append(
            {
                "clients": n,
                "throughput_ratio": ratio(ou["chunks_per_s"], le["chunks_per_s"]),
                "own_throughput_ratio": ratio(ou["chunks_per_s"], le["own_chunks_per_s"]),
                "p50_ratio": ratio(ou["p50_ms"], le["p50_ms"]),
                "p99_ratio": ratio(ou["p99_ms"], le["p99_ms"]),
            }
        )
    return out


# ------------------------------------------------------------------------------------------------ main
def compare_servers(
    models: dict[str, Path], work: Path, threads: int, clients: list[int], duration: float
) -> Any:
    """LeRobot's server and ours, both up, 1/4/16 closed-loop clients each (points alternate to spread load
    drift): the per-point records and ours/LeRobot ratios."""
    compare: list[dict[str, Any]] = []
    print("starting LeRobot's server and ours (both stay up; points alternate to spread load drift) ...")
    with lerobot_server(threads, work) as le_addr, our_server(models, threads, adaptive=True) as addr:
        lerobot_setup(le_addr, models["act"])
        for i, n in enumerate(clients):
            order = ["lerobot", "ours"] if i % 2 == 0 else ["ours", "lerobot"]
            for name in order:
                make = lerobot_client(le_addr) if name == "lerobot" else our_client(addr, "act")
                r = run_clients(n, duration, make)
                compare.append({"server": name, **r})
                print(
                    f"  {name:<8}{n:>2} clients: {r['chunks_per_s']} chunks/s p50 {r['p50_ms']} ms",
                    flush=True,
                )
    return compare, ratio_rows(compare, clients)


def compare_tables(compare: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    keys = ["server", "clients", "chunks_per_s", "own_chunks_per_s", "p50_ms", "p99_ms", "mean_batch"]
    rows = [
        [r[k] for k in keys] + [r["empty_replies"], r["errors"], "/".join(map(str, r["loadavg_start"]))]
        for r in compare
    ]
    header = [
        "server",
        "clients",
        "chunks/s",
        "own chunks/s",
        "p50 ms",
        "p99 ms",
        "batch",
        "empty",
        "err",
        "load",
    ]
    rkeys = ["clients", "throughput_ratio", "own_throughput_ratio", "p50_ratio", "p99_ratio"]
    rheader = [
        "clients",
        "chunks/s ours/LeRobot",
        "vs LeRobot own-obs chunks/s",
        "p50 ours/LeRobot",
        "p99 ours/LeRobot",
    ]
    return f"{table(rows, header)}\n\n{table([[r[k] for k in rkeys] for r in ratios], rheader)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per (server, clients) point")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server process")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--overhead-requests", type=int, default=30)
    p.add_argument(
        "--overhead-rounds", type=int, default=1, help="interleaved repeats of each overhead point"
    )
    p.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the overhead points (default out: serve_overhead.json)",
    )
    p.add_argument("--overhead-models", default="act,flow", help="of act, flow, tiny (the overhead points)")
    p.add_argument("--overhead-modes", default="stream,unary", help=f"of {', '.join(MODES)}")
    p.add_argument(
        "--overhead-inline-ab",
        action="store_true",
        help="every overhead point also on a server with lone_inline_ms 0, interleaved",
    )
    p.add_argument(
        "--no-overhead-adaptive-off", action="store_true", help="skip the adaptive-wait-off points"
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--serve-ours", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-adaptive", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lone-inline-ms", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_ours:
        serve_ours_main(args)
        return
    clients = [int(x) for x in args.clients.split(",")]
    results: dict[str, Any] = {
        "conditions": {
            "duration_s": args.duration,
            "server_torch_threads": args.threads,
            "cores": os.cpu_count(),
            "loadavg_at_start": loadavg(),
            "model": "LeRobot ACT, default size, random weights, no pretrained backbone; 3x224x224 + 6-d state; "
            "chunk 100",
            "lerobot_server": "lerobot.async_inference.policy_server, inference_latency=0, obs_queue_timeout=2, "
            "one Ready + SendPolicyInstructions, then SendObservations(must_go) + GetActions per request",
            "ours": "StreamAct per client, max_batch 16, max_wait_us 2000, adaptive wait",
            "overhead": "one client: its act() call (encode, gRPC both ways, decode) minus the server's forward",
        }
    }
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        work = Path(tmp)
        print("building models ...", flush=True)
        models = make_models(work)
        if not args.overhead_only:
            compare, ratios = compare_servers(models, work, args.threads, clients, args.duration)
            results.update(compare=compare, ratios=ratios)
            print()
            print(compare_tables(compare, ratios))
        print("overhead points ...", flush=True)
        overheads = overhead_points(
            models,
            args.threads,
            args.overhead_requests,
            args.overhead_rounds,
            adaptive_off=not args.no_overhead_adaptive_off,
            model_ids=tuple(args.overhead_models.split(",")),
            modes=tuple(args.overhead_modes.split(",")),
            inline_ab=args.overhead_inline_ab,
        )
    results.update(overhead=overheads)
    results["conditions"]["loadavg_at_end"] = loadavg()
    print()
    print(overhead_table(overheads))
    path = write_results("serve_overhead" if args.overhead_only else "serve", results, args.out)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

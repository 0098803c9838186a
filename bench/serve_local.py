"""Serving overhead without gRPC: the local transport (``--local-socket``) against gRPC on the same warm server.

The local transport (:mod:`server.local_transport`, client :class:`vla_rl_client.local_client.LocalPolicyClient`)
carries the policy service's own messages as length-prefixed frames on a Unix domain socket, answered on
the server's event loop by the same handler as a gRPC ``StreamAct`` request (decoding and its checks, the
lone-robot path or the batcher, the reply's timing fields); gRPC's C core, its completion-queue threads and
HTTP/2 are gone, on both ends.

One server process hosts the bench's flow VLA and the tiny one on loopback TCP, its gRPC Unix socket
(``--unix-socket``) and the local socket; each round measures every (model, transport) point in turn,
alternating the order, with one client making sequential requests (gRPC: ``PolicyClient.stream()``). The
overhead is the client's whole call minus the server's forward, as in ``bench/serve.py``'s overhead points.
``--clients N`` then runs N closed-loop robots on the flow VLA over gRPC and over the local transport in
turn (two rounds, alternating): chunks/s, latency and the mean batch, to check that batching works alike.

    nice -n 10 .venv/bin/python bench/serve_local.py --requests 100 --rounds 6
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.local_client import LocalPolicyClient
from vla_rl_client.policy_client import PolicyClient

from bench.common import table, write_results
from bench.serve import (
    ACTIVITY_WINDOW_S,
    STAGES,
    Calls,
    call_stats,
    loadavg,
    make_models,
    obs,
    our_client,
    our_server,
    run_clients,
)

TRANSPORTS = ("grpc-tcp", "grpc-unix", "local")


def timed_calls(act: Any, o: dict[str, Any], n: int) -> Calls:
    """``n`` sequential ``act()`` calls after 3 warm-up ones: each one's wall time (µs) and timing."""
    calls: Calls = []
    for i in range(-3, n):
        t0 = time.perf_counter_ns()
        r = act(o, seed=max(i, 0))
        calls.append(((time.perf_counter_ns() - t0) / 1000, r.timing))
    return calls[3:]


def point(transport: str, addr: dict[str, str], model: str, n: int) -> dict[str, Any]:
    """One client of ``transport`` (one of :data:`TRANSPORTS`, at ``addr[transport]``), ``n`` requests."""
    o = obs(np.random.default_rng(123))
    time.sleep(ACTIVITY_WINDOW_S + 0.2)  # the previous point's connection forgotten: a lone robot again
    if transport == "local":
        with LocalPolicyClient(addr[transport], timeout_s=600, model_id=model) as c:
            calls = timed_calls(c.act, o, n)
    else:
        with PolicyClient(addr[transport], timeout_s=600, model_id=model) as pc, pc.stream() as s:
            calls = timed_calls(s.act, o, n)
    return {"model": model, "transport": transport, "requests": n, **call_stats(calls)}


def local_client(
    path: str, model_id: str
) -> Callable[[int], tuple[Callable[[int], dict[str, Any]], Callable[[], None]]]:
    """:func:`bench.serve.our_client`'s closed-loop robot, on the local transport."""

    def make(k: int) -> tuple[Callable[[int], dict[str, Any]], Callable[[], None]]:
        o = obs(np.random.default_rng(k))
        c = LocalPolicyClient(path, timeout_s=600, model_id=model_id)

        def request(i: int) -> dict[str, Any]:
            t0 = time.perf_counter()
            r = c.act(o, seed=i)
            return {
                "latency_ms": (time.perf_counter() - t0) * 1000,
                "batch": r.batch_size,
                "inference_ms": r.timing.inference_us / 1000,
                "commit": r.commit,
            }

        return request, c.close

    return make


def crowd(addr: dict[str, str], clients: int, duration: float, rounds: int) -> list[dict[str, Any]]:
    """``clients`` closed-loop robots on the flow VLA for ``duration`` s, over gRPC (TCP stream) and the local
    transport in turn, ``rounds`` times alternating: whether batching works the same over both."""
    out = []
    for r in range(rounds):
        for transport in ("grpc-tcp", "local")[:: -1 if r % 2 else 1]:
            make = (
                local_client(addr["local"], "flow")
                if transport == "local"
                else our_client(addr[transport], "flow")
            )
            res = run_clients(clients, duration, make)
            out.append({"round": r, "transport": transport, **res})
            print(
                f"  {clients} clients {transport}: {res['chunks_per_s']} chunks/s, p50 {res['p50_ms']} ms, "
                f"batch {res['mean_batch']}, errors {res['errors']}",
                flush=True,
            )
    return out


def summary(points: list[dict[str, Any]]) -> str:
    """Per (model, transport): the rounds' overhead p50s, their median, and the median stages."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for p in points:
        rows[(p["model"], p["transport"])].append(p)
    out = []
    for (model, transport), ps in rows.items():
        med = {k: round(statistics.median(p["stages_p50_us"][k] for p in ps)) for k in STAGES}
        out.append(
            [
                model,
                transport,
                " / ".join(f"{p['overhead_p50_ms']:.2f}" for p in ps),
                round(statistics.median(p["overhead_p50_ms"] for p in ps), 3),
                round(statistics.median(p["server_overhead_p50_ms"] for p in ps), 3),
                med["client_encode_us"],
                med["network_us"],
                med["client_decode_us"],
                f"{min(p['loadavg'][0] for p in ps)}-{max(p['loadavg'][0] for p in ps)}",
            ]
        )
    header = ["model", "transport", "rounds' overhead p50 ms", "median", "in-server p50 ms"]
    return table(out, [*header, "client encode us", "network us", "client decode us", "load"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100, help="sequential requests per point")
    p.add_argument("--rounds", type=int, default=4, help="interleaved repeats of every point")
    p.add_argument("--models", default="tiny,flow", help="of flow, tiny")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument(
        "--clients", type=int, default=0, help="then this many closed-loop robots per transport (0: no)"
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds per crowd point")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    wanted = args.models.split(",")
    load_start = loadavg()
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_local_") as tmp:
        work = Path(tmp)
        models = {k: v for k, v in make_models(work).items() if k in wanted}
        sockets = {"grpc-unix": work / "sock" / "grpc.sock", "local": work / "sock" / "local.sock"}
        with our_server(
            models, args.threads, True, unix_socket=sockets["grpc-unix"], local_socket=sockets["local"]
        ) as tcp:
            addr = {
                "grpc-tcp": tcp,
                "grpc-unix": f"unix://{sockets['grpc-unix']}",
                "local": str(sockets["local"]),
            }
            for r in range(args.rounds):
                for model in wanted:
                    for transport in TRANSPORTS[:: -1 if r % 2 else 1]:
                        points.append({"round": r, **point(transport, addr, model, args.requests)})
                        print(
                            f"  round {r} {model} {transport}: {points[-1]['overhead_p50_ms']} ms", flush=True
                        )
            crowds = crowd(addr, args.clients, args.duration, 2) if args.clients else []
    print(summary(points))
    results = {
        "conditions": {
            "cores": os.cpu_count(),
            "server_torch_threads": args.threads,
            "requests": args.requests,
            "rounds": args.rounds,
            "loadavg_at_start": load_start,
            "loadavg_at_end": loadavg(),
            "overhead": "one client: its act() call (encode, transport both ways, decode) minus the server's forward",
            "transports": "grpc-tcp / grpc-unix: PolicyClient.stream() over loopback TCP / the gRPC Unix socket; "
            "local: LocalPolicyClient on the server's --local-socket (length-prefixed frames, no gRPC)",
        },
        "points": points,
        "crowd": crowds,
    }
    print(f"\nresults: {write_results('serve_local', results, args.out)}")


if __name__ == "__main__":
    main()

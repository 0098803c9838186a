"""Policy server replicas: what a robot sees when one of two replicas dies, restarts or drains.

Two ``vla-rl serve`` processes (a small flow VLA: one 64 px camera + state, K = 5, on the CPU) serve the same
local checkpoint; ``--robots`` robots (threads of this process, each its own channel to both replicas as
``a:1,b:2``: gRPC ``round_robin`` with health checking) stream chunks, one stream per ``--episode``-request
episode, each request with a ``--budget`` second budget. Phases of ``--phase-s`` seconds each:

1. ``steady``: both replicas up;
2. ``killed``: from SIGKILL of replica 1 (the robots on it reopen their streams on replica 0);
3. ``rejoined``: from replica 1 serving again after a restart on its port;
4. ``draining``: from SIGTERM of replica 0 (``--drain``: NOT_SERVING, then it stops).

Per phase: chunks/s, request latency p50 / p99 / max, failed requests, and the longest any robot went
without a reply (the failover gap); plus how long the restart took, and how many requests the draining
replica still answered once it said NOT_SERVING.

    nice -n 19 .venv/bin/python bench/replicas.py [--robots 8] [--phase-s 8]   # writes bench/results/replicas.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.policy_client import Backoff, PolicyClient, PolicyError

from bench.common import LoadSampler, loadavg, table, write_results

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "vla_rl.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_checkpoint(folder: Path) -> Path:
    import torch
    from vla_rl_client.spec import CameraSpec, RobotSpec

    from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
    from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint

    spec = RobotSpec("arm", 8, 6, 10.0, "push the cube", cameras=(CameraSpec("front", 64, 64),))
    cfg = FlowVLAConfig.from_robot_spec(
        spec, d_model=64, n_layers=2, expert_n_layers=2, n_heads=4, instruction_encoder="none",
        chunk_len=10, n_exec=5, num_inference_steps=5,
    )  # fmt: skip
    torch.manual_seed(0)
    info = CheckpointInfo("flow_vla", cfg.to_dict(), spec, {}, Lineage("bench"))
    save_checkpoint(folder, FlowVLAPolicy(cfg).state_dict(), info)
    return folder


class Replica:
    def __init__(self, ckpt: Path, drain_s: float, logdir: Path, name: str) -> None:
        self.ckpt, self.drain_s, self.logdir, self.name = ckpt, drain_s, logdir, name
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start and wait until SERVING; seconds it took."""
        t0 = time.monotonic()
        cmd = [*CLI, "serve", "--checkpoint", str(self.ckpt), "--device", "cpu", "--port", str(self.port)]
        cmd += ["--drain", str(self.drain_s)]
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(self.logdir / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        with PolicyClient(self.address, timeout_s=2) as probe:
            while True:
                try:
                    if probe.health() == "SERVING":
                        return time.monotonic() - t0
                except PolicyError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError((self.logdir / f"{self.name}.log").read_text()[-2000:])
                time.sleep(0.2)

    def served(self) -> int:
        with PolicyClient(self.address, timeout_s=5) as probe:
            return int(probe.info()["default"].served)

    def health(self) -> str:
        with PolicyClient(self.address, timeout_s=2) as probe:
            return probe.health()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def robot(index: int, target: str, args: argparse.Namespace, stop: threading.Event, log: list[Any]) -> None:
    """Stream chunks until ``stop``; log (monotonic send time, latency s or None when it failed)."""
    rng = np.random.default_rng(index)
    backoff = Backoff(initial_s=0.02, max_s=0.3)
    with PolicyClient(target, timeout_s=args.budget, backoff=backoff) as c:
        while not stop.is_set():
            with c.stream() as s:
                for _ in range(args.episode):
                    obs = {
                        "state": rng.normal(size=8).astype(np.float32),
                        "cameras": {"front": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                    }
                    t0 = time.monotonic()
                    try:
                        s.act(obs, seed=int(rng.integers(1 << 31)))
                        log.append((index, t0, time.monotonic() - t0))
                    except PolicyError:
                        log.append((index, t0, None))
                    time.sleep(args.pause_s)


def phase_stats(log: list[Any], t0: float, t1: float, robots: int) -> dict[str, Any]:
    rows = [r for r in log if t0 <= r[1] < t1]
    ok = [r[2] for r in rows if r[2] is not None]
    gap = 0.0
    for i in range(robots):
        times = sorted(r[1] + r[2] for r in rows if r[0] == i and r[2] is not None)
        edges = [t0, *times, t1]
        gap = max(gap, max(b - a for a, b in itertools.pairwise(edges)))
    pct = lambda q: round(float(np.percentile(ok, q)) * 1000, 1) if ok else None  # noqa: E731
    return {
        "seconds": round(t1 - t0, 2),
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "chunks_per_s": round(len(ok) / (t1 - t0), 1),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": round(max(ok) * 1000, 1) if ok else None,
        "longest_gap_ms": round(gap * 1000, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--robots", type=int, default=8)
    p.add_argument("--phase-s", type=float, default=8.0)
    p.add_argument("--episode", type=int, default=5, help="requests per stream")
    p.add_argument("--pause-s", type=float, default=0.02, help="between a robot's requests")
    p.add_argument("--budget", type=float, default=10.0, help="each request's retry budget (s)")
    p.add_argument("--drain", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    with LoadSampler() as load, tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt")
        reps = [Replica(ckpt, args.drain, Path(tmp), f"r{i}") for i in range(2)]
        stop = threading.Event()
        log: list[Any] = []
        marks: dict[str, float] = {}
        extra: dict[str, Any] = {}
        threads: list[threading.Thread] = []
        extra["loadavg_before"] = loadavg()
        try:
            extra["start_s"] = [round(r.start(), 2) for r in reps]
            target = ",".join(r.address for r in reps)
            threads = [
                threading.Thread(target=robot, args=(i, target, args, stop, log), daemon=True)
                for i in range(args.robots)
            ]
            for t in threads:
                t.start()
            time.sleep(2.0)  # warm up
            marks["steady"] = time.monotonic()
            time.sleep(args.phase_s)
            extra["served_steady"] = [r.served() for r in reps]
            reps[1].signal(signal.SIGKILL)
            reps[1].proc.wait()  # type: ignore[union-attr]
            marks["killed"] = time.monotonic()
            time.sleep(args.phase_s)
            extra["restart_s"] = round(reps[1].start(), 2)
            up = time.monotonic()
            while reps[1].served() == 0:
                time.sleep(0.05)
            extra["rejoin_after_serving_s"] = round(time.monotonic() - up, 2)
            marks["rejoined"] = time.monotonic()
            time.sleep(args.phase_s)
            reps[0].signal(signal.SIGTERM)
            t_term = time.monotonic()
            marks["draining"] = t_term
            while reps[0].health() != "NOT_SERVING":
                time.sleep(0.01)
            extra["not_serving_after_s"] = round(time.monotonic() - t_term, 3)
            n0 = reps[0].served()
            time.sleep(min(args.phase_s, args.drain - 0.5))
            extra["answered_while_draining"] = reps[0].served() - n0
            rc = reps[0].proc.wait(args.drain + 30)  # type: ignore[union-attr]
            extra["drain_exit_s"] = round(time.monotonic() - t_term, 2)
            extra["drain_exit_code"] = rc
            marks["end"] = time.monotonic()
            extra["loadavg_after"] = loadavg()
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            for r in reps:
                r.stop()
    names = ["steady", "killed", "rejoined", "draining"]
    ends = [marks[n] for n in names[1:]] + [marks["end"]]
    phases = {n: phase_stats(log, marks[n], e, args.robots) for n, e in zip(names, ends, strict=True)}
    results = {
        "config": vars(args) | {"out": str(args.out)},
        "phases": phases,
        **extra,
        "load": load.summary(),
    }
    path = write_results("replicas", results, args.out)
    keys = ["requests", "failed", "chunks_per_s", "p50_ms", "p99_ms", "max_ms", "longest_gap_ms"]
    print(table([[n, *(v[k] for k in keys)] for n, v in phases.items()], ["phase", *keys]))
    print(", ".join(f"{k} {v}" for k, v in extra.items()))
    print(f"-> {path}")


if __name__ == "__main__":
    main()

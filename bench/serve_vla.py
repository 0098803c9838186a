"""Serving SmolVLA at its published size: our gRPC server vs LeRobot's async policy server, same policy, one run.

The policy is LeRobot's SmolVLA with the published architecture (:mod:`bench.vla_models`: SmolVLM2-500M's
config, 16 VLM layers, 0.75-width expert; ≈450M parameters, random weights, built here without a
download), for a robot with a 6-d state, 6-d actions and one 256x256 camera; chunk 50, K = 10 denoising
steps. LeRobot's ``lerobot.async_inference.policy_server`` and ours (``bench/serve.py --serve-ours``: the
folder's ``smolvla`` type serves it through the flow-policy contract, batched) run in their own processes
with the same torch thread count, both up for the whole run; the points alternate between them.

Each of 1, 4 and 16 **robots is its own process** (spawned; a robot never shares a GIL with another or
with a server). The robots have different observations and instructions (four task texts) and ask in a
closed loop, each with its own seeds: ours over one ``StreamAct`` stream per robot; LeRobot's with its own
protocol as ``bench/serve.py`` drives it (``SendObservations`` with ``must_go`` + ``GetActions`` until a
chunk comes back; ``inference_latency`` 0). A robot asks until ``--duration`` has passed, and its last
request may finish within ``--grace``; then it is stopped (an unanswered request counts nothing).
Reported per point: chunks/s over the point's window (start -> last answer, or the grace end if a robot
was still waiting), chunks/s that answered the robot's own observation, p50/p99 of a request
(observation sent -> chunk received), ours/LeRobot ratios.

On a 2-core CPU one chunk of this model takes seconds (the vision tower alone is ~0.18 TFLOP per 512 px
image): the points are few requests each, and the duration is what keeps the run to ~15-20 minutes.

    .venv/bin/python -m bench.serve_vla [--duration 60] [--grace 300] [--clients 1,4,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import pickle  # nosec: only to speak LeRobot's protocol to our own child process (bench/serve.py)
import re
import statistics
import tempfile
import time
from dataclasses import asdict
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import write_results
from bench.serve import compare_tables, lerobot_server, loadavg, our_server, pct, ratio_rows

SPEC = RobotSpec("so101", 6, 6, 30.0, "pick up the cube", cameras=(CameraSpec("front", 256, 256),))
INSTRUCTIONS = (
    "pick up the cube",
    "push the cube to the left",
    "open the drawer",
    "stack the red block on the blue block",
)
CHUNK = 50
MODEL_ID = "smolvla"
INFERENCE_LOG = re.compile(r"Preprocessing and inference took ([0-9.]+)s")


def robot_obs(k: int) -> dict[str, Any]:
    """Robot k's observation (its own image, state and instruction)."""
    rng = np.random.default_rng(k)
    return {
        "state": rng.normal(size=SPEC.state_dim).astype(np.float32),
        "cameras": {"front": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)},
        "instruction": INSTRUCTIONS[k % len(INSTRUCTIONS)],
    }


# ------------------------------------------------------------------------------------------------ robots
def _ours(address: str, k: int) -> Any:
    """Robot k on our server: one request -> its record."""
    from vla_rl_client.policy_client import PolicyClient

    o = robot_obs(k)
    stream = PolicyClient(address, timeout_s=3600, model_id=MODEL_ID).stream()

    def request(i: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = stream.act(o, seed=k * 1_000_000 + i, timeout_s=3600)
        return {
            "latency_ms": (time.perf_counter() - t0) * 1000,
            "batch": r.batch_size,
            "inference_ms": r.timing.inference_us / 1000,
        }

    return request


def _lerobot(address: str, k: int) -> Any:
    """Robot k on LeRobot's server, with its protocol (bench/serve.py's ``lerobot_client``)."""
    import grpc
    from lerobot.async_inference.helpers import TimedObservation
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.transport.utils import send_bytes_in_chunks

    o = robot_obs(k)
    raw = {f"j{i}.pos": float(v) for i, v in enumerate(o["state"])}
    raw |= {"front": o["cameras"]["front"], "task": o["instruction"]}
    stub = services_pb2_grpc.AsyncInferenceStub(grpc.insecure_channel(address))

    def request(i: int) -> dict[str, Any]:
        timestep = k * 1_000_000 + i
        t0 = time.perf_counter()
        payload = pickle.dumps(TimedObservation(time.time(), timestep, raw, must_go=True))
        empty = 0
        while True:
            stub.SendObservations(send_bytes_in_chunks(payload, services_pb2.Observation, silent=True))
            reply = stub.GetActions(services_pb2.Empty())
            if reply.data:
                break
            empty += 1  # another robot's observation replaced ours in its one-slot queue: send it again
        actions = pickle.loads(reply.data)  # nosec: our own child process, LeRobot's protocol
        return {
            "latency_ms": (time.perf_counter() - t0) * 1000,
            "own": actions[0].get_timestep() == timestep,
            "empty": empty,
        }

    return request


def robot_main(server: str, address: str, k: int, conn: connection.Connection) -> None:
    """A robot process: connect, say ready, get (start, stop) wall times, ask in a closed loop until stop,
        sending each answered request's record as it comes (the parent stops us at the grace end). At least
    one request is made (``stop`` = ``start``: one request each)."""
    request = (_ours if server == "ours" else _lerobot)(address, k)
    conn.send("ready")
    start, stop = conn.recv()
    time.sleep(max(0.0, start - time.time()))
    i = 0
    while True:  # at least one request, then until stop
        i += 1
        try:
            conn.send(request(i) | {"done_at": time.time()})
        except Exception as e:  # counted, not fatal
            conn.send({"error": f"{type(e).__name__}: {str(e)[:200]}"})
            time.sleep(0.05)
        if time.time() >= stop:
            break
    conn.send("done")


def run_point(server: str, address: str, n: int, duration: float, grace: float) -> dict[str, Any]:
    """``n`` robot processes against one server for ``duration`` s (+ ``grace`` for the last requests)."""
    ctx = get_context("spawn")
    pipes, procs = [], []
    for k in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=robot_main, args=(server, address, k, child), daemon=True)
        p.start()
        child.close()  # so that a robot that dies is an EOFError here, not a wait forever
        pipes.append(parent)
        procs.append(p)
    for k, c in enumerate(pipes):
        try:
            ready = c.recv()
        except EOFError:
            ready = None
        if ready != "ready":
            raise RuntimeError(
                f"robot {k} ({server}) died before it was ready (exit code {procs[k].exitcode})"
            )
    start = time.time() + 1.0
    stop, hard = start + duration, start + duration + grace
    for c in pipes:
        c.send((start, stop))
    load0 = loadavg()
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    waiting = set(pipes)
    while waiting and time.time() < hard:
        for c in connection.wait(list(waiting), timeout=max(0.0, hard - time.time())):
            try:
                msg = c.recv()
            except EOFError:  # the robot died: what it sent before counts
                waiting.discard(c)
                errors.append("a robot process died")
                continue
            if msg == "done":
                waiting.discard(c)
            elif "error" in msg:
                errors.append(msg["error"])
            else:
                records.append(msg)
    for p in procs:
        p.terminate()
        p.join(10)
    window = (hard if waiting else max((r["done_at"] for r in records), default=hard)) - start
    lat = [r["latency_ms"] for r in records]
    own = [r for r in records if r.get("own", True)]
    out = {
        "server": server,
        "clients": n,
        "seconds": round(window, 1),
        "chunks": len(records),
        "chunks_per_s": round(len(records) / window, 4),
        "own_chunks_per_s": round(len(own) / window, 4),
        "p50_ms": round(pct(lat, 50), 1),
        "p99_ms": round(pct(lat, 99), 1),
        "mean_batch": round(statistics.fmean(r.get("batch", 1) for r in records), 2) if records else None,
        "empty_replies": sum(r.get("empty", 0) for r in records),
        "unanswered": len(waiting),
        "errors": len(errors),
        "error_samples": errors[:3],
        "loadavg_start": load0,
        "loadavg_end": loadavg(),
    }
    inference = [r["inference_ms"] for r in records if "inference_ms" in r]
    if inference:
        out["inference_p50_ms"] = round(pct(inference, 50), 1)
    return out


def server_pid(address: str) -> int | None:
    """The process serving ``address`` (both servers are started with their port on the command line)."""
    port = address.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"--port={port}".encode() in args or (b"--port" in args and port.encode() in args):
            return int(proc.name)
    return None


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds ``pid`` has used (NaN when unknown): a server's work per chunk, which
    other jobs on a shared machine slow in wall time but not in CPU time."""
    if pid is None:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lerobot_inference_ms(workdir: Path) -> list[float]:
    """Every forward pass LeRobot's server has logged so far ("Preprocessing and inference took X s", its
    ``predict_action_chunk`` on one observation), in ms: its server-side time, beside our ``inference_ms``."""
    times = []
    for log in sorted((workdir / "logs").glob("*.log")):
        times += [float(m) * 1000 for m in INFERENCE_LOG.findall(log.read_text(errors="replace"))]
    return times


# ------------------------------------------------------------------------------------------------ setup
def build_policy(folder: Path) -> dict[str, Any]:
    """The published-size SmolVLA folder for :data:`SPEC` (reused when already there) and its sizes."""
    from bench.vla_models import SMOLVLA_VLM_LAYERS, SMOLVLM2_500M, parameter_count, save_published_smolvla

    if not (folder / "model.safetensors").is_file():
        save_published_smolvla(folder, SPEC, words=INSTRUCTIONS, chunk_size=CHUNK, n_action_steps=CHUNK)
    return {
        "parameters": parameter_count(folder),
        "vlm": {"text": asdict(SMOLVLM2_500M.text), "vision": asdict(SMOLVLM2_500M.vision)},
        "vlm_layers_used": SMOLVLA_VLM_LAYERS,
    }


def lerobot_setup(address: str, folder: Path) -> None:
    """What RobotClient.start() does once: Ready, then SendPolicyInstructions (loads the policy)."""
    import grpc
    from lerobot.async_inference.helpers import RemotePolicyConfig
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.utils.feature_utils import hw_to_dataset_features

    hw = {f"j{i}.pos": float for i in range(SPEC.state_dim)} | {"front": (256, 256, 3)}
    features = hw_to_dataset_features(hw, "observation", use_video=False)
    cfg = RemotePolicyConfig(MODEL_ID, str(folder), features, actions_per_chunk=CHUNK, device="cpu")
    with grpc.insecure_channel(address) as ch:
        stub = services_pb2_grpc.AsyncInferenceStub(ch)
        stub.Ready(services_pb2.Empty(), timeout=60)
        stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(cfg)), timeout=1200)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds the robots keep asking, per point")
    p.add_argument("--grace", type=float, default=300.0, help="seconds the last requests may take after that")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server process")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--folder", type=Path, default=None, help="where the policy is built (reused if there)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"  # the servers' children inherit it: nothing may download
    clients = [int(x) for x in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_serve_vla_") as tmp:
        work = Path(tmp)
        folder = args.folder or work / "smolvla"
        t0 = time.monotonic()
        print("building the published-size SmolVLA ...", flush=True)
        model = build_policy(folder)
        print(f"  {model['parameters'] / 1e6:.1f}M parameters ({time.monotonic() - t0:.0f} s)", flush=True)
        results: dict[str, Any] = {
            "conditions": {
                "duration_s": args.duration,
                "grace_s": args.grace,
                "server_torch_threads": args.threads,
                "cores": os.cpu_count(),
                "loadavg_at_start": loadavg(),
                "model": "LeRobot SmolVLA, published architecture (bench/vla_models.py), random weights; "
                f"6-d state, 6-d action, one 256x256 camera; chunk {CHUNK}, K = 10",
                **model,
                "robots": "one process each; four instructions; closed loop",
                "lerobot_server": "lerobot.async_inference.policy_server, inference_latency=0, "
                "obs_queue_timeout=2; SendObservations(must_go) + GetActions per request",
                "ours": "StreamAct per robot, max_batch 16, max_wait_us 2000, adaptive wait; served through "
                "the flow-policy contract",
            }
        }
        compare: list[dict[str, Any]] = []
        with (
            lerobot_server(args.threads, work) as le_addr,
            our_server({MODEL_ID: folder}, args.threads, adaptive=True) as addr,
        ):
            lerobot_setup(le_addr, folder)
            addresses = {"lerobot": le_addr, "ours": addr}
            pids = {name: server_pid(a) for name, a in addresses.items()}
            for name in addresses:  # one request each: one-time costs off the clock
                warm = run_point(name, addresses[name], 1, 0.0, args.grace)
                print(f"  warm-up {name}: {warm['p50_ms']} ms", flush=True)
            for i, n in enumerate(clients):
                for name in ["lerobot", "ours"] if i % 2 == 0 else ["ours", "lerobot"]:
                    before, cpu0 = len(lerobot_inference_ms(work)), cpu_seconds(pids[name])
                    r = run_point(name, addresses[name], n, args.duration, args.grace)
                    cpu = cpu_seconds(pids[name]) - cpu0
                    r["server_cpu_s"] = round(cpu, 1)
                    r["server_cpu_s_per_chunk"] = round(cpu / r["chunks"], 2) if r["chunks"] else None
                    if name == "lerobot":
                        r["inference_p50_ms"] = round(pct(lerobot_inference_ms(work)[before:], 50), 1)
                    compare.append(r)
                    print(
                        f"  {name:<8}{n:>3} robots: {r['chunks_per_s']} chunks/s ({r['own_chunks_per_s']} own), "
                        f"p50 {r['p50_ms']} ms, forward p50 {r.get('inference_p50_ms')} ms, {r['seconds']} s, "
                        f"{r['server_cpu_s_per_chunk']} server CPU s a chunk",
                        flush=True,
                    )
        ratios = ratio_rows(compare, clients)
        results.update(compare=compare, ratios=ratios)
        results["conditions"]["loadavg_at_end"] = loadavg()
        results["conditions"]["wall_s"] = round(time.monotonic() - t0, 1)
        print()
        print(compare_tables(compare, ratios))
    path = write_results("serve_vla", results, args.out)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

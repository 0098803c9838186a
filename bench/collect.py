"""Fleet collector throughput: many robots streaming two cameras each, next to LeRobot's recorder.

Runs, on this machine and in one go:

1. **rate run**: the collector (`vla-rl collect`, its own process) takes ``--robots`` synthetic robots
   (one process each, :func:`sim.synthetic_robot.synthetic_robot_main`) streaming ``--hz`` frames/s of two
   ``--size`` px cameras + state + action for ``--seconds``. Reports sustained frames/s and camera-frames/s,
   whether every frame produced is in the store (zero loss: store frame count = frames produced, store
   verified), ack latency p50/p99 (robot send -> durable ack), CPU of the collector and of the robots,
   and bytes on disk.
2. **capacity run** (``--capacity-seconds``, 0 = skip): the same robots unthrottled, each with a bounded
   buffer, so the collector's maximum sustained rate shows (robots block when it falls behind).
3. **LeRobot**: ``LeRobotDataset.create`` + ``add_frame`` + ``save_episode`` (lerobot-record's path, its
   default AV1 video and, separately, PNG images) fed the same frames as fast as it takes them.

Frames: ``--images rendered`` (default) renders a pool of ManiSkill StackCube frames from its two cameras
(base + hand) at ``--size`` px once and caches it; ``smooth`` uses synthetic gradient + box images. Each
frame gets its robot/episode/index stamped into a few pixels, so no two frames are identical.

    nice python bench/collect.py                          # 16 robots x 30 Hz x 2 x 224 px, 60 s
    python bench/collect.py --robots 4 --seconds 10 --capacity-seconds 0 --lerobot-frames 0   # quick look
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import LoadSampler, loadavg, machine, table, write_results
from sim.synthetic_robot import SyntheticRobotConfig, smooth_image_pool, synthetic_robot_main

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VLA_RL_CACHE", Path.home() / ".cache" / "vla-rl")) / "bench"
TOKEN = "bench-token"
CAMERAS = ("base_camera", "hand_camera")
POOL = 96


def frame_pool(kind: str, size: int) -> Path:
    """An .npz of {camera: uint8 [POOL, size, size, 3]} (rendered once and cached, or synthetic)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"frames_{kind}_{size}.npz"
    if path.exists():
        return path
    if kind == "smooth":
        pools = {c: smooth_image_pool(POOL, size, size, seed=k) for k, c in enumerate(CAMERAS)}
    else:
        import torch

        torch.set_num_threads(1)
        import sim

        print(f"rendering {POOL} ManiSkill StackCube frames at {size} px (cached in {path}) ...", flush=True)
        env = sim.make_env("maniskill/StackCube-v1", obs="rgb", image_size=size)
        expert = sim.make_expert("maniskill/StackCube-v1", noise=0.3, seed=0)
        obs, info = env.reset(seed=0)
        frames: dict[str, list[np.ndarray]] = {c: [] for c in CAMERAS}
        for i in range(POOL):
            for c in CAMERAS:
                frames[c].append(obs["cameras"][c])
            obs, _, term, trunc, info = env.step(expert.act(info["privileged"]))
            if term or trunc:
                obs, info = env.reset(seed=i + 1)
                expert.reset(i + 1)
        env.close()
        pools = {c: np.stack(v) for c, v in frames.items()}
    np.savez(path, **pools)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def thread_cpu(procs: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds by thread (process role, OS thread name, thread id)."""
    out: dict[str, float] = {}
    for p in procs:
        try:
            threads = p.threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                name = Path(f"/proc/{p.pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                continue
            # Python threads are all "python" to the OS; the id tells them apart between samples
            key = f"{'writer' if p.ppid() != os.getpid() else 'intake'}:{name}:{t.id}"
            out[key] = out.get(key, 0.0) + t.user_time + t.system_time
    return out


def run_queue_wait(procs: list[psutil.Process]) -> tuple[float, float]:
    """Seconds the processes' threads ran, and waited runnable for a CPU (``/proc/*/task/*/schedstat``)."""
    run = wait = 0.0
    for p in procs:
        for task in Path(f"/proc/{p.pid}/task").glob("*"):
            try:
                r, w, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            run, wait = run + int(r) / 1e9, wait + int(w) / 1e9
    return run, wait


WARMUP_S = 2.0


def run_collector_phase(
    name: str,
    work: Path,
    images: Path,
    spec: RobotSpec,
    robots: int,
    hz: float,
    seconds: float,
    frames_per_episode: int,
    buffer_bytes: int,
    zstd_level: int,
    batch_frames: int,
    batch_interval_s: float,
    store_writers: int = 1,
    store_writer_nice: int = 10,
    lockstep: bool = False,
    camera_codec: str = "lossless",
) -> dict[str, Any]:
    store = work / f"store-{name}"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log_path = work / f"collector-{name}.log"
    cmd = [sys.executable, "-m", "vla_rl.cli", "--log-format", "json", "--log-level", "warning", "collect"]
    cmd += ["--store", str(store), "--port", str(port), "--token", TOKEN]
    cmd += ["--camera-zstd-level", str(zstd_level), "--max-batch-frames", "64"]
    cmd += ["--camera-codec", camera_codec]
    cmd += ["--store-writers", str(store_writers), "--store-writer-nice", str(store_writer_nice)]
    with open(log_path, "ab") as log_f:
        coll = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_f, env=env)
    assert coll.stdout is not None
    line = coll.stdout.readline().decode()
    if "collector listening" not in line:
        raise RuntimeError(f"collector did not start: {line} {log_path.read_text()[-2000:]}")
    cproc = psutil.Process(coll.pid)
    ctx = mp.get_context("spawn")
    start_at = time.time() + 4.0 + 0.5 * robots  # after every robot process has imported and connected
    episodes = math.ceil(seconds * max(hz, 1) / frames_per_episode) + 1 + (1000 if hz <= 0 else 0)
    procs = []
    for i in range(robots):
        cfg = SyntheticRobotConfig(
            robot_id=f"bench-{i}",
            collector=f"127.0.0.1:{port}",
            spec=spec.to_dict(),
            token=TOKEN,
            episodes=episodes,
            frames_per_episode=frames_per_episode,
            # Real fleets do not end episodes in lockstep; --lockstep keeps the worst case measurable.
            first_episode_frames=None if lockstep else frames_per_episode - i * frames_per_episode // robots,
            hz=hz,
            seed=i,
            images=str(images),
            result_path=str(work / f"{name}-robot-{i}.json"),
            max_batch_frames=batch_frames if hz > 0 else 16,
            batch_interval_s=batch_interval_s,
            duration_s=seconds,
            max_buffer_bytes=buffer_bytes,
            start_at=start_at,
            close_timeout_s=300.0,
        )
        p = ctx.Process(target=synthetic_robot_main, args=(cfg,), daemon=True)
        p.start()
        procs.append(p)
    time.sleep(max(0.0, start_at - time.time()))
    writers0 = cproc.children(recursive=True)  # the store writer process(es)
    c0, w0, t0 = cpu_seconds([cproc]), cpu_seconds(writers0), time.perf_counter()
    th0 = thread_cpu([cproc, *writers0])
    rq0 = run_queue_wait([cproc])
    psutil.cpu_percent(None)
    load0 = loadavg()
    for p in procs:
        p.join(seconds + 600)
    t1 = time.perf_counter()
    load1 = loadavg()
    writers1 = cproc.children(recursive=True)
    c1, w1 = cpu_seconds([cproc]), cpu_seconds(writers0)
    th1 = thread_cpu([cproc, *writers0])
    rq1 = run_queue_wait([cproc])
    writers_restarted = {p.pid for p in writers1} != {p.pid for p in writers0}
    machine_cpu = psutil.cpu_percent(None)
    coll.send_signal(signal.SIGTERM)
    coll.wait(120)
    results = [json.loads((work / f"{name}-robot-{i}.json").read_text()) for i in range(robots)]
    lat = np.concatenate([np.array(r["ack_latency_s"]) for r in results]) * 1000
    # steady state: acks after the first WARMUP_S seconds, when 16 robots connecting and opening their
    # first episodes at the same instant are behind us
    warm = (
        np.concatenate(
            [np.array(r["ack_latency_s"])[np.array(r["ack_at_s"]) >= start_at + WARMUP_S] for r in results]
        )
        * 1000
    )
    age = np.concatenate([np.array(r["frame_age_at_ack_s"]) for r in results]) * 1000
    produced = sum(r["frames"] for r in results)
    stream_s = max(r["seconds"] for r in results)
    close_s = max(r["close_seconds"] for r in results)
    acked_s = max(r["seconds"] + r["close_seconds"] for r in results)  # start -> every frame acknowledged
    from fleet.db import MetadataDB
    from fleet.store import EpisodeStore

    s = EpisodeStore(store)
    stored = sum(s.read_metadata(e).length for e in s.episode_ids())
    problems = s.verify(db=MetadataDB.for_store(store))
    wal_left = du(store / "wal")
    size = du(store)
    raw = produced * (
        2 * spec.cameras[0].height * spec.cameras[0].width * 3 + 4 * (spec.state_dim + 2 * spec.action_dim)
    )
    wall = t1 - t0
    out = {
        "phase": name,
        "robots": robots,
        "episode_boundaries": "in lockstep" if lockstep else "staggered",
        "hz_per_robot": hz,
        "batch": f"<= {batch_frames} frames or {batch_interval_s * 1000:g} ms",
        "seconds_streaming": round(stream_s, 2),
        "frames_produced": produced,
        "frames_in_store": stored,
        "lost": produced - stored,
        "all_acked": all(r["all_acked"] for r in results),
        "store_problems": problems[:5],
        "produced_frames_per_s": round(produced / stream_s, 1),
        # what the collector sustained: every frame produced, acknowledged as durable, over start -> last ack
        "frames_per_s": round(produced / acked_s, 1),
        "camera_frames_per_s": round(2 * produced / acked_s, 1),
        "seconds_to_all_acked": round(acked_s, 2),
        "offered_camera_frames_per_s": 2 * robots * hz if hz > 0 else None,
        "ack_ms_p50": round(float(np.percentile(lat, 50)), 2),
        "ack_ms_p99": round(float(np.percentile(lat, 99)), 2),
        "ack_ms_max": round(float(lat.max()), 2),
        "ack_ms_p50_after_warmup": round(float(np.percentile(warm, 50)), 2) if len(warm) else None,
        "ack_ms_p99_after_warmup": round(float(np.percentile(warm, 99)), 2) if len(warm) else None,
        "warmup_s": WARMUP_S,
        "frame_age_at_ack_ms_p50": round(float(np.percentile(age, 50)), 2),
        "frame_age_at_ack_ms_p99": round(float(np.percentile(age, 99)), 2),
        "ack_samples": len(lat),
        "drain_after_stop_s": round(close_s, 2),
        "store_writers": store_writers,
        "store_writer_nice": store_writer_nice,
        "store_writers_restarted": writers_restarted,
        # collector = the intake process (gRPC, validation, log append, acks) + its store writer process(es)
        "collector_cpu_cores": round((c1 - c0 + w1 - w0) / wall, 2),
        "collector_intake_cpu_cores": round((c1 - c0) / wall, 2),
        "store_writer_cpu_cores": round((w1 - w0) / wall, 2),
        "collector_cpu_ms_per_frame": round((c1 - c0 + w1 - w0) / produced * 1000, 3),
        "collector_intake_cpu_ms_per_frame": round((c1 - c0) / produced * 1000, 3),
        "store_writer_cpu_ms_per_frame": round((w1 - w0) / produced * 1000, 3),
        "robots_cpu_ms_per_frame": round(sum(r["cpu_seconds"] for r in results) / produced * 1000, 3),
        "robots_cpu_cores": round(sum(r["cpu_seconds"] for r in results) / wall, 2),
        # where the collector's CPU goes, by thread (cores over the run; threads over 0.01 cores)
        "collector_thread_cores": {
            k: round((v - th0.get(k, 0.0)) / wall, 3)
            for k, v in sorted(th1.items(), key=lambda kv: -(kv[1] - th0.get(kv[0], 0.0)))
            if (v - th0.get(k, 0.0)) / wall >= 0.01
        },
        # the intake process's threads: for each second they ran, how long they were runnable but waited
        # for a CPU (other processes had it): > 0.3 or so means acks wait on the scheduler, not on work
        "intake_run_queue_wait_per_run_s": round((rq1[1] - rq0[1]) / max(rq1[0] - rq0[0], 1e-9), 2),
        "machine_cpu_percent": machine_cpu,
        "load_avg_1m_before": load0[0],
        "load_avg_before": load0,
        "load_avg_after": load1,
        "camera_codec": camera_codec,
        "bytes_on_disk": size,
        "bytes_raw": raw,
        "disk_over_raw": round(size / raw, 3),
        "wal_bytes_left": wal_left,
        "reconnects": sum(r["reconnects"] for r in results),
        "rejects": sum(r["rejects"] for r in results),
    }
    # What carries over from a loaded machine: CPU per frame. Collector + co-located robots, on 2 cores:
    per_frame = out["collector_cpu_ms_per_frame"] + out["robots_cpu_ms_per_frame"]
    out["camera_frames_per_s_2_cores_from_cpu"] = round(2 * 2 * 1000 / per_frame)
    out["camera_frames_per_s_2_cores_collector_only"] = round(
        2 * 2 * 1000 / out["collector_cpu_ms_per_frame"]
    )
    shutil.rmtree(store, ignore_errors=True)
    return out


def run_lerobot(
    work: Path, images: Path, spec: RobotSpec, frames: int, per_episode: int, videos: bool
) -> dict[str, Any]:
    os.environ.setdefault("HF_HOME", str(work / "hf"))
    import torch

    torch.set_num_threads(1)
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    data = np.load(images)
    pools = {c: np.asarray(data[c]) for c in CAMERAS}
    size = spec.cameras[0].height
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": (spec.state_dim,), "names": None},
        "action": {"dtype": "float32", "shape": (spec.action_dim,), "names": None},
    }
    for c in CAMERAS:
        features[f"observation.images.{c}"] = {
            "dtype": "video" if videos else "image",
            "shape": (size, size, 3),
            "names": ["height", "width", "channels"],
        }
    root = work / f"lerobot-{'video' if videos else 'images'}"
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    c0 = cpu_seconds([psutil.Process()])
    # lerobot-record's defaults: 4 image-writer threads per camera, no writer processes.
    ds = LeRobotDataset.create(
        "bench/collect",
        fps=30,
        features=features,
        root=root,
        use_videos=videos,
        image_writer_threads=4 * len(CAMERAS),
    )
    for i in range(frames):
        frame: dict[str, Any] = {
            "observation.state": rng.standard_normal(spec.state_dim).astype(np.float32),
            "action": rng.uniform(-1, 1, spec.action_dim).astype(np.float32),
            "task": "bench",
        }
        for c in CAMERAS:
            img = pools[c][i % len(pools[c])].copy()
            img[0, :4, 0] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)
            frame[f"observation.images.{c}"] = img
        ds.add_frame(frame)
        if (i + 1) % per_episode == 0 or i == frames - 1:
            ds.save_episode()
    ds.finalize()
    wall = time.perf_counter() - t0
    cpu = cpu_seconds([psutil.Process()]) - c0
    out = {
        "phase": f"lerobot-{'video' if videos else 'images'}",
        "frames": frames,
        "seconds": round(wall, 2),
        "frames_per_s": round(frames / wall, 1),
        "camera_frames_per_s": round(2 * frames / wall, 1),
        "cpu_cores": round(cpu / wall, 2),
        "cpu_ms_per_frame": round(cpu / frames * 1000, 3),
        "bytes_on_disk": du(root),
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--robots", type=int, default=16)
    ap.add_argument("--hz", type=float, default=30.0)
    ap.add_argument("--seconds", type=float, default=60.0, help="rate-run length")
    ap.add_argument("--size", type=int, default=224, help="camera height = width")
    ap.add_argument("--images", choices=["rendered", "smooth"], default="rendered")
    ap.add_argument("--frames-per-episode", type=int, default=300)
    ap.add_argument("--capacity-seconds", type=float, default=20.0, help="unthrottled run length (0 = skip)")
    ap.add_argument(
        "--lockstep-seconds",
        type=float,
        default=30.0,
        help="also run the worst case where all robots start and end episodes together (0 = skip); the "
        "rate run staggers each robot's first episode so boundaries spread out, as in a real fleet",
    )
    ap.add_argument("--lerobot-frames", type=int, default=600, help="frames per LeRobot mode (0 = skip)")
    ap.add_argument("--camera-zstd-level", type=int, default=-3)
    ap.add_argument(
        "--camera-codec", default="lossless", help="the collector's --camera-codec (lossless, jpeg:90, ...)"
    )
    ap.add_argument("--batch-frames", type=int, default=8, help="robot client max_batch_frames")
    ap.add_argument("--batch-ms", type=float, default=100.0, help="robot client batch_interval_s, in ms")
    ap.add_argument(
        "--store-writers",
        type=int,
        default=1,
        help="collector --store-writers (0 = in the collector's process)",
    )
    ap.add_argument(
        "--store-writer-nice", type=int, default=10, help="collector --store-writer-nice (0 = same priority)"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="vla-rl-bench-collect-"))
    work.mkdir(parents=True, exist_ok=True)
    images = frame_pool(args.images, args.size)
    spec = RobotSpec(
        "bench",
        state_dim=25,
        action_dim=4,
        control_hz=args.hz,
        instruction="bench",
        cameras=tuple(CameraSpec(c, args.size, args.size) for c in CAMERAS),
    )
    phases: list[dict[str, Any]] = []
    print(
        f"rate run: {args.robots} robots x {args.hz:g} Hz x 2 cameras x {args.size} px for {args.seconds:g} s",
        flush=True,
    )

    def phase(name: str, hz: float, seconds: float, buffer_bytes: int, lockstep: bool = False) -> None:
        phases.append(
            run_collector_phase(
                name,
                work,
                images,
                spec,
                args.robots,
                hz,
                seconds,
                args.frames_per_episode,
                buffer_bytes,
                args.camera_zstd_level,
                args.batch_frames,
                args.batch_ms / 1000,
                args.store_writers,
                args.store_writer_nice,
                lockstep=lockstep,
                camera_codec=args.camera_codec,
            )
        )
        print(json.dumps(phases[-1]), flush=True)

    with LoadSampler() as load:
        phase("rate", args.hz, args.seconds, 1 << 30)
        if args.lockstep_seconds > 0:
            print(
                f"lockstep run: every robot's episodes start and end together, {args.lockstep_seconds:g} s",
                flush=True,
            )
            phase("rate-lockstep", args.hz, args.lockstep_seconds, 1 << 30, lockstep=True)
        if args.capacity_seconds > 0:
            print(
                f"capacity run: {args.robots} robots unthrottled for {args.capacity_seconds:g} s", flush=True
            )
            phase("capacity", 0.0, args.capacity_seconds, 64 << 20)
        lerobot: list[dict[str, Any]] = []
        if args.lerobot_frames > 0:
            for videos in (True, False):
                print(f"LeRobot {'video' if videos else 'images'}: {args.lerobot_frames} frames", flush=True)
                lerobot.append(
                    run_lerobot(work, images, spec, args.lerobot_frames, args.frames_per_episode, videos)
                )
                print(json.dumps(lerobot[-1]), flush=True)

    rows = []
    for p in phases:
        rows.append(
            [
                f"collector ({p['camera_codec']}), {p['robots']} robots"
                + (f" x {p['hz_per_robot']:g} Hz" if p["hz_per_robot"] else ", unthrottled")
                + (", episodes in lockstep" if p.get("episode_boundaries") == "in lockstep" else ""),
                f"{p['camera_frames_per_s']:.0f}",
                f"{p['frames_in_store']}/{p['frames_produced']}",
                f"{p['ack_ms_p50']:.1f} / {p['ack_ms_p99']:.1f}",
                f"{p['ack_ms_p99_after_warmup']:.1f}"
                if p.get("ack_ms_p99_after_warmup") is not None
                else "-",
                f"{p['frame_age_at_ack_ms_p50']:.0f} / {p['frame_age_at_ack_ms_p99']:.0f}",
                f"{p['collector_cpu_ms_per_frame']:.2f} ({p['robots_cpu_ms_per_frame']:.2f})",
                f"{p['bytes_on_disk'] / 2**20:.0f} MB ({p['disk_over_raw']:.2f} of raw)",
            ]
        )
    for r in lerobot:
        rows.append(
            [
                f"LeRobot add_frame+save_episode, {r['phase'].split('-')[1]}",
                f"{r['camera_frames_per_s']:.0f}",
                f"{r['frames']}/{r['frames']}",
                "-",
                "-",
                "-",
                f"{r['cpu_ms_per_frame']:.2f}",
                f"{r['bytes_on_disk'] / 2**20:.0f} MB",
            ]
        )
    header = [
        "run",
        "camera-frames/s",
        "stored/produced",
        "ack ms p50 / p99",
        f"ack ms p99 after {WARMUP_S:g} s",
        "frame age at ack ms p50 / p99",
        "CPU ms/frame: recorder (robots)",
        "on disk",
    ]
    print()
    print(table(rows, header))
    best = max(p["camera_frames_per_s"] for p in phases)
    ratios = {r["phase"]: round(best / r["camera_frames_per_s"], 1) for r in lerobot}
    for name, ratio in ratios.items():
        print(f"collector / {name}: {ratio}x camera-frames/s")
    for p in phases:
        print(
            f"{p['phase']}: load average {p['load_avg_before']} before, {p['load_avg_after']} after; "
            f"from CPU per frame, 2 idle cores would take {p['camera_frames_per_s_2_cores_from_cpu']} "
            f"camera-frames/s with the robots on them, {p['camera_frames_per_s_2_cores_collector_only']} without"
        )
    m = machine()
    path = write_results(
        "collect",
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "images": args.images,
            "collector": phases,
            "lerobot": lerobot,
            "ratios": ratios,
            "load": load.summary(),
        },
        args.out,
    )
    print(f"\n{m['cpu']}, {m['cores']} cores; results: {path}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

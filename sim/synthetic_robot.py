"""A robot without a simulator (:func:`synthetic_robot_main`) that streams deterministic frames (smooth
synthetic images or a pool of rendered ones) at a fixed rate to a collector, with a takeover in every
episode. Fault tests and ``bench/collect.py`` run many of them, as real processes, to load the collector;
each can write what it did (:mod:`sim.fleet_records`)."""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.fleet_records import RobotRecord


def smooth_image_pool(n: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [n, H, W, 3] camera-like frames: a lit gradient background and moving flat-shaded boxes.

    No sensor noise, so they compress like rendered simulator frames rather than like random bytes.
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:height, :width].astype(np.float32)
    base = np.stack([x / width * 120 + 60, y / height * 90 + 80, (x + y) / (width + height) * 60 + 100], -1)
    out = np.empty((n, height, width, 3), np.uint8)
    boxes = rng.uniform(0.1, 0.7, (4, 2)) * (height, width)
    vel = rng.normal(0, 1.5, (4, 2))
    colors = rng.integers(30, 255, (4, 3))
    for i in range(n):
        img = base.copy()
        for b in range(4):
            cy, cx = (boxes[b] + vel[b] * i) % (height * 0.8, width * 0.8)
            img[int(cy) : int(cy) + height // 6, int(cx) : int(cx) + width // 6] = colors[b]
        out[i] = img.astype(np.uint8)
    return out


@dataclass
class SyntheticRobotConfig:
    robot_id: str
    collector: str
    spec: dict[str, Any]  # RobotSpec.to_dict()
    task: str = "synthetic/replay"
    token: str | None = None
    episodes: int = 2
    frames_per_episode: int = 60
    first_episode_frames: int | None = (
        None  # a shorter first episode puts this robot's boundaries out of step
    )
    hz: float = 0.0  # frames per second (0 = as fast as possible)
    seed: int = 0
    images: str | None = None  # .npz of {camera name: uint8 [P, H, W, 3]} pools; None = smooth synthetic
    record_path: str | None = None
    result_path: str | None = None
    max_batch_frames: int = 8
    batch_interval_s: float = 0.05
    takeover: bool = True  # an intervention segment in the middle of every episode
    close_timeout_s: float = 120.0
    duration_s: float | None = None  # stop after this long (the last episode ends early, "timeout")
    max_buffer_bytes: int = 1024 * 1024 * 1024
    start_at: float | None = None  # unix time to start streaming (lines robots up after their imports)
    start_file: str | None = None  # or: start once this file exists (a test's starting gun)
    hard_exit: bool = True  # os._exit once results are written (see the end of synthetic_robot_main)


def synthetic_robot_main(cfg: SyntheticRobotConfig) -> None:
    """Process entry point: stream ``episodes`` episodes of deterministic frames, record them, report."""
    from vla_rl_client.frame import Frame
    from vla_rl_client.meta import new_episode_id
    from vla_rl_client.robot_client import RobotClient
    from vla_rl_client.spec import RobotSpec
    from vla_rl_client.wire import keep_freed_memory

    keep_freed_memory()
    spec = RobotSpec.from_dict(cfg.spec)
    rng = np.random.default_rng(cfg.seed)
    if cfg.images:
        data = np.load(cfg.images)
        pools = {c.name: np.asarray(data[c.name]) for c in spec.cameras}
    else:
        pools = {
            c.name: smooth_image_pool(32, c.height, c.width, cfg.seed * 7 + k)
            for k, c in enumerate(spec.cameras)
        }
    tag = zlib.crc32(cfg.robot_id.encode())
    cams = {name: np.empty_like(pool[0]) for name, pool in pools.items()}
    record = RobotRecord(cfg.record_path)
    client = RobotClient(
        cfg.collector,
        cfg.robot_id,
        spec,
        cfg.task,
        token=cfg.token,
        max_batch_frames=cfg.max_batch_frames,
        batch_interval_s=cfg.batch_interval_s,
        max_buffer_bytes=cfg.max_buffer_bytes,
        block_s=600.0,
    )
    if cfg.start_at is not None:
        time.sleep(max(0.0, cfg.start_at - time.time()))
    while cfg.start_file and not os.path.exists(cfg.start_file):
        time.sleep(0.01)
    cpu0 = time.process_time()
    period = 1.0 / cfg.hz if cfg.hz > 0 else 0.0
    t_start = time.perf_counter()
    stop_at = t_start + cfg.duration_s if cfg.duration_s else float("inf")
    next_t = time.perf_counter()
    last_ts = 0.0
    frames = 0
    for e in range(cfg.episodes):
        if time.perf_counter() >= stop_at:
            break
        eid = new_episode_id(cfg.robot_id)
        client.start_episode(eid, kind="autonomous", controller="policy", reason="policy")
        n = cfg.first_episode_frames if e == 0 and cfg.first_episode_frames else cfg.frames_per_episode
        a, b = (n // 3, n // 2) if cfg.takeover else (n, n)
        segments = [{"start": 0, "kind": "autonomous", "controller": 0}]
        seg = 0
        length = n
        for i in range(n):
            if time.perf_counter() >= stop_at:
                length = i
                break
            if cfg.takeover and i == a:
                client.begin_segment("intervention", "human", reason="synthetic takeover")
                segments.append({"start": i, "kind": "intervention", "controller": 1})
                seg += 1
            if cfg.takeover and i == b:
                client.begin_segment("autonomous", "policy", reason="handback")
                segments.append({"start": i, "kind": "autonomous", "controller": 0})
                seg += 1
            ctrl = segments[-1]["controller"]
            for name, pool in pools.items():
                img = cams[name]  # reused: add_frame copies what it keeps
                np.copyto(img, pool[(frames + i) % len(pool)])
                img[0, :12, 0] = np.frombuffer(np.array([tag, e, i], np.uint32).tobytes(), np.uint8)
            state = rng.standard_normal(spec.state_dim).astype(np.float32)
            action = rng.uniform(-1, 1, spec.action_dim).astype(np.float32)
            proposed = action if ctrl == 0 else np.full(spec.action_dim, np.nan, np.float32)
            reward = float(i == n - 1)
            ts = max(time.time(), last_ts)
            last_ts = ts
            frame = Frame(cams, state, action, proposed, reward, i == n - 1, False, ctrl, "synthetic-rev", ts)
            client.add(frame)
            if cfg.record_path:
                record.frame(eid, i, frame.digest(), ctrl, seg)
            if period:
                next_t += period
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        outcome = "success" if length == n else "timeout"
        client.end_episode(outcome, length == n)
        record.episode(eid, length, segments, outcome)
        frames += length
    elapsed = time.perf_counter() - t_start
    t_close = time.perf_counter()
    ok = client.close(cfg.close_timeout_s)
    close_s = time.perf_counter() - t_close
    cpu_s = time.process_time() - cpu0
    record.close()
    if cfg.result_path:
        lat = np.array(client.stats.ack_latency_s, np.float64)
        st = client.stats
        Path(cfg.result_path).write_text(
            json.dumps(
                {
                    "robot_id": cfg.robot_id,
                    "frames": frames,
                    "seconds": elapsed,
                    "close_seconds": close_s,
                    "cpu_seconds": cpu_s,
                    "all_acked": ok,
                    "frames_acked": st.frames_acked,
                    "reconnects": st.reconnects,
                    "messages_resent": st.messages_resent,
                    "rejects": st.rejects,
                    "errors": client.errors,
                    "ack_latency_s": lat.tolist(),
                    "ack_at_s": list(client.stats.ack_at_s),
                    "frame_age_at_ack_s": list(client.stats.frame_age_at_ack_s),
                }
            )
        )
    if cfg.hard_exit:
        # Everything is recorded and flushed. Under heavy load a process that used grpc threads was once
        # seen to hang in interpreter teardown for minutes after close() returned (results written, all
        # frames acked). close() now ends every stream, closes the channel and joins its threads
        # (tests/test_collector.py checks a robot process exits promptly without this); harnesses keep
        # this guard so that they measure the data path, never teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

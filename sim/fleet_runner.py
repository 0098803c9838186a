"""Simulated fleets that stream everything to a collector.

* :func:`run_sim_fleet` (``vla-rl fleet sim``): N simulated robots, one process each, acting through the
  policy server (receding horizon over a ``StreamAct`` stream), watched by a shared
  :class:`~sim.operator.SimulatedOperator` that takes over when the policy stalls or drifts (or, with
  the alarm on, when the CUSUM of the uncertainty the server returns with every chunk fires), and
  streaming every frame, segment and outcome to the collector through :class:`~vla_rl_client.robot_client.RobotClient`.
  Episode outcomes and intervention rates are reported live, per robot.
* :func:`synthetic_robot_main`: a robot without a simulator that streams deterministic frames (smooth
  synthetic images or a pool of rendered ones) at a fixed rate, with a takeover in every episode. Fault
  tests and ``bench/collect.py`` run many of them, as real processes, to load the collector.

Both can write what they did, frame by frame (episode, seq, content hash, controller, segment), to a
JSON-lines file, so a test can check the store against the robots' own record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import time
import zlib
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import tyro

from sim.operator import Event, OperatorDesk, OperatorRules, SimulatedOperator
from vla_rl.core import console
from vla_rl.core.configs import SECRET
from vla_rl.core.lifeline import exit_with_parent
from vla_rl.core.scheduling import leave_realtime
from vla_rl.core.seeds import ONLINE

log = logging.getLogger("vla_rl.fleet")


# ------------------------------------------------------------------------------------------ records
class _Record:
    """What a robot did, one JSON line per frame and per episode (None path = record nothing)."""

    def __init__(self, path: str | None, flush_frames: bool = False) -> None:
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - lives as long as the robot
        self._flush_frames = flush_frames

    def frame(self, episode: str, seq: int, digest: str, controller: int, segment: int) -> None:
        if self._f:
            self._f.write(
                json.dumps(
                    {
                        "episode": episode,
                        "seq": seq,
                        "digest": digest,
                        "controller": controller,
                        "segment": segment,
                    }
                )
                + "\n"
            )
            if self._flush_frames:  # a robot that can be killed mid-episode leaves what it did so far
                self._f.flush()

    def episode(self, episode: str, length: int, segments: list[dict[str, Any]], outcome: str) -> None:
        if self._f:
            self._f.write(
                json.dumps({"episode": episode, "length": length, "segments": segments, "outcome": outcome})
                + "\n"
            )
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def read_records(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Frame records and episode records (by id) from robots' JSON-lines files."""
    frames: list[dict[str, Any]] = []
    episodes: dict[str, dict[str, Any]] = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            rec = json.loads(line)
            if "seq" in rec:
                frames.append(rec)
            else:
                episodes[rec["episode"]] = rec
    return frames, episodes


# ------------------------------------------------------------------------------------------ synthetic robots
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
    record = _Record(cfg.record_path)
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


# ------------------------------------------------------------------------------------------ sim robots
@dataclass
class SimRobotConfig:
    robot_id: str
    index: int
    task: str
    server: str
    collector: str
    episodes: int
    seed: int
    rules: dict[str, Any]
    obs: str = "state"
    image_size: int = 128
    max_episode_steps: int | None = None
    token: str | None = None  # collector token
    model_id: str = ""
    record_path: str | None = None
    torch_free: bool = True
    first_episode: int = 0  # a replaced robot (Ray) starts again at the episode it was in


@dataclass
class EpisodeReport:
    robot_id: str
    episode_id: str
    index: int
    success: bool
    outcome: str
    steps: int
    human_steps: int
    takeovers: int
    reasons: list[str]
    seconds: float
    busy_waits: int = 0
    segments: list[dict[str, Any]] = field(default_factory=list)


def _switch(client: Any, segments: list[dict[str, Any]], ev: Event, t: int) -> None:
    """A change of control at step ``t``: a new segment in the stream and in the robot's record."""
    kind, ctrl = ("intervention", 1) if ev.kind == "takeover" else ("autonomous", 0)
    client.begin_segment(kind, ctrl, reason=ev.reason)
    segments.append({"start": t, "kind": kind, "controller": ctrl, "reason": ev.reason})


def sim_robot_main(cfg: SimRobotConfig, desk: OperatorDesk | None, reports: Any) -> None:
    """Process entry point: run episodes through the policy server, stream them, report each episode."""
    leave_realtime(f"sim robot {cfg.robot_id}")
    # a fleet killed without stopping its robots (SIGKILL, `vla-rl up` gone) must not leave them driving
    exit_with_parent(where=f"sim robot {cfg.robot_id}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        _sim_robot(cfg, desk, reports)
    except Exception as e:  # the parent must hear about it rather than wait forever
        log.exception("sim robot failed", extra={"robot": cfg.robot_id})
        reports.put(("error", cfg.robot_id, f"{type(e).__name__}: {e}"))
    finally:
        reports.put(("done", cfg.robot_id, None))


def _sim_robot(cfg: SimRobotConfig, desk: OperatorDesk | None, reports: Any) -> None:
    from vla_rl_client.frame import Frame
    from vla_rl_client.meta import new_episode_id
    from vla_rl_client.policy_client import PolicyClient
    from vla_rl_client.robot_client import RobotClient

    from sim.registry import make_env

    rules = OperatorRules(**cfg.rules)
    env = make_env(cfg.task, obs=cfg.obs, image_size=cfg.image_size, max_episode_steps=cfg.max_episode_steps)  # type: ignore[arg-type]
    operator = SimulatedOperator(env.task, rules, desk)
    policy = PolicyClient(cfg.server, timeout_s=30.0, model_id=cfg.model_id)
    stream = policy.stream()
    client = RobotClient(cfg.collector, cfg.robot_id, env.spec, env.task, token=cfg.token)
    # Frames only: the fleet's driver writes the episode lines from the reports (see run_sim_fleet).
    record = _Record(cfg.record_path, flush_frames=True)
    last_ts = 0.0
    try:
        for e in range(cfg.first_episode, cfg.episodes):
            t0 = time.perf_counter()
            seed = cfg.seed + cfg.index * 100_000 + e
            obs, info = env.reset(seed=seed)
            operator.reset(seed, env.max_episode_steps)
            eid = new_episode_id(cfg.robot_id)
            client.start_episode(
                eid, instruction=obs["instruction"], kind="autonomous", controller="policy", reason="policy"
            )
            segments = [{"start": 0, "kind": "autonomous", "controller": 0}]
            chunk: np.ndarray | None = None
            k, n_exec, commit, score = 0, 1, "", float("nan")
            t = 0
            terminated = truncated = False
            while not (terminated or truncated):
                ev = operator.observe(t, info["privileged"], float(info["dense_reward"]))
                if ev is not None:
                    _switch(client, segments, ev, t)
                    chunk = None
                if not operator.driving and (chunk is None or k >= n_exec):
                    res = stream.act(
                        {"state": obs["state"], "cameras": obs["cameras"], "instruction": obs["instruction"]},
                        seed=seed * 1000 + t,
                    )
                    chunk, k, n_exec, commit = res.actions, 0, max(1, res.n_exec), res.commit
                    score = res.uncertainty  # stored with every frame acted from this chunk (NaN: none)
                    ev = operator.observe_chunk(t, res.uncertainty)  # the uncertainty alarm, if on
                    if ev is not None:  # the robot asks for help instead of executing this chunk
                        _switch(client, segments, ev, t)
                        chunk = None
                if operator.driving:
                    action = operator.act(info["privileged"])
                    proposed = np.full(env.spec.action_dim, np.nan, np.float32)
                    ctrl, revision, unc = 1, "", float("nan")
                else:
                    assert chunk is not None
                    proposed = np.asarray(chunk[k], np.float32)
                    k += 1
                    action = np.clip(proposed, -1.0, 1.0).astype(np.float32)
                    ctrl, revision, unc = 0, commit, score
                next_obs, reward, terminated, truncated, next_info = env.step(action)
                ts = max(time.time(), last_ts)
                last_ts = ts
                frame = Frame(
                    cameras=obs["cameras"],
                    state=obs["state"],
                    action=action,
                    proposed_action=proposed,
                    reward=reward,
                    terminated=terminated,
                    truncated=truncated,
                    controller=ctrl,
                    revision=revision,
                    timestamp=ts,
                    uncertainty=unc,
                )
                client.add(frame)
                record.frame(eid, t, frame.digest(), ctrl, len(segments) - 1)
                obs, info = next_obs, next_info
                t += 1
            success = bool(info["success"])
            outcome = "success" if success else ("timeout" if truncated else "failure")
            operator.end_episode()
            client.end_episode(outcome, success)
            # Done means stored: an episode is reported (and so counted and recorded as ended, by the
            # driver) only once the collector acknowledged its end. A robot killed before that re-runs it
            # (Ray); the one it was in stays open in the store (closed as aborted when it idles out) or,
            # killed between the collector's ack and the report, closed but never counted.
            if not client.flush(120.0):
                raise RuntimeError(
                    f"episode {eid}: its end was not acknowledged in 120 s: {client.stats.last_error}"
                )
            reports.put(
                (
                    "episode",
                    cfg.robot_id,
                    asdict(
                        EpisodeReport(
                            cfg.robot_id,
                            eid,
                            e,
                            success,
                            outcome,
                            t,
                            operator.human_steps,
                            operator.takeovers,
                            operator.reasons,
                            time.perf_counter() - t0,
                            desk.busy_waits if desk else 0,
                            segments,
                        )
                    ),
                )
            )
        if not client.close(120.0):
            reports.put(
                ("error", cfg.robot_id, f"not every frame was acknowledged: {client.stats.last_error}")
            )
    finally:
        record.close()
        stream.close()
        policy.close()
        env.close()


# ------------------------------------------------------------------------------------------ the fleet
@dataclass
class FleetConfig:
    """N simulated robots (one process each) get action chunks from the policy server and stream every
    frame, segment and outcome to the collector. A simulated operator (the task's privileged scripted
    expert) takes over when the policy stalls (--stall-steps), drifts (--drift-radius) or at random
    (--spot-check-prob), drives for --drive-steps and hands back, within a budget per episode. The collector
    token is read from VLA_RL_COLLECTOR_TOKEN.
    Example: vla-rl fleet sim --robots 4 --episodes 20 --server 127.0.0.1:50061 --collector 127.0.0.1:50071"""

    robots: int = 4
    """Simulated robots (one process each)."""
    server: str = "127.0.0.1:50061"
    """Policy server address: host:port, or replicas as a comma-separated list (a:1,b:2) or
    dns:///name:port; each robot's stream goes to a replica that reports SERVING and moves when it goes."""
    collector: str = "127.0.0.1:50071"
    """Collector address."""
    task: str | None = None
    """Task; None = the served model's robot spec."""
    episodes: int = 5
    """Episodes per robot."""
    seed: int = ONLINE
    """First episode seed: robot i's j-th episode is ``seed + i * 100000 + j``. The default starts in the
    training range, away from every evaluation's seeds (:mod:`vla_rl.core.seeds`)."""
    operators: int = 1
    """Robots the operator can drive at once."""
    rules: Annotated[OperatorRules, tyro.conf.OmitArgPrefixes] = field(default_factory=OperatorRules)
    """When the simulated operator takes over and for how long."""
    collector_token: str | None = field(default=None, repr=False, metadata=SECRET)
    """The collector's token; None = env VLA_RL_COLLECTOR_TOKEN (prefer the environment: ps shows flags)."""
    model_id: str = ""
    """Served model; empty = the only one."""
    max_episode_steps: int | None = None
    """Episode step limit; None = the task's."""
    record_dir: str | None = None
    """Write what each robot did: its frames (PREFIX-i.jsonl, by the robot) and the episodes the fleet
    counted, once the collector acknowledged their end (PREFIX-i.episodes.jsonl, by this driver)."""
    robot_prefix: str = "sim"
    """Robot ids are PREFIX-0, PREFIX-1, ..."""
    ray: str | None = None
    """Run the robots as Ray actors: 'auto' (this machine's Ray cluster, or a local head on 127.0.0.1) or
    a cluster address host:port; None = local processes. A robot whose actor dies is replaced and
    re-runs the episode it was in (same seed) under a new episode id."""
    ray_max_restarts: int = 3
    """With --ray: how many times each robot's actor is replaced before the fleet gives up on it."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        from sim.ray_workers import check_ray_address

        self.ray = check_ray_address(self.ray)
        if self.ray_max_restarts < 0:
            raise ValueError(f"ray_max_restarts: expected >= 0, got {self.ray_max_restarts}")


@dataclass
class RobotSummary:
    robot_id: str
    episodes: int = 0
    successes: int = 0
    steps: int = 0
    human_steps: int = 0
    takeovers: int = 0
    episodes_with_takeover: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.episodes, 1)

    @property
    def intervention_rate(self) -> float:
        """Fraction of frames under operator control."""
        return self.human_steps / max(self.steps, 1)

    def add(self, r: dict[str, Any]) -> None:
        self.episodes += 1
        self.successes += int(r["success"])
        self.steps += r["steps"]
        self.human_steps += r["human_steps"]
        self.takeovers += r["takeovers"]
        self.episodes_with_takeover += int(r["takeovers"] > 0)
        self.reasons.update(reason.split(":")[0] for reason in r["reasons"])


@dataclass
class FleetResult:
    robots: dict[str, RobotSummary]
    episodes: list[dict[str, Any]]
    errors: list[str]
    seconds: float
    operator_busy_waits: int
    replaced: dict[str, int] = field(default_factory=dict)
    """Robots whose Ray actor died and was replaced, and how often (``--ray`` only)."""

    def table(self) -> str:
        rows = [
            [
                s.robot_id,
                s.episodes,
                f"{s.successes}/{s.episodes} ({s.success_rate:.0%})",
                f"{s.intervention_rate:.0%}",
                s.takeovers,
                ", ".join(f"{k} {v}" for k, v in sorted(s.reasons.items())) or "-",
            ]
            for s in self.robots.values()
        ]
        return console.table(rows, ["robot", "episodes", "success", "intervention rate", "takeovers", "why"])


def _spec_from_server(server: str, model_id: str) -> tuple[dict[str, Any], str]:
    from vla_rl_client.policy_client import PolicyClient

    with PolicyClient(server, timeout_s=30.0) as c:
        info = c.info()
    if not info:
        raise RuntimeError(f"policy server {server} serves no model")
    model = info[model_id] if model_id else next(iter(info.values()))
    return json.loads(model.robot_spec_json), model.model_id


def run_sim_fleet(cfg: FleetConfig) -> FleetResult:
    """Run the fleet until every robot has done its episodes; report live; return per-robot summaries."""
    from tqdm import tqdm

    from sim.registry import resolve_task

    spec, model_id = _spec_from_server(cfg.server, cfg.model_id)
    task = resolve_task(cfg.task or spec["name"]).name
    cams = spec.get("cameras") or []
    obs_mode = "rgb" if cams else "state"
    image_size = int(cams[0]["height"]) if cams else 128
    if cfg.record_dir:
        Path(cfg.record_dir).mkdir(parents=True, exist_ok=True)
    robot_cfgs = []
    for i in range(cfg.robots):
        rid = f"{cfg.robot_prefix}-{i}"
        robot_cfgs.append(
            SimRobotConfig(
                robot_id=rid,
                index=i,
                task=task,
                server=cfg.server,
                collector=cfg.collector,
                episodes=cfg.episodes,
                seed=cfg.seed,
                rules=cfg.rules.to_dict(),
                obs=obs_mode,
                image_size=image_size,
                max_episode_steps=cfg.max_episode_steps,
                token=cfg.collector_token,
                model_id=model_id,
                record_path=str(Path(cfg.record_dir) / f"{rid}.jsonl") if cfg.record_dir else None,
            )
        )
    procs: list[Any] = []
    ray_fleet: _RayFleet | None = None
    if cfg.ray:
        ray_fleet = _RayFleet(cfg, robot_cfgs)
        desk: Any = ray_fleet
        reports: Any = ray_fleet.reports
    else:
        ctx = mp.get_context("spawn")
        desk = OperatorDesk(cfg.operators, ctx)
        reports = ctx.Queue()
        for i, rc in enumerate(robot_cfgs):
            p = ctx.Process(
                target=sim_robot_main, args=(rc, desk, reports), name=f"sim-robot-{i}", daemon=True
            )
            p.start()
            procs.append(p)
    summaries = {
        f"{cfg.robot_prefix}-{i}": RobotSummary(f"{cfg.robot_prefix}-{i}") for i in range(cfg.robots)
    }
    episodes: list[dict[str, Any]] = []
    errors: list[str] = []
    running = set(summaries)
    # The episode lines of the records: written here, from the reports, so that the records name exactly
    # the episodes the fleet counted (a robot killed between its report and its own write cannot split them).
    ended = (
        {r: _Record(str(Path(cfg.record_dir) / f"{r}.episodes.jsonl")) for r in summaries}
        if cfg.record_dir
        else None
    )
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.robots * cfg.episodes, desc=f"fleet {task}", unit="ep", disable=not cfg.progress)
    try:
        last_check = time.monotonic()
        backlog: deque[tuple[str, str, Any]] = deque()
        while running:
            if ray_fleet and time.monotonic() - last_check > 2.0:
                # A dead robot actor: replace it, from the episode it was in. Count the episodes it
                # reported first: a report can still sit in the queue when its robot is found dead.
                last_check = time.monotonic()
                with contextlib.suppress(queue.Empty):
                    while True:
                        backlog.append(reports.get_nowait())
                queued = Counter(r for k, r, _ in backlog if k == "episode")
                for rid, error in ray_fleet.check({r: summaries[r].episodes + queued[r] for r in running}):
                    errors.append(f"{rid}: {error}")
                    running.discard(rid)
            try:
                kind, rid, payload = (
                    backlog.popleft() if backlog else reports.get(timeout=1.0 if ray_fleet else 5.0)
                )
            except queue.Empty:
                if ray_fleet:
                    continue
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and len(dead) >= len(running):
                    errors.append(f"robot processes died: {dead}")
                    break
                continue
            if kind == "done":
                running.discard(rid)
            elif kind == "error":
                errors.append(f"{rid}: {payload}")
                log.error("robot failed", extra={"robot": rid, "error": payload})
            elif kind == "episode":
                s = summaries[rid]
                s.add(payload)
                episodes.append(payload)
                if ended is not None:
                    ended[rid].episode(
                        payload["episode_id"], payload["steps"], payload["segments"], payload["outcome"]
                    )
                bar.update(1)
                total = defaultdict(int)
                for x in summaries.values():
                    total["steps"] += x.steps
                    total["human"] += x.human_steps
                    total["succ"] += x.successes
                    total["eps"] += x.episodes
                bar.set_postfix(
                    success=f"{total['succ'] / max(total['eps'], 1):.0%}",
                    intervention=f"{total['human'] / max(total['steps'], 1):.0%}",
                )
                log.info(
                    f"{rid} episode {payload['index'] + 1}/{cfg.episodes}: {payload['outcome']} in {payload['steps']} steps, "
                    f"operator {payload['human_steps']} steps ({payload['takeovers']} takeovers) | {rid}: success "
                    f"{s.successes}/{s.episodes}, intervention rate {s.intervention_rate:.0%}",
                    extra={
                        "robot": rid,
                        "episode": payload["episode_id"],
                        "outcome": payload["outcome"],
                        "intervention_rate": round(s.intervention_rate, 3),
                        "success_rate": round(s.success_rate, 3),
                    },
                )
    finally:
        bar.close()
        for rec in (ended or {}).values():
            rec.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        busy = desk.busy_waits
        if ray_fleet:
            ray_fleet.close()
    replaced = dict(ray_fleet.replaced) if ray_fleet else {}
    return FleetResult(summaries, episodes, errors, time.perf_counter() - t0, busy, replaced)


class RobotActor:
    """A simulated fleet robot in a Ray actor: runs :func:`sim_robot_main` when asked."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg: SimRobotConfig, desk: Any, reports: Any) -> None:
        sim_robot_main(cfg, desk, reports)


class _RayFleet:
    """The robots of ``vla-rl fleet sim --ray``: one Ray actor each (restarted by Ray up to
    ``ray_max_restarts`` times), a desk actor, and a Ray queue for the reports."""

    def __init__(self, cfg: FleetConfig, robots: list[SimRobotConfig]) -> None:
        from ray.util.queue import Queue

        from sim.ray_workers import DeskActor, RayDesk, connect, remote_class

        assert cfg.ray is not None
        connect(cfg.ray, min_cpus=cfg.robots)
        self.cfg, self.robots = cfg, {rc.robot_id: rc for rc in robots}
        self.reports = Queue(actor_options={"num_cpus": 0})
        self.desk = remote_class(DeskActor, num_cpus=0).remote(cfg.operators)
        self._desk_view = RayDesk
        robot_cls = remote_class(
            RobotActor, num_cpus=1, max_restarts=cfg.ray_max_restarts, max_task_retries=0
        )
        self.actors = {rid: robot_cls.remote() for rid in self.robots}
        self.replaced: dict[str, int] = {}
        self.runs: dict[Any, str] = {}
        for rid in self.robots:
            self._run(rid)

    def _run(self, rid: str) -> None:
        ref = self.actors[rid].run.remote(self.robots[rid], self._desk_view(self.desk, rid), self.reports)
        self.runs[ref] = rid

    @property
    def busy_waits(self) -> int:
        import ray

        return int(ray.get(self.desk.waits.remote()))

    def check(self, done_episodes: dict[str, int]) -> list[tuple[str, str]]:
        """Replace the robots whose actor died (those still ``running``, with the episodes they finished);
        returns ``(robot, error)`` for those that cannot be replaced any more."""
        import ray

        from sim.ray_workers import wait_alive

        failed: list[tuple[str, str]] = []
        ready, _ = ray.wait(list(self.runs), num_returns=len(self.runs), timeout=0)
        for ref in ready:
            rid = self.runs.pop(ref)
            try:
                ray.get(ref)
                continue  # finished: its "done" report is in the queue
            except ray.exceptions.RayActorError as e:
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if rid not in done_episodes:
                continue
            n = self.replaced.get(rid, 0)
            if n >= self.cfg.ray_max_restarts:
                failed.append((rid, f"robot actor died {n + 1} times (ray_max_restarts {n}): {error}"))
                continue
            self.replaced[rid] = n + 1
            try:
                wait_alive(self.actors[rid], 300.0)
            except RuntimeError as e:
                failed.append((rid, f"robot actor died and was not replaced: {e}"))
                continue
            self.desk.release_all.remote(rid)  # the seat it may have held
            self.robots[rid].first_episode = done_episodes[rid]
            log.warning(
                "robot actor died: replaced; re-running its episode",
                extra={"robot": rid, "episode_index": done_episodes[rid], "error": error},
            )
            self._run(rid)
        return failed

    def close(self) -> None:
        import ray

        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        ray.kill(self.desk, no_restart=True)
        self.reports.shutdown()

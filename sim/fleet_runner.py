"""The simulated fleet, ``vla-rl fleet sim`` (:func:`run_sim_fleet`): N simulated robots, one process each
(:mod:`sim.fleet_robot`) or one Ray actor each (:mod:`sim.fleet_ray`), acting through the policy server,
watched by a shared :class:`~sim.operator.SimulatedOperator` that takes over when the policy stalls or
drifts (or, with the alarm on, when the CUSUM of the uncertainty the server returns with every chunk
fires), and streaming every frame, segment and outcome to the collector. This driver counts the episodes
the robots report, reports outcomes and intervention rates live, per robot, and returns per-robot
summaries; with ``record_dir`` it writes the episode lines of the robots' records
(:mod:`sim.fleet_records`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import queue
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import tyro
from vla_rl_client.action_queue import RTC_MODES, RTCMode

from sim.fleet_ray import RayFleet
from sim.fleet_records import RobotRecord
from sim.fleet_robot import SimRobotConfig, sim_robot_main
from sim.help_desk import DeskStats, operator_metrics
from sim.help_queue_desk import QueueDesk, SimOperators
from sim.operator import OperatorDesk, OperatorRules
from vla_rl.core import console
from vla_rl.core.configs import SECRET
from vla_rl.core.seeds import ONLINE

log = logging.getLogger("vla_rl.fleet")


@dataclass
class FleetConfig:
    """N simulated robots (one process each) get action chunks from the policy server and stream every
    frame, segment and outcome to the collector. A simulated operator (the task's privileged scripted
    expert) takes over when the policy stalls (--stall-steps), drifts (--drift-radius) or at random
    (--spot-check-prob), drives for --drive-steps and hands back, within a budget per episode. The collector
    token is read from VLA_RL_COLLECTOR_TOKEN. With --mode requests the operator sees no simulator state:
    robots ask for help on their alarms (--uncertainty-h, --failure-alarm) and spot checks in the product's
    help queue (the collector, the dashboard's help queue page), and --operators simulated operators
    (sim-operator-0, ...) claim the requests by urgency, as a person does on the page, take the robot over
    --reaction-s after claiming one and resolve it when they hand back (sim/help_queue_desk.py).
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
    """Robots the operator can drive at once (--mode requests: simulated operators working the help queue,
    one robot each)."""
    rules: Annotated[OperatorRules, tyro.conf.OmitArgPrefixes] = field(default_factory=OperatorRules)
    """When the simulated operator takes over and for how long."""
    collector_token: str | None = field(default=None, repr=False, metadata=SECRET)
    """The collector's token; None = env VLA_RL_COLLECTOR_TOKEN (prefer the environment: ps shows flags)."""
    model_id: str = ""
    """Served model; empty = the only one."""
    canary_share: float = 0.0
    """Share of the robots that run the canary instead (robots 0 .. n-1, n = the share of --robots
    rounded, at least 1 and leaving at least 1 on --model-id): they ask for --canary-model-id, the
    candidate a server started with --canary serves (vla_rl/canary.py decides on their outcomes)."""
    canary_model_id: str = "canary"
    """The model id the canary's robots ask for."""
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
    rtc: RTCMode = "auto"
    """Real-time chunking (docs/serving.md). A simulated robot waits for each chunk, so there is no
    inference delay to hide: auto = off; on = each chunk is guided toward the unexecuted rest of the
    previous one (delay 0), refused when the served model cannot (GetInfo rtc_mode)."""
    help_requests: bool = False
    """Each robot opens a help request in the dashboard's help queue (collector RequestHelp) the first time
    an alarm fires in an episode (the failure predictor's, or the uncertainty CUSUM's: --failure-alarm,
    --uncertainty-h), and withdraws it at the episode's end if nobody claimed it (sim/help_hook.py). The
    requests mode (--mode requests) always asks through the help queue: this flag adds nothing there."""

    def __post_init__(self) -> None:
        from sim.ray_workers import check_ray_address

        self.ray = check_ray_address(self.ray)
        if self.rtc not in RTC_MODES:
            raise ValueError(f"rtc: expected one of {list(RTC_MODES)}, got {self.rtc!r}")
        if self.operators < 1:
            raise ValueError(f"operators: expected >= 1, got {self.operators}")
        if self.ray_max_restarts < 0:
            raise ValueError(f"ray_max_restarts: expected >= 0, got {self.ray_max_restarts}")
        if not 0.0 <= self.canary_share < 1.0:
            raise ValueError(
                f"canary_share: expected a share of the robots in [0, 1), got {self.canary_share}"
            )
        if self.canary_share > 0 and self.robots < 2:
            raise ValueError(
                f"canary_share: a canary needs at least 2 robots (one an arm), got {self.robots}"
            )

    @property
    def canary_robots(self) -> int:
        """How many robots (the first ones) run the canary: 0 without one."""
        if self.canary_share == 0:
            return 0
        return min(self.robots - 1, max(1, round(self.canary_share * self.robots)))


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
    desk: DeskStats | None = None
    """The help desk's counters (``--mode requests`` only)."""
    control_hz: float = 0.0
    """The robots' control rate (converts operator-driven frames to seconds)."""

    def operator_metrics(self, operators: int) -> dict[str, Any]:
        """The operators' numbers for this run (:func:`sim.help_desk.operator_metrics`): robot time is the
        episodes' wall time; operator busy time is the desk's (requests mode) or, omniscient, the frames
        under operator control at :attr:`control_hz`."""
        robot_s = sum(e["seconds"] for e in self.episodes)
        busy_s = (
            self.desk.busy_s
            if self.desk
            else sum(e["human_steps"] for e in self.episodes) / max(self.control_hz, 1e-9)
        )
        return operator_metrics(
            self.episodes, max(robot_s, 1e-9), max(self.seconds, 1e-9), operators, busy_s, self.desk
        )

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
    if cfg.canary_robots:
        _spec_from_server(cfg.server, cfg.canary_model_id)  # served, or a KeyError naming it now
    task = resolve_task(cfg.task or spec["name"]).name
    hz = float(spec.get("control_hz") or 0.0)
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
                model_id=cfg.canary_model_id if i < cfg.canary_robots else model_id,
                record_path=str(Path(cfg.record_dir) / f"{rid}.jsonl") if cfg.record_dir else None,
                rtc=cfg.rtc,
                help_requests=cfg.help_requests,
            )
        )
    procs: list[Any] = []
    ray_fleet: RayFleet | None = None
    # the requests mode: the robots ask in the help queue, simulated operators claim from it (any process)
    queue_desk = help_queue_desk(cfg, [rc.robot_id for rc in robot_cfgs])
    if cfg.ray:
        ray_fleet = RayFleet(cfg.ray, robot_cfgs, cfg.operators, cfg.ray_max_restarts, queue_desk)
        desk: Any = ray_fleet
        reports: Any = ray_fleet.reports
    else:
        ctx = mp.get_context("spawn")
        desk = queue_desk or OperatorDesk(cfg.operators, ctx)
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
        {r: RobotRecord(str(Path(cfg.record_dir) / f"{r}.episodes.jsonl")) for r in summaries}
        if cfg.record_dir
        else None
    )
    operators = (
        SimOperators(cfg.collector, cfg.operators, token=cfg.collector_token).start()
        if queue_desk is not None
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
        desk_stats = None
        if operators is not None:
            operators.stop()
            desk_stats = queue_stats(cfg, episodes, operators)
            busy = desk_stats.queued_while_busy
        else:
            busy = desk.busy_waits
        if ray_fleet:
            ray_fleet.close()
    replaced = dict(ray_fleet.replaced) if ray_fleet else {}
    return FleetResult(summaries, episodes, errors, time.perf_counter() - t0, busy, replaced, desk_stats, hz)


def help_queue_desk(cfg: FleetConfig, robot_ids: list[str]) -> QueueDesk | None:
    """The robots' side of the help queue in the requests mode (None: the omniscient operator)."""
    if not cfg.rules.requests:
        return None
    token = cfg.collector_token
    return QueueDesk(cfg.collector, robot_ids, token=token, reaction_s=cfg.rules.reaction_s, poll_s=0.02)


def queue_stats(cfg: FleetConfig, episodes: list[dict[str, Any]], operators: SimOperators) -> DeskStats:
    """The desk's counters of a requests-mode run: each robot's (the newest it reported: they add up over
    its episodes) summed, with the simulated operators' busy time and queueing."""
    newest: dict[str, dict[str, Any]] = {}
    for e in episodes:
        if e.get("desk"):
            newest[e["robot_id"]] = e["desk"]
    total = {k: sum(d[k] for d in newest.values()) for k in ("requests", "answered", "unanswered", "wait_s")}
    return DeskStats(
        capacity=cfg.operators,
        reaction_s=cfg.rules.reaction_s,
        requests=int(total["requests"]),
        answered=int(total["answered"]),
        unanswered=int(total["unanswered"]),
        wait_s=float(total["wait_s"]),
        busy_s=operators.busy_s,
        queued_while_busy=operators.queued_while_busy,
    )

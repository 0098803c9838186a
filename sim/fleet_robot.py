"""One robot of ``vla-rl fleet sim`` (:func:`sim_robot_main`, a process or a Ray actor's task): it runs
episodes acting through the policy server (receding horizon over a ``StreamAct`` stream), watched by the
shared :class:`~sim.operator.SimulatedOperator`, streams every frame, segment and outcome to the
collector through :class:`~vla_rl_client.robot_client.RobotClient`, and reports each episode to the
fleet's driver (:mod:`sim.fleet_runner`) once the collector acknowledged its end."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sim.fleet_records import RobotRecord
from sim.help_desk import Desk
from sim.help_hook import HelpAsker
from sim.operator import Event, OperatorDesk, OperatorRules, SimulatedOperator
from vla_rl.core.lifeline import exit_with_parent
from vla_rl.core.scheduling import leave_realtime

log = logging.getLogger("vla_rl.fleet")


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
    rtc: str = "off"  # real-time chunking: FleetConfig.rtc
    help_requests: bool = False  # open help requests when an alarm fires: FleetConfig.help_requests


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
    requests: int = 0
    """Help requests the robot opened (the operator's requests mode)."""
    desk: dict[str, Any] | None = None
    """The requests mode on the help queue: this robot's desk counters so far (:class:`sim.help_desk.
    DeskStats`, summed over its episodes)."""


def _switch(client: Any, segments: list[dict[str, Any]], ev: Event, t: int) -> None:
    """A change of control at step ``t``: a new segment in the stream and in the robot's record."""
    kind, ctrl = ("intervention", 1) if ev.kind == "takeover" else ("autonomous", 0)
    client.begin_segment(kind, ctrl, reason=ev.reason)
    segments.append({"start": t, "kind": kind, "controller": ctrl, "reason": ev.reason})


def fleet_rtc(mode: str, server_rtc: str) -> bool:
    """Whether a simulated robot asks for real-time chunking (``FleetConfig.rtc``). It waits for each chunk
    (the simulation stands still meanwhile), so there is no inference delay to hide: ``auto`` is off, and
    ``on`` guides each chunk toward what is left of the previous one (delay 0). ``on`` with a model that
    cannot (``server_rtc`` "", GetInfo's rtc_mode) raises ValueError naming the field."""
    from vla_rl_client.action_queue import RTCOptions

    return RTCOptions(mode, 0 if mode == "on" else None, server_rtc=server_rtc).enabled  # type: ignore[arg-type]


def sim_robot_main(cfg: SimRobotConfig, desk: OperatorDesk | Desk | None, reports: Any) -> None:
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


def _sim_robot(cfg: SimRobotConfig, desk: OperatorDesk | Desk | None, reports: Any) -> None:
    from vla_rl_client.frame import Frame
    from vla_rl_client.meta import new_episode_id
    from vla_rl_client.policy_client import PolicyClient, RTCInput
    from vla_rl_client.robot_client import RobotClient

    from sim.registry import make_env

    rules = OperatorRules(**cfg.rules)
    env = make_env(cfg.task, obs=cfg.obs, image_size=cfg.image_size, max_episode_steps=cfg.max_episode_steps)  # type: ignore[arg-type]
    operator = SimulatedOperator(env.task, rules, desk, robot=cfg.index)
    policy = PolicyClient(cfg.server, timeout_s=30.0, model_id=cfg.model_id)
    stream = policy.stream()
    rtc_on = cfg.rtc == "on" and fleet_rtc(cfg.rtc, next(iter(policy.info(cfg.model_id).values())).rtc_mode)
    client = RobotClient(cfg.collector, cfg.robot_id, env.spec, env.task, token=cfg.token)
    # the requests mode asks through its desk; the flag adds a request per alarmed episode to the others
    asks = cfg.help_requests and not rules.requests
    helper = HelpAsker(cfg.collector, cfg.robot_id, cfg.token) if asks else None
    # Frames only: the fleet's driver writes the episode lines from the reports (see run_sim_fleet).
    record = RobotRecord(cfg.record_path, flush_frames=True)
    last_ts = 0.0
    try:
        for e in range(cfg.first_episode, cfg.episodes):
            t0 = time.perf_counter()
            seed = cfg.seed + cfg.index * 100_000 + e
            obs, info = env.reset(seed=seed)
            eid = new_episode_id(cfg.robot_id)
            operator.reset(seed, env.max_episode_steps, episode_id=eid)
            client.start_episode(
                eid, instruction=obs["instruction"], kind="autonomous", controller="policy", reason="policy"
            )
            segments = [{"start": 0, "kind": "autonomous", "controller": 0}]
            chunk: np.ndarray | None = None
            k, n_exec, commit, score, p_fail = 0, 1, "", float("nan"), float("nan")
            t = 0
            terminated = truncated = False
            while not (terminated or truncated):
                ev = operator.observe(t, info["privileged"], float(info["dense_reward"]))
                if ev is not None:
                    _switch(client, segments, ev, t)
                    chunk = None
                if not operator.driving and (chunk is None or k >= n_exec):
                    rest = None if chunk is None or not rtc_on else chunk[k:]
                    res = stream.act(
                        {"state": obs["state"], "cameras": obs["cameras"], "instruction": obs["instruction"]},
                        seed=seed * 1000 + t,
                        rtc=None if rest is None or not len(rest) else RTCInput(0, rest),
                    )
                    chunk, k, n_exec, commit = res.actions, 0, max(1, res.n_exec), res.commit
                    score = res.uncertainty  # stored with every frame acted from this chunk (NaN: none)
                    p_fail = res.failure  # likewise the failure predictor's score (NaN: no predictor)
                    ev = operator.observe_chunk(t, res.uncertainty, res.failure_alarm, res.failure)  # alarms
                    if helper is not None:
                        helper.on_chunk(eid, res, operator)
                    if ev is not None:  # the robot asks for help instead of executing this chunk
                        _switch(client, segments, ev, t)
                        chunk = None
                if operator.driving:
                    action = operator.act(info["privileged"])
                    proposed = np.full(env.spec.action_dim, np.nan, np.float32)
                    ctrl, revision, unc, fail = 1, "", float("nan"), float("nan")
                else:
                    assert chunk is not None
                    proposed = np.asarray(chunk[k], np.float32)
                    k += 1
                    action = np.clip(proposed, -1.0, 1.0).astype(np.float32)
                    ctrl, revision, unc, fail = 0, commit, score, p_fail
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
                    failure=fail,
                )
                client.add(frame)
                record.frame(eid, t, frame.digest(), ctrl, len(segments) - 1)
                obs, info = next_obs, next_info
                t += 1
            success = bool(info["success"])
            outcome = "success" if success else ("timeout" if truncated else "failure")
            operator.end_episode()
            if helper is not None:
                helper.end_episode()
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
                            operator.requests,
                            desk.stats().to_dict() if rules.requests and desk is not None else None,
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
        if helper is not None:
            helper.close()
        if hasattr(desk, "close"):
            desk.close()  # type: ignore[union-attr]
        stream.close()
        policy.close()
        env.close()

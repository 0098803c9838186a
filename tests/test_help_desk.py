"""The help desk (sim/help_desk.py) and the operator's requests mode: queue order, capacity, reaction time,
unanswered requests, the metrics, and that the requests mode decides without simulator state. No
simulator: the clock is passed explicitly, the operator's expert runs on the kinematic task."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from sim.fleet_runner import FleetConfig
from sim.help_desk import DRIVING, IDLE, QUEUED, REACTING, HelpDesk, operator_metrics
from sim.operator import OperatorRules, SimulatedOperator

TASK = "kinematic/Reach-v0"


def test_the_queue_is_ordered_by_urgency_then_age() -> None:
    desk = HelpDesk(robots=5, capacity=1)
    desk.ask(0, 1.0, now=0.0)  # takes the one operator at once
    desk.ask(1, 2.0, now=1.0)
    desk.ask(2, 5.0, now=2.0)
    desk.ask(3, 2.0, now=0.5)  # same urgency as robot 1, older
    desk.ask(4, 2.0, now=3.0)
    assert desk.state(0) == REACTING and desk.queue() == [2, 3, 1, 4]
    desk.ask(4, 9.0, now=4.0)  # a waiting robot's new alarm raises its urgency, keeps its age
    assert desk.queue() == [4, 2, 3, 1] and desk.stats().requests == 5
    order = []
    for step in range(5):
        robot = next(i for i in range(5) if desk.state(i) == REACTING)
        assert desk.poll(robot, now=10.0 + step)
        order.append(robot)
        desk.release(robot, now=10.5 + step)
    assert order == [0, 4, 2, 3, 1]
    s = desk.stats()
    assert (s.answered, s.unanswered, s.queued_while_busy) == (5, 0, 4)


def test_capacity_bounds_the_robots_driven_at_once() -> None:
    desk = HelpDesk(robots=4, capacity=2)
    for i in range(4):
        desk.ask(i, 1.0, now=float(i))
    assert [desk.state(i) for i in range(4)] == [REACTING, REACTING, QUEUED, QUEUED]
    assert desk.poll(0, now=4.0) and desk.poll(1, now=4.0)
    assert not desk.poll(2, now=4.0) and not desk.poll(3, now=4.0)
    desk.release(1, now=6.0)  # a seat frees: the oldest waiting robot gets it
    assert desk.state(2) == REACTING and desk.state(3) == QUEUED
    assert desk.poll(2, now=6.0)
    s = desk.stats()
    assert s.busy_s == pytest.approx(6.0 - 1.0)  # robot 1's operator, from picking it to the handback
    assert s.wait_s == pytest.approx((4 - 0) + (4 - 1) + (6 - 2)) and s.mean_wait_s == pytest.approx(11 / 3)


def test_reaction_time_delays_the_takeover() -> None:
    desk = HelpDesk(robots=2, capacity=1, reaction_s=1.5)
    desk.ask(0, 1.0, now=10.0)
    assert not desk.poll(0, now=10.0) and not desk.poll(0, now=11.4)
    assert desk.state(0) == REACTING and desk.poll(0, now=11.5)
    assert not desk.poll(0, now=11.6)  # True once: the takeover starts at 11.5
    assert desk.state(0) == DRIVING and desk.stats().mean_wait_s == pytest.approx(1.5)
    desk.ask(1, 1.0, now=12.0)  # the operator is busy with robot 0
    desk.release(0, now=13.0)
    assert desk.state(1) == REACTING and not desk.poll(1, now=14.0) and desk.poll(1, now=14.5)
    assert desk.stats().wait_s == pytest.approx(1.5 + 2.5)


def test_a_request_withdrawn_before_the_operator_arrives_is_unanswered() -> None:
    desk = HelpDesk(robots=3, capacity=1, reaction_s=2.0)
    desk.ask(0, 1.0, now=0.0)
    desk.ask(1, 1.0, now=0.5)
    desk.withdraw(0, now=1.0)  # episode over while the operator was on its way: the operator is free
    assert desk.state(0) == IDLE and desk.state(1) == REACTING
    desk.withdraw(1, now=1.5)
    desk.ask(2, 1.0, now=1.6)
    assert desk.poll(2, now=3.6)
    desk.withdraw(2, now=4.0)  # the episode ended while driven: answered
    s = desk.stats()
    assert (s.requests, s.answered, s.unanswered) == (3, 1, 2)
    assert s.busy_s == pytest.approx(1.0 + 0.5 + 2.4)


def test_desk_and_rules_validation_name_the_field() -> None:
    for kwargs, field in (
        (dict(robots=0), "robots"),
        (dict(robots=2, capacity=0), "capacity"),
        (dict(robots=2, reaction_s=-1.0), "reaction_s"),
    ):
        with pytest.raises(ValueError, match=field):
            HelpDesk(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="robot"):
        HelpDesk(robots=2).ask(2, 1.0, now=0.0)
    with pytest.raises(ValueError, match="mode"):
        OperatorRules(mode="psychic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode: 'requests' needs"):
        OperatorRules(mode="requests")  # no alarm and no spot checks: nobody ever asks
    with pytest.raises(ValueError, match="reaction_s"):
        OperatorRules(mode="requests", failure_alarm=True, reaction_s=math.nan)
    # the requests mode works the help queue through the collector, so Ray actors can ask too
    assert FleetConfig(ray="auto", rules=OperatorRules(mode="requests", failure_alarm=True)).ray == "auto"
    with pytest.raises(ValueError, match="operators"):
        FleetConfig(operators=0)
    assert FleetConfig().rules.mode == "omniscient"  # the default is unchanged


class _Sealed(Mapping[str, Any]):
    """Privileged state that fails the test when read."""

    def __getitem__(self, key: str) -> Any:
        raise AssertionError(f"the requests mode read privileged state {key!r}")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the requests mode iterated privileged state")

    def __len__(self) -> int:
        raise AssertionError("the requests mode read privileged state")


def test_the_requests_mode_decides_without_simulator_state() -> None:
    """Stall and drift would fire on every step here (no progress, far away); the requests operator never
    looks: it takes over only when the failure alarm asks and the desk's operator arrives."""
    rules = OperatorRules(
        mode="requests",
        failure_alarm=True,
        reaction_s=0.2,
        stall_steps=1,
        drift_radius=0.01,
        min_autonomous_steps=0,
        drive_steps=3,
    )
    desk = HelpDesk(robots=2, capacity=1, reaction_s=0.2)
    op = SimulatedOperator(TASK, rules, desk, robot=1)
    op.reset(0, 100, now=0.0)
    hz = 10.0
    for t in range(5):
        assert op.observe(t, _Sealed(), math.nan, now=t / hz) is None
        assert op.observe_chunk(t, 0.5, failure_alarm=False, failure=0.1, now=t / hz) is None
    assert op.takeovers == 0 and desk.stats().requests == 0
    assert op.observe_chunk(5, 0.5, failure_alarm=True, failure=0.9, now=0.5) is None  # asked; reacting
    assert op.asking and desk.state(1) == REACTING
    assert op.observe(6, _Sealed(), math.nan, now=0.6) is None
    ev = op.observe(7, _Sealed(), math.nan, now=0.7)  # 0.2 s after the request
    assert ev is not None and ev.kind == "takeover" and ev.reason.startswith("failure predictor")
    assert op.driving and desk.state(1) == DRIVING and op.requests == 1
    priv = {"tcp_pos": np.zeros(3), "goal_pos": np.ones(3) * 0.1}  # the expert drives with the real state
    for _ in range(3):
        assert op.act(priv).shape == (4,)
    ev = op.observe(10, _Sealed(), math.nan, now=1.0)
    assert ev is not None and ev.kind == "handback" and desk.state(1) == IDLE
    assert desk.stats().busy_s == pytest.approx(1.0 - 0.5)


def test_the_requests_mode_withdraws_at_the_episode_end_and_keeps_the_budget() -> None:
    rules = OperatorRules(mode="requests", failure_alarm=True, max_takeovers=1, min_autonomous_steps=0)
    desk = HelpDesk(robots=2, capacity=1)
    busy = SimulatedOperator(TASK, rules, desk, robot=0)
    waiting = SimulatedOperator(TASK, rules, desk, robot=1)
    for op in (busy, waiting):
        op.reset(0, 100, now=0.0)
    assert busy.observe_chunk(0, 0.5, True, 0.5, now=0.0) is not None  # the one operator takes robot 0
    assert waiting.observe_chunk(0, 0.5, True, 0.9, now=0.0) is None and waiting.asking
    waiting.end_episode(now=1.0)
    assert desk.stats().unanswered == 1 and desk.state(1) == IDLE
    busy.end_episode(now=2.0)
    busy.reset(1, 100, now=2.0)
    busy.takeovers = 1  # the budget is spent: no request
    assert busy.observe_chunk(0, 0.5, True, 0.9, now=2.0) is None and desk.stats().requests == 2


def test_the_uncertainty_alarm_asks_with_its_cusum_as_urgency() -> None:
    rules = OperatorRules(
        mode="requests",
        stall_steps=0,
        uncertainty_h=1.0,
        uncertainty_mean=0.0,
        uncertainty_std=1.0,
        uncertainty_k=0.0,
        min_autonomous_steps=0,
    )
    desk = HelpDesk(robots=3, capacity=1)
    ops = [SimulatedOperator(TASK, rules, desk, robot=i) for i in range(3)]
    for op in ops:
        op.reset(0, 100, now=0.0)
    assert ops[0].observe_chunk(0, 1.5, now=0.0) is not None  # S 1.5 > 1: the free operator takes it
    assert ops[1].observe_chunk(0, 2.0, now=0.1) is None  # S 2.0
    assert ops[2].observe_chunk(0, 4.0, now=0.2) is None  # S 4.0: more urgent, younger
    assert desk.queue() == [2, 1]


def test_operator_metrics() -> None:
    eps = [
        {"success": True, "takeovers": 1},
        {"success": False, "takeovers": 0},
        {"success": False, "takeovers": 2},
        {"success": True, "takeovers": 0},
    ]
    desk = HelpDesk(robots=1)
    desk.ask(0, 1.0, now=0.0)
    assert desk.poll(0, now=3.0)
    desk.release(0, now=10.0)
    m = operator_metrics(eps, robot_s=7200.0, wall_s=3600.0, operators=2, busy_s=1800.0, desk=desk.stats())
    assert m["success_rate"] == pytest.approx(0.5)
    assert m["interventions_per_robot_hour"] == pytest.approx(1.5)
    assert m["successful_episodes_per_operator_hour"] == pytest.approx(1.0)
    assert m["operator_utilisation"] == pytest.approx(0.25)
    assert (m["failures"], m["failures_without_takeover"], m["requests"], m["requests_unanswered"]) == (
        2,
        1,
        1,
        0,
    )
    assert m["mean_wait_s"] == pytest.approx(3.0)
    omniscient = operator_metrics(eps, robot_s=7200.0, wall_s=3600.0, operators=2, busy_s=0.0)
    assert omniscient["requests"] is None and omniscient["mean_wait_s"] is None

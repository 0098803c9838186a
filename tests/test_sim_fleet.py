"""Sim fleet: robots act through a real policy server, a shared simulated operator takes over, and the
collector's store ends up with exactly what the robots did (frames, segment boundaries, controller flags).

The policy is a tiny randomly initialised flow VLA (weak on purpose: the operator has work to do); robots
are real ManiSkill processes in state mode with short episodes.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_uncertainty import reference_cusum
from vla_rl_client.spec import RobotSpec

from fleet.collector import Collector, CollectorConfig
from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from policies.failure import FAILURE_DIR, FailureHead, FailureHeadConfig, FailurePredictor
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from server.config import ServerConfig
from server.policy_server import PolicyServer
from sim.base import ACTION_NAMES
from sim.fleet_records import read_records
from sim.fleet_runner import FleetConfig, run_sim_fleet
from sim.operator import OperatorDesk, OperatorRules, SimulatedOperator
from sim.registry import resolve_task
from vla_rl.cli import main
from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint

torch.set_num_threads(1)
TOKEN = "fleet-test-token"
TASK = "maniskill/PushCube-v1"


def task_spec(task: str = TASK) -> RobotSpec:
    t = resolve_task(task)
    return RobotSpec(
        t.name, t.state_dim["state"], t.action_dim, t.control_hz, t.instruction, action_names=ACTION_NAMES
    )


def tiny_checkpoint(folder: Path, spec: RobotSpec, seed: int = 0) -> Path:
    cfg = FlowVLAConfig.from_robot_spec(
        spec,
        d_model=32,
        n_layers=1,
        expert_n_layers=1,
        n_heads=2,
        instruction_encoder="none",
        chunk_len=4,
        n_exec=2,
        num_inference_steps=2,
    )
    torch.manual_seed(seed)
    info = CheckpointInfo("flow_vla", cfg.to_dict(), spec, {}, Lineage("test"))
    save_checkpoint(folder, FlowVLAPolicy(cfg).state_dict(), info)
    return folder


# ------------------------------------------------------------------------------------------ operator rules
def _priv(
    tcp: tuple[float, float, float], obj: tuple[float, float, float] = (0.0, 0.0, 0.02)
) -> dict[str, np.ndarray]:
    return {
        "tcp_pos": np.array(tcp),
        "obj_pos": np.array(obj),
        "goal_pos": np.array([0.1, 0.0, 0.02]),
        "gripper_width": np.float64(0.08),
        "is_grasped": np.bool_(False),
        "obj_half_size": np.float64(0.02),
    }


def test_operator_rules_budget_and_shared_desk() -> None:
    rules = OperatorRules(
        stall_steps=3, drive_steps=2, min_autonomous_steps=1, max_takeovers=2, max_fraction=0.2
    )
    desk = OperatorDesk(capacity=1)
    a = SimulatedOperator(TASK, rules, desk)
    b = SimulatedOperator(TASK, rules, desk)
    a.reset(0, max_steps=20)  # budget: 4 operator steps
    b.reset(1, max_steps=20)
    near = _priv((0.0, 0.0, 0.1))
    events = []
    for t in range(4):  # no progress after t=0: stall at t=3
        events.append(a.observe(t, near, 0.5))
    assert events[:3] == [None, None, None] and events[3] is not None
    assert events[3].kind == "takeover" and events[3].reason.startswith("stall: no progress for 3 steps")
    assert a.driving
    # b drifts away while the only seat is taken: it keeps its policy and asks again
    far = _priv((0.5, 0.0, 0.1))
    assert b.observe(0, far, 0.1) is None and desk.busy_waits == 1 and not b.driving
    a.act(near)
    a.act(near)
    ev = a.observe(4, near, 0.5)
    assert ev is not None and ev.kind == "handback" and ev.reason == "drove 2 steps" and not a.driving
    ev = b.observe(1, far, 0.1)
    assert ev is not None and ev.kind == "takeover" and ev.reason.startswith("drift")
    assert b.act(far).shape == (4,)
    # a stalls again, but b holds the only seat: a keeps its policy until the seat is free
    waits = desk.busy_waits
    assert all(a.observe(t, near, 0.5) is None for t in range(5, 12)) and desk.busy_waits > waits
    t = 11
    b.end_episode()  # frees the seat
    ev = a.observe(t + 1, near, 0.5)
    assert ev is not None and ev.kind == "takeover"
    a.act(near)
    a.act(near)
    ev = a.observe(t + 2, near, 0.5)
    assert ev is not None and ev.kind == "handback" and "budget" in ev.reason and a.human_steps == 4
    assert all(a.observe(t + 3 + i, near, 0.5) is None for i in range(10))  # budget spent
    with pytest.raises(ValueError, match="max_fraction"):
        OperatorRules(max_fraction=2.0)


# ------------------------------------------------------------------------------------------ uncertainty alarm
def test_operator_takes_over_when_the_uncertainty_alarm_fires() -> None:
    near = _priv((0.0, 0.0, 0.1))
    off = SimulatedOperator(TASK, OperatorRules(stall_steps=0))
    off.reset(0, max_steps=50)
    assert all(off.observe_chunk(t, 100.0) is None for t in range(10))  # alarm off by default
    rules = OperatorRules(
        stall_steps=0,
        drive_steps=2,
        min_autonomous_steps=1,
        uncertainty_mean=1.0,
        uncertainty_std=0.5,
        uncertainty_k=0.5,
        uncertainty_h=2.0,
    )
    desk = OperatorDesk(capacity=1)
    op = SimulatedOperator(TASK, rules, desk)
    op.reset(0, max_steps=50)
    scores = [1.0, float("nan"), 1.5, 2.0, 2.0, 2.0]  # z = 0, -, 1, 2, 2, 2 -> S = 0, 0, 0.5, 2.0, 3.5
    want = reference_cusum(scores, 1.0, 0.5, 0.5)
    events = []
    for t, x in enumerate(scores[:5]):
        assert op.observe(t, near, 0.5) is None
        events.append(op.observe_chunk(t, x))
        assert op.cusum == pytest.approx(want[t])
    assert events[:4] == [None] * 4 and events[4] is not None
    assert events[4].kind == "takeover" and events[4].reason == "uncertainty: CUSUM 3.50 > 2.00"
    assert op.driving and op.reasons[-1].split(":")[0] == "uncertainty"
    assert op.observe_chunk(5, 9.0) is None  # no chunks while the operator drives
    op.act(near)
    op.act(near)
    ev = op.observe(5, near, 0.5)
    assert ev is not None and ev.kind == "handback" and op.cusum == 0.0  # S restarts after a handback
    # an alarm while the only seat is taken stays pending and is answered when the seat frees up
    other = SimulatedOperator(TASK, OperatorRules(stall_steps=1, min_autonomous_steps=0), desk)
    other.reset(1, max_steps=50)
    assert other.observe(0, near, 0.5) is None and other.observe(1, near, 0.5) is not None  # seat taken
    assert op.observe(6, near, 0.5) is None and op.observe_chunk(6, 5.0) is None  # S = 7.5 > 2, no seat
    assert op.observe(7, near, 0.5) is None and desk.busy_waits >= 2
    other.end_episode()
    ev = op.observe(8, near, 0.5)
    assert ev is not None and ev.kind == "takeover" and ev.reason.startswith("uncertainty")
    op.reset(2, max_steps=50)
    assert op.cusum == 0.0 and op.scores == [] and not op.driving


def test_operator_takes_over_on_the_failure_predictors_alarm() -> None:
    near = _priv((0.0, 0.0, 0.1))
    off = SimulatedOperator(TASK, OperatorRules(stall_steps=0))
    off.reset(0, max_steps=50)
    assert all(off.observe_chunk(t, 1.0, failure_alarm=True) is None for t in range(5))  # off by default
    op = SimulatedOperator(TASK, OperatorRules(stall_steps=0, min_autonomous_steps=1, failure_alarm=True))
    op.reset(0, max_steps=50)
    assert op.observe(0, near, 0.5) is None and op.observe_chunk(0, 1.0) is None  # no alarm, no takeover
    assert op.observe(1, near, 0.5) is None
    ev = op.observe_chunk(1, float("nan"), failure_alarm=True)
    assert ev is not None and ev.kind == "takeover" and ev.reason.startswith("failure predictor")
    assert op.driving and op.observe_chunk(2, 1.0, failure_alarm=True) is None  # no chunks while driving


# ------------------------------------------------------------------------------------------ the fleet
@contextlib.contextmanager
def fleet_services(tmp_path: Path, failure: bool = False) -> Iterator[tuple[PolicyServer, Collector]]:
    """A policy server on a tiny random checkpoint (model id ``push``; ``failure``: with a random failure
    predictor over its features, so every chunk carries a learned failure score) and a collector into
    ``tmp_path/store``, stopped on exit."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt", task_spec())
    if failure:
        torch.manual_seed(5)
        head = FailureHead(FailureHeadConfig(feature_dim=32, hidden=(8,)))
        FailurePredictor(head, 0.5, 0.05, {}).save(ckpt / FAILURE_DIR)
    config = ServerConfig(checkpoint=str(ckpt), model_id="push", port=0, torch_threads=1, device="cpu")
    server = PolicyServer(config, token="x").start()
    collector = Collector(
        CollectorConfig(store=tmp_path / "store", port=0, chunk_len=16), token=TOKEN
    ).start()
    try:
        yield server, collector
    finally:
        collector.stop()
        server.stop()


def test_sim_fleet_store_matches_what_robots_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fleet_services(tmp_path, failure=True) as (server, collector):
        # the uncertainty alarm on, with a threshold the random policy's first chunk crosses (its score
        # rides with the chunk from the server): every episode starts with an "uncertainty" takeover
        rules = OperatorRules(
            stall_steps=4,
            drive_steps=5,
            max_takeovers=2,
            max_fraction=0.6,
            uncertainty_k=0.0,
            uncertainty_h=1e-3,
        )
        cfg = FleetConfig(
            progress=False,
            robots=2,
            server=server.address,
            collector=collector.address,
            episodes=2,
            max_episode_steps=25,
            rules=rules,
            collector_token=TOKEN,
            record_dir=str(tmp_path / "records"),
        )
        result = run_sim_fleet(cfg)
        assert result.errors == []
        assert collector.drain(60)
        commit = server.slots["push"].active.commit
    assert {r: s.episodes for r, s in result.robots.items()} == {"sim-0": 2, "sim-1": 2}
    frames, episodes = read_records(sorted((tmp_path / "records").glob("*.jsonl")))
    store = EpisodeStore(tmp_path / "store")
    assert sorted(store.episode_ids()) == sorted(episodes)
    got: collections.Counter[tuple[str, int, str]] = collections.Counter()
    n_interventions = 0
    for eid, rec in episodes.items():
        ep = store.read_episode(eid)
        assert ep.meta.is_closed and ep.length == rec["length"]
        segs = [(g.start, g.kind.value, int(g.controller), g.reason) for g in ep.meta.segments]
        assert segs == [
            (x["start"], x["kind"], x["controller"], x.get("reason", "policy")) for x in rec["segments"]
        ]
        n_interventions += sum(1 for g in ep.meta.segments if g.kind.value == "intervention")
        mine = sorted((f for f in frames if f["episode"] == eid), key=lambda f: f["seq"])
        assert ep.controller.tolist() == [f["controller"] for f in mine]
        assert ep.segment.tolist() == [f["segment"] for f in mine]
        human = ep.controller == 1
        assert not ep.has_proposal[human].any() and ep.has_proposal[~human].all()
        # every policy frame carries its chunk's score from the server (flow_vla: accel); human ones none
        assert ep.uncertainty is not None
        assert np.isfinite(ep.uncertainty[~human]).all() and np.isnan(ep.uncertainty[human]).all()
        # ... and its learned failure score (the checkpoint has a predictor), in [0, 1]
        assert ep.failure is not None and np.isnan(ep.failure[human]).all()
        p = ep.failure[~human]
        assert np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()
        revs = np.array(ep.meta.revisions)[ep.revision]
        assert (revs[~human] == commit).all() and (revs[human] == "").all()
        for i in range(ep.length):
            got[(eid, i, ep.frame(i).digest())] += 1
    assert got == collections.Counter((f["episode"], f["seq"], f["digest"]) for f in frames)
    assert n_interventions >= 1  # the weak policy needed help
    # the alarm fired on the first chunk; it waits (pending) while the one operator drives the other robot
    alarms = [
        g
        for rec in episodes.values()
        for g in rec["segments"]
        if g.get("reason", "").startswith("uncertainty")
    ]
    assert alarms and all(g["reason"].startswith("uncertainty: CUSUM") for g in alarms)
    assert sum(s.reasons["uncertainty"] for s in result.robots.values()) == len(alarms)
    assert any(g["start"] == 0 for g in alarms)  # the robot holding the seat: before its first action
    info = store.info()["robots"]
    for rid, s in result.robots.items():
        assert info[rid]["intervention_rate"] == pytest.approx(s.intervention_rate)
        assert info[rid]["successes"] == s.successes
    assert main(["store", "info", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "intervention rate (frames)" in out and "sim-0" in out and "sim-1" in out


def test_sim_fleet_help_desk_answers_requests(tmp_path: Path) -> None:
    """The requests mode through the real fleet and the product's help queue: robots ask on their
    uncertainty alarm (every chunk of the random policy crosses this h) in the collector's DB, one simulated
    operator claims and resolves them there, the desk's counters add up and match the DB's rows."""
    with fleet_services(tmp_path) as (server, collector):
        rules = OperatorRules(
            mode="requests",
            reaction_s=0.05,
            drive_steps=4,
            max_fraction=0.6,
            uncertainty_k=0.0,
            uncertainty_h=1e-3,
        )
        cfg = FleetConfig(
            progress=False,
            robots=2,
            server=server.address,
            collector=collector.address,
            episodes=1,
            max_episode_steps=15,
            rules=rules,
            collector_token=TOKEN,
        )
        result = run_sim_fleet(cfg)
        assert result.errors == [] and collector.drain(60)
        rows = collector.db.help_queue(statuses=("open", "claimed", "resolved", "expired"))
    desk = result.desk
    assert desk is not None and desk.capacity == 1 and desk.reaction_s == pytest.approx(0.05)
    assert desk.answered >= 1 and desk.requests == desk.answered + desk.unanswered
    assert sum(e["requests"] for e in result.episodes) == desk.requests
    assert sum(e["takeovers"] for e in result.episodes) == desk.answered
    reasons = [r for e in result.episodes for r in e["reasons"]]
    assert reasons and all(r.startswith("uncertainty: CUSUM") for r in reasons)
    m = result.operator_metrics(cfg.operators)
    assert m["requests"] == desk.requests and m["mean_wait_s"] >= 0.05 - 1e-9
    assert 0 < m["operator_utilisation"] <= 1
    # what the dashboard's help queue shows: each request once, every one closed; those the simulated
    # operator reached were claimed and resolved by it, with what happened
    assert len(rows) == desk.requests and all(r.status == "resolved" for r in rows)
    taken = [r for r in rows if r.claimed_by == "sim-operator-0"]
    assert len(taken) >= desk.answered
    # (a claim that crossed the robot's withdrawal at its episode's end reads "withdrawn by the robot")
    notes = ("handed back: ", "the episode ended", "withdrawn by the robot")
    assert all(r.note.startswith(notes) for r in taken), [r.note for r in rows]
    assert any(r.note.startswith("handed back: drove 4 steps") for r in taken)


def test_fleet_and_collect_cli_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLA_RL_COLLECTOR_TOKEN", raising=False)
    assert main(["fleet", "sim", "--robots", "0"]) == 2
    assert "--robots and --episodes must be >= 1" in capsys.readouterr().err
    assert main(["fleet", "sim", "--max-fraction", "3"]) == 2
    assert "max_fraction" in capsys.readouterr().err
    assert main(["collect", "--store", str(tmp_path / "s"), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "pass a token" in capsys.readouterr().err


def test_sim_fleet_opens_help_requests_when_its_alarm_fires(tmp_path: Path) -> None:
    """--help-requests: each episode whose uncertainty alarm fired opens one help request (through the
    real collector into the metadata DB), withdrawn at the episode's end since nobody claimed it."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt", task_spec())
    config = ServerConfig(checkpoint=str(ckpt), model_id="push", port=0, torch_threads=1, device="cpu")
    server = PolicyServer(config, token="x").start()
    collector = Collector(
        CollectorConfig(store=tmp_path / "store", port=0, chunk_len=16), token=TOKEN
    ).start()
    try:
        rules = OperatorRules(stall_steps=0, drift_radius=0.0, uncertainty_k=0.0, uncertainty_h=1e-3)
        cfg = FleetConfig(
            progress=False,
            robots=2,
            server=server.address,
            collector=collector.address,
            episodes=2,
            max_episode_steps=12,
            rules=rules,
            collector_token=TOKEN,
            help_requests=True,
        )
        result = run_sim_fleet(cfg)
        assert result.errors == []
        assert collector.drain(60)
        asked = collector.db.help_queue(statuses=("open", "claimed", "resolved", "expired"))
    finally:
        collector.stop()
        server.stop()
    episodes = {e.id: e for e in MetadataDB.for_store(tmp_path / "store").episodes()}
    assert len(episodes) == 4
    # every episode's first chunk crosses the threshold: one request each, none twice
    assert sorted(r.episode_id for r in asked) == sorted(episodes)
    for r in asked:
        assert r.robot_id == episodes[r.episode_id].robot_id and r.reason.startswith("uncertainty: CUSUM")
        assert math.isfinite(r.urgency)
        assert (r.status, r.note) == ("resolved", "withdrawn by the robot")
    # off by default: FleetConfig() opens none
    assert FleetConfig().help_requests is False

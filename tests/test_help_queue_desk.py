"""The help desk on the product's help queue (sim/help_queue_desk.py): simulated operators claim robots'
requests through a real collector (loopback gRPC) into a real metadata DB (SQLite and PostgreSQL), the
robot learns of the claim by polling, drives, and the operator's hands resolve it; a person claiming on the
same queue races them safely; the failure cases lose nothing and raise nothing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.collector import Collector, CollectorConfig
from fleet.db import HelpConflict, MetadataDB
from sim.help_desk import DRIVING, IDLE, QUEUED, REACTING
from sim.help_queue_desk import QueueDesk, SimOperators
from sim.operator import OperatorRules, SimulatedOperator

TOKEN = "desk-shared-token-0123"
ROBOTS = ["arm-0", "arm-1", "arm-2"]
ALL = ("open", "claimed", "resolved", "expired")


@pytest.fixture
def collector(tmp_path: Path, store_db_url: str | None) -> Iterator[Collector]:
    c = Collector(CollectorConfig(store=tmp_path / "s", port=0, chunk_len=16, db=store_db_url), token=TOKEN)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def lockstep(address: str, capacity: int = 1, reaction_s: float = 0.5) -> tuple[QueueDesk, SimOperators]:
    ops = SimOperators(address, capacity, token=TOKEN)
    return QueueDesk(address, ROBOTS, token=TOKEN, reaction_s=reaction_s, operators=ops), ops


def test_claim_poll_drive_resolve_by_the_simulated_operator(collector: Collector) -> None:
    """Lock-step (operators dispatched on every call): the most urgent request is claimed first, the robot
    takes over reaction_s after the claim, the handback resolves the request as the operator, the
    freed operator takes the next one; a request whose episode ended first is withdrawn (unanswered)."""
    desk, ops = lockstep(collector.address)
    db = collector.db
    desk.ask(0, 1.0, now=0.0, reason="uncertainty: CUSUM 4.0 > 3.5", episode_id="arm-0-ep")
    desk.ask(1, 2.0, now=0.1, reason="failure predictor: 0.8", episode_id="arm-1-ep")
    desk.ask(2, 5.0, now=0.2, reason="failure predictor: 0.9", episode_id="arm-2-ep")
    first = db.help_request(desk.request_id(0))
    assert (first.status, first.claimed_by) == ("claimed", "sim-operator-0")  # the only one open at 0.0
    assert not desk.poll(0, now=0.3) and desk.state(0) == REACTING  # claimed at 0.0, seen at 0.3
    assert not desk.poll(0, now=0.45) and desk.poll(0, now=0.5) and not desk.poll(0, now=0.6)
    assert desk.state(0) == DRIVING and desk.state(2) == QUEUED
    desk.release(0, now=1.5, note="handed back: drove 15 steps")
    done = db.help_request(first.id)
    assert (done.status, done.claimed_by, done.note) == (
        "resolved",
        "sim-operator-0",
        "handed back: drove 15 steps",
    )
    # the freed operator took the most urgent waiting request (robot 2's), robot 1 still waits
    assert db.help_request(desk.request_id(2)).claimed_by == "sim-operator-0"
    assert db.help_request(desk.request_id(1)).status == "open"
    # robot 1's episode ends before anybody reached it: withdrawn, unanswered
    asked_1 = desk.request_id(1)
    desk.withdraw(1, now=1.6, note="the episode ended")
    assert (db.help_request(asked_1).status, desk.state(1)) == ("resolved", IDLE)
    # robot 2's episode ends while the operator is on its way: the operator closes it, unanswered
    assert not desk.poll(2, now=1.7) and desk.state(2) == REACTING
    asked_2 = desk.request_id(2)
    desk.release(2, now=1.8, note="the episode ended")
    assert db.help_request(asked_2).note == "the episode ended before the operator arrived"
    desk.poll(0, now=2.0)  # a round: the operator sees its request closed
    s = desk.stats()
    assert (s.requests, s.answered, s.unanswered, s.capacity) == (3, 1, 2, 1)
    # queued while busy: robots 1 and 2 asked while the operator was on robot 0; of those two, the
    # operators' own count sees only the request they claimed later (robot 2's)
    assert s.wait_s == pytest.approx(0.5) and s.queued_while_busy == 2 and ops.queued_while_busy == 1
    assert s.busy_s == pytest.approx((1.5 - 0.0) + (1.8 - 1.5))  # from each claim to its close
    assert all(r.status == "resolved" for r in db.help_queue(statuses=ALL))
    desk.close()
    ops.stop()


def test_the_simulated_operator_drives_a_robot_through_the_queue(collector: Collector) -> None:
    """SimulatedOperator in the requests mode with the queue desk: its failure alarm asks (reason and
    episode on the request), the takeover comes once the operator arrived, the handback resolves it."""
    desk, ops = lockstep(collector.address, reaction_s=0.2)
    rules = OperatorRules(
        mode="requests", failure_alarm=True, reaction_s=0.2, drive_steps=2, min_autonomous_steps=0
    )
    op = SimulatedOperator("kinematic/Reach-v0", rules, desk, robot=1)
    op.reset(0, 100, now=0.0, episode_id="arm-1-ep7")
    assert op.observe_chunk(0, 0.5, failure_alarm=True, failure=0.9, now=0.0) is None and op.asking
    (req,) = collector.db.help_queue()
    assert (req.robot_id, req.episode_id, req.urgency) == ("arm-1", "arm-1-ep7", pytest.approx(0.9))
    assert req.reason.startswith("failure predictor") and req.claimed_by == "sim-operator-0"
    assert op.observe(1, {}, 0.0, now=0.1) is None
    ev = op.observe(2, {}, 0.0, now=0.3)
    assert ev is not None and ev.kind == "takeover"
    op.driven = 2
    ev = op.observe(4, {}, 0.0, now=0.5)
    assert ev is not None and ev.kind == "handback"
    got = collector.db.help_request(req.id)
    assert (got.status, got.note) == ("resolved", "handed back: drove 2 steps")
    desk.close()
    ops.stop()


def test_a_person_and_the_simulated_operators_share_the_queue(collector: Collector) -> None:
    """A person claiming on the page (the DB's conditional update, their own connection) and two simulated
    operators race for the same requests: each goes to exactly one. The robot a person took is driven but
    its request is left for the person to resolve, and not taken over twice in that episode."""
    db = collector.db
    ids = [db.open_help(f"arm-{i}", f"arm-{i}-ep", "asked", float(i)).id for i in range(3)]
    person = MetadataDB(db.url)
    ops = SimOperators(collector.address, 2, token=TOKEN)
    barrier = threading.Barrier(2)
    person_got: list[int] = []

    def person_clicks() -> None:
        barrier.wait()
        for _ in range(3):
            with contextlib.suppress(HelpConflict):
                person_got.append(person.claim_help("ana").id)

    t = threading.Thread(target=person_clicks)
    t.start()
    barrier.wait()
    sim_got = ops.dispatch(0.0)
    t.join()
    assert sorted(person_got + sim_got) == sorted(ids), (person_got, sim_got)
    for r in db.help_queue(statuses=ALL):
        assert r.claimed_by in {"ana", "sim-operator-0", "sim-operator-1"}
        assert (r.claimed_by == "ana") == (r.id in person_got)
    person.close()
    ops.stop()

    # a robot whose request the person holds: driven, then left claimed for the person
    rid = db.open_help("arm-0", "arm-0-ep2", "asked", 9.0).id
    db.claim_help("ana", rid)
    desk = QueueDesk(collector.address, ROBOTS, token=TOKEN)
    desk.ask(0, 1.0, now=0.0, episode_id="arm-0-ep2")  # the person's request: not asked again
    assert desk.state(0) == IDLE
    db.resolve_help(rid, by="ana")
    db.open_help("arm-0", "arm-0-ep3", "asked", 9.0)
    desk.ask(0, 9.0, now=1.0, episode_id="arm-0-ep3")
    db.claim_help("ana")
    assert desk.poll(0, now=1.1)  # reaction 0: the person's stand-in drives at once
    desk.release(0, now=2.0, note="handed back: drove 15 steps")
    (held,) = [r for r in db.help_queue(statuses=("claimed",)) if r.episode_id == "arm-0-ep3"]
    assert held.claimed_by == "ana"  # ana resolves it on the page
    desk.close()


def test_collector_down_while_claiming_loses_nothing_and_raises_nothing(
    tmp_path: Path, store_db_url: str | None
) -> None:
    """The collector goes away with a request open: the operators' rounds and the robot's polls fail
    quietly (counted); the robot keeps its request; a collector back on the same store and port hands it
    to the operator, and the robot is driven."""
    cfg = CollectorConfig(store=tmp_path / "s", port=0, chunk_len=16, db=store_db_url)
    c = Collector(cfg, token=TOKEN).start()
    address = c.address
    ops = SimOperators(address, 1, token=TOKEN, timeout_s=0.5)
    desk = QueueDesk(address, ROBOTS, token=TOKEN, operators=None, timeout_s=0.5)
    desk.ask(1, 3.0, now=0.0, reason="failure predictor: 0.7", episode_id="arm-1-ep")
    asked = desk.request_id(1)
    c.stop()
    assert ops.dispatch(1.0) == [] and ops.errors == 1
    assert not desk.poll(1, now=1.0) and desk.state(1) == QUEUED and desk.errors == 1
    desk.ask(2, 1.0, now=1.0, episode_id="arm-2-ep")  # refused quietly: robot 2 keeps its policy
    assert desk.state(2) == IDLE and desk.errors == 2
    port = int(address.rsplit(":", 1)[1])
    c = Collector(
        CollectorConfig(store=tmp_path / "s", port=port, chunk_len=16, db=store_db_url), token=TOKEN
    )
    c.start()
    try:
        # the channels reconnect after gRPC's backoff: the operators' rounds go on until one claims
        deadline = time.monotonic() + 30
        while not (claimed := ops.dispatch(2.0)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert claimed == [asked]
        while not desk.poll(1, now=2.0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert desk.state(1) == DRIVING
        desk.release(1, now=3.0, note="handed back: drove 3 steps")
        got = c.db.help_request(asked)
        assert (got.status, got.claimed_by, got.reason) == (
            "resolved",
            "sim-operator-0",
            "failure predictor: 0.7",
        )
    finally:
        desk.close()
        ops.stop()
        c.stop()


def test_an_expired_request_is_unanswered_and_the_robot_may_ask_again(collector: Collector) -> None:
    desk = QueueDesk(collector.address, ROBOTS, token=TOKEN)
    desk.ask(0, 1.0, now=0.0, episode_id="arm-0-ep")
    old = desk.request_id(0)
    assert collector.db.expire_help(60.0, now=collector.db.help_request(old).created_at + 61) == 1
    assert not desk.poll(0, now=1.0) and desk.state(0) == IDLE
    assert desk.stats().unanswered == 1
    desk.release(0, now=1.5)  # nothing open: nothing to close, nothing raised
    desk.ask(0, 1.0, now=2.0, episode_id="arm-0-ep")
    assert desk.request_id(0) not in (0, old) and desk.state(0) == QUEUED
    assert [r.status for r in collector.db.help_queue(statuses=ALL)] == ["open", "expired"]
    # an operator whose robot never hands back frees its seat after max_hold_s
    ops = SimOperators(collector.address, 1, token=TOKEN, max_hold_s=5.0)
    assert ops.dispatch(10.0) == [desk.request_id(0)]
    assert ops.dispatch(14.0) == [] and ops.held[0] is not None
    ops.dispatch(16.0)
    assert ops.held[0] is None and "did not hand back" in collector.db.help_request(desk.request_id(0)).note
    desk.close()
    ops.stop()


def test_validation_names_the_field(collector: Collector) -> None:
    with pytest.raises(ValueError, match="robots"):
        QueueDesk(collector.address, [])
    with pytest.raises(ValueError, match="reaction_s"):
        QueueDesk(collector.address, ROBOTS, reaction_s=-1.0)
    with pytest.raises(ValueError, match="poll_s"):
        QueueDesk(collector.address, ROBOTS, poll_s=-1.0)
    with pytest.raises(ValueError, match="capacity"):
        SimOperators(collector.address, 0)
    with pytest.raises(ValueError, match="max_hold_s"):
        SimOperators(collector.address, 1, max_hold_s=0)
    with pytest.raises(ValueError, match="robot"):
        QueueDesk(collector.address, ROBOTS).ask(3, 1.0, now=0.0)


def test_with_the_operators_elsewhere_the_reaction_runs_from_the_claim_seen(collector: Collector) -> None:
    """The fleet's robots do not share the operators' process: the reaction starts when the robot first
    sees the claim (its own clock), and polls are spaced by poll_s."""
    ops = SimOperators(collector.address, 1, token=TOKEN)
    desk = QueueDesk(collector.address, ROBOTS, token=TOKEN, reaction_s=0.5, poll_s=1.0)
    desk.ask(0, 1.0, now=10.0, episode_id="arm-0-ep")
    assert not desk.poll(0, now=10.0) and desk.state(0) == QUEUED  # polled: still open
    assert ops.dispatch(100.0) == [desk.request_id(0)]
    assert not desk.poll(0, now=10.5) and desk.state(0) == QUEUED  # within poll_s: not asked again
    assert not desk.poll(0, now=11.0) and desk.state(0) == REACTING  # sees the claim at 11.0
    assert not desk.poll(0, now=11.4) and desk.poll(0, now=11.5)
    assert desk.stats().wait_s == pytest.approx(1.5)
    desk.close()
    ops.stop()

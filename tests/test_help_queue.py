"""Robots' help requests in the metadata DB (fleet.db.help), on SQLite and PostgreSQL: the queue's order,
bounded fields, one claim per request under a race, resolving, expiry."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from vla_rl_client.help_client import HelpClient, HelpError

from fleet.collector import Collector, CollectorConfig
from fleet.db import HelpConflict, MetadataDB


@pytest.fixture
def db(db_url: str) -> MetadataDB:
    d = MetadataDB(db_url)
    yield d
    d.close()


def test_the_queue_is_ordered_by_urgency_then_age(db: MetadataDB) -> None:
    a = db.open_help("r1", "ep-1", "uncertainty: CUSUM 4.1 > 3.5", 1.0, now=100.0)
    b = db.open_help("r2", "ep-2", "failure predictor", 3.0, now=110.0)
    c = db.open_help("r3", "ep-3", "asked", 1.0, now=90.0)
    assert [r.id for r in db.help_queue()] == [b.id, c.id, a.id]
    # asking again for the same episode does not queue twice; a higher urgency raises the queued one
    again = db.open_help("r1", "ep-1", "uncertainty: CUSUM 9", 5.0, now=120.0)
    assert again.id == a.id and again.urgency == 5.0 and again.created_at == 100.0
    assert [r.id for r in db.help_queue()] == [a.id, b.id, c.id]
    assert db.help_queue()[0].waited_s(130.0) == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"robot_id": "bad id"}, "robot_id"),
        ({"episode_id": "x" * 129}, "episode_id"),
        ({"reason": "r" * 257}, "reason"),
        ({"reason": ""}, "reason"),
        ({"reason": "two\nlines"}, "reason"),
        ({"urgency": float("nan")}, "urgency"),
        ({"urgency": 1e9}, "urgency"),
        ({"urgency": True}, "urgency"),
    ],
)
def test_fields_out_of_bounds_are_refused_naming_the_field(db: MetadataDB, kwargs: dict, field: str) -> None:
    args = {"robot_id": "r1", "episode_id": "ep-1", "reason": "help", "urgency": 1.0, **kwargs}
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        db.open_help(**args)
    assert db.help_queue() == []


def test_claim_resolve_and_what_the_robot_sees(db: MetadataDB) -> None:
    low = db.open_help("r1", "ep-1", "asked", 1.0, now=100.0)
    high = db.open_help("r2", "ep-2", "failure predictor", 2.0, now=101.0)
    got = db.claim_help("ana", now=105.0)  # the next one: the most urgent
    assert (got.id, got.status, got.claimed_by, got.waited_s(999.0)) == (high.id, "claimed", "ana", 4.0)
    assert db.help_request(high.id).status == "claimed"  # what the robot polls
    with pytest.raises(HelpConflict, match="claimed by ana"):
        db.claim_help("bo", high.id)
    with pytest.raises(HelpConflict, match="claimed by ana, not bo"):
        db.resolve_help(high.id, by="bo")
    done = db.resolve_help(high.id, by="ana", note="regrasped", now=130.0)
    assert (done.status, done.note, done.closed_at) == ("resolved", "regrasped", 130.0)
    with pytest.raises(HelpConflict, match="already resolved"):
        db.resolve_help(high.id, by="ana")
    assert [r.id for r in db.help_queue()] == [low.id]
    # the robot itself may withdraw its request
    assert db.resolve_help(low.id, by="r1").status == "resolved"
    with pytest.raises(HelpConflict, match="no open help request"):
        db.claim_help("ana")
    with pytest.raises(KeyError):
        db.claim_help("ana", 9999)
    with pytest.raises(ValueError, match=r"^operator: expected"):
        db.claim_help("x" * 65)


def test_two_people_never_claim_the_same_request(db_url: str) -> None:
    """Eight people (each with their own connection) click "take" on the same request at once, and then
    on "next" for three requests: each request goes to exactly one of them."""
    setup = MetadataDB(db_url)
    first = setup.open_help("r1", "ep-1", "asked", 1.0)
    dbs = [MetadataDB(db_url) for _ in range(8)]
    barrier = threading.Barrier(len(dbs))
    won: list[tuple[str, int]] = []
    lost: list[str] = []

    def claim(i: int, request_id: int | None) -> None:
        barrier.wait()
        try:
            got = dbs[i].claim_help(f"op{i}", request_id)
            won.append((got.claimed_by or "", got.id))
        except HelpConflict as e:
            lost.append(str(e))

    def race(request_id: int | None) -> None:
        threads = [threading.Thread(target=claim, args=(i, request_id)) for i in range(len(dbs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    race(first.id)
    assert len(won) == 1 and len(lost) == 7, (won, lost)
    assert setup.help_request(first.id).claimed_by == won[0][0]
    won.clear()
    lost.clear()
    ids = {setup.open_help(f"r{i}", f"ep-{i}", "asked", float(i)).id for i in range(2, 5)}
    race(None)
    assert sorted(i for _, i in won) == sorted(ids) and len(lost) == 5, (won, lost)
    for r in ids:
        assert setup.help_request(r).claimed_by in {w for w, _ in won}
    for d in [setup, *dbs]:
        d.close()


def test_unclaimed_requests_expire(db: MetadataDB) -> None:
    old = db.open_help("r1", "ep-1", "asked", 1.0, now=100.0)
    taken = db.open_help("r2", "ep-2", "asked", 1.0, now=100.0)
    fresh = db.open_help("r3", "ep-3", "asked", 1.0, now=190.0)
    db.claim_help("ana", taken.id)
    assert db.expire_help(60.0, now=200.0) == 1
    assert db.help_request(old.id).status == "expired"
    assert {r.id for r in db.help_queue()} == {taken.id, fresh.id}
    # a new request for the same episode opens once the old one is closed
    assert db.open_help("r1", "ep-1", "asked", 1.0).id != old.id
    with pytest.raises(ValueError, match=r"^max_open_s"):
        db.expire_help(0)


def test_a_robot_holds_a_bounded_number_of_requests(db: MetadataDB) -> None:
    for i in range(4):
        db.open_help("r1", f"ep-{i}", "asked", 1.0)
    with pytest.raises(HelpConflict, match=r"^robot_id: r1 already has 4 help requests"):
        db.open_help("r1", "ep-9", "asked", 1.0)
    assert db.open_help("r1", "ep-0", "asked", 2.0).urgency == 2.0  # its own again: no new one
    assert db.open_help("r2", "ep-9", "asked", 1.0).status == "open"


# ---------------------------------------------------------------------------- through the collector
def test_a_robot_asks_through_the_collector_and_learns_it_was_claimed(
    tmp_path: Path, store_db_url: str | None
) -> None:
    """Loopback gRPC into a real collector and DB (SQLite beside the store, or PostgreSQL): ask, ask again
    (same request), poll while open, an operator claims it in the DB, the robot sees who, withdraws."""
    tokens = {"arm-a": "a" * 20, "arm-b": "b" * 20}
    cfg = CollectorConfig(store=tmp_path / "s", port=0, chunk_len=16, db=store_db_url)
    with Collector(cfg, robot_tokens=tokens) as c:
        with HelpClient(c.address, "arm-a", token=tokens["arm-a"]) as arm_a:
            req = arm_a.ask("arm-a-ep1", "failure predictor: 0.83 > 0.61", 0.83)
            assert req.status == "open" and not req.claimed
            assert arm_a.ask("arm-a-ep1", "failure predictor: 0.9", 0.9).request_id == req.request_id
            assert arm_a.status(req.request_id).status == "open"
            (queued,) = c.db.help_queue()
            assert (queued.robot_id, queued.episode_id, queued.urgency) == ("arm-a", "arm-a-ep1", 0.9)
            c.db.claim_help("ana", req.request_id)
            seen = arm_a.status(req.request_id)
            assert seen.claimed and seen.claimed_by == "ana" and seen.claimed_at > 0
            # bounded fields: the collector names the field it refuses
            with pytest.raises(HelpError, match="INVALID_ARGUMENT: episode_id: expected an id") as e:
                arm_a.ask("bad episode", "asked", 1.0)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(ValueError, match=r"^reason: expected 1 to 256"):
                arm_a.ask("arm-a-ep2", "x" * 300, 1.0)
            with pytest.raises(HelpError, match="NOT_FOUND: request_id: no help request 999"):
                arm_a.status(999)
            with pytest.raises(HelpError, match=r"INVALID_ARGUMENT: request_id: expected 1 \.\. "):
                arm_a.status(2**64 - 1)
            done = arm_a.withdraw(req.request_id)
            assert (done.status, done.note, done.closed) == ("resolved", "withdrawn by the robot", True)
        # a robot's credential speaks for that robot only, and reads only its own requests
        with HelpClient(c.address, "arm-a", token=tokens["arm-b"]) as impostor:
            with pytest.raises(
                HelpError, match="PERMISSION_DENIED: robot_id: this credential is robot 'arm-b'"
            ):
                impostor.ask("arm-a-ep3", "asked", 1.0)
            with pytest.raises(HelpError, match="PERMISSION_DENIED: request_id"):
                impostor.status(req.request_id)
        stranger = HelpClient(c.address, "arm-a", token="wrong-token-wrong-token")
        with stranger, pytest.raises(HelpError, match="UNAUTHENTICATED"):
            stranger.ask("arm-a-ep3", "asked", 1.0)
        # bytes that are not a HelpAsk: refused, the stream-less call answers INVALID_ARGUMENT
        with grpc.insecure_channel(c.address) as ch:
            call = ch.unary_unary("/vla_rl.fleet.v1.Collector/RequestHelp")
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {tokens['arm-a']}"),), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_sim_robots_hook_asks_once_per_episode_and_keeps_a_claimed_request(tmp_path: Path) -> None:
    """sim.help_hook: the failure predictor's alarm asks with its score as urgency, the uncertainty alarm
    with the standardised score; one request per episode; a claimed request outlives the episode."""
    from types import SimpleNamespace

    from sim.help_hook import HelpAsker, alarm
    from sim.operator import OperatorRules

    rules = OperatorRules(uncertainty_h=2.0, uncertainty_mean=0.5, uncertainty_std=0.25)
    calm = SimpleNamespace(rules=rules, cusum=1.0)
    alarmed = SimpleNamespace(rules=rules, cusum=2.5)
    chunk = SimpleNamespace(failure=float("nan"), failure_alarm=False, uncertainty=1.5)
    assert alarm(chunk, calm) is None
    assert alarm(chunk, alarmed) == ("uncertainty: CUSUM 2.50 > 2.00", pytest.approx(4.0))
    failing = SimpleNamespace(failure=0.87, failure_alarm=True, uncertainty=0.5)
    assert alarm(failing, calm) == ("failure predictor: 0.87 on this chunk", pytest.approx(0.87))

    with Collector(CollectorConfig(store=tmp_path / "s", port=0, chunk_len=16)) as c:
        asker = HelpAsker(c.address, "sim-0", None)
        asker.on_chunk("sim-0-ep1", chunk, calm)
        assert c.db.help_queue() == []
        asker.on_chunk("sim-0-ep1", failing, calm)
        asker.on_chunk("sim-0-ep1", chunk, alarmed)  # the episode asked already
        (req,) = c.db.help_queue()
        assert (req.episode_id, req.urgency) == ("sim-0-ep1", pytest.approx(0.87))
        c.db.claim_help("ana", req.id)
        asker.end_episode()  # claimed: a person has it, the robot does not withdraw it
        assert c.db.help_request(req.id).status == "claimed"
        asker.on_chunk("sim-0-ep2", chunk, alarmed)
        asker.end_episode()  # nobody took it: withdrawn
        assert [r.status for r in c.db.help_queue(statuses=("resolved",))] == ["resolved"]
        assert asker.asked == 2
        asker.close()


def test_an_operator_claims_and_resolves_through_the_collector(
    tmp_path: Path, store_db_url: str | None
) -> None:
    """ClaimHelp / ResolveHelp (vla_rl_client.help_client.OperatorClient): the shared credential claims the
    next request, the robot learns who, the operator resolves it; a robot's own credential may not act as an
    operator; nothing open -> None."""
    from vla_rl_client.help_client import OperatorClient

    shared, tokens = "s" * 24, {"arm-a": "a" * 20}
    cfg = CollectorConfig(store=tmp_path / "s", port=0, chunk_len=16, db=store_db_url)
    with Collector(cfg, token=shared, robot_tokens=tokens) as c:
        with (
            HelpClient(c.address, "arm-a", token=tokens["arm-a"]) as arm,
            OperatorClient(c.address, "sim-operator-0", token=shared) as op,
            OperatorClient(c.address, "sim-operator-1", token=shared) as other,
        ):
            assert op.claim_next() is None
            low = arm.ask("arm-a-ep1", "asked", 1.0)
            high = arm.ask("arm-a-ep2", "failure predictor: 0.9", 2.0)
            got = op.claim_next()
            assert got is not None and (got.request_id, got.status, got.claimed_by) == (
                high.request_id,
                "claimed",
                "sim-operator-0",
            )
            assert (got.robot_id, got.episode_id, got.urgency) == ("arm-a", "arm-a-ep2", 2.0)
            assert got.created_at > 0 and got.claimed_at >= got.created_at
            assert arm.status(high.request_id).claimed_by == "sim-operator-0"
            with pytest.raises(
                HelpError, match=r"FAILED_PRECONDITION: request_id: .* claimed by sim-operator-0"
            ):
                other.claim(high.request_id)
            with pytest.raises(HelpError, match=r"FAILED_PRECONDITION: .*claimed by sim-operator-0, not"):
                other.resolve(high.request_id)
            done = op.resolve(high.request_id, "drove 15 steps")
            assert (done.status, done.note) == ("resolved", "drove 15 steps")
            assert c.db.help_request(high.request_id).note == "drove 15 steps"
            with pytest.raises(HelpError, match=r"FAILED_PRECONDITION: request_id: .*already resolved"):
                op.resolve(high.request_id)
            with pytest.raises(HelpError, match="NOT_FOUND: request_id: no help request 999"):
                op.claim(999)
            with pytest.raises(HelpError, match=r"INVALID_ARGUMENT: request_id: expected 1 \.\. "):
                op.resolve(0)
            with pytest.raises(HelpError, match="INVALID_ARGUMENT: operator: expected at most 64"):
                OperatorClient(c.address, "x" * 65, token=shared).claim_next()
            with pytest.raises(HelpError, match="INVALID_ARGUMENT: operator: 'arm-a' is the robot"):
                OperatorClient(c.address, "arm-a", token=shared).resolve(low.request_id)
        # a robot's own credential never acts as an operator
        with OperatorClient(c.address, "sim-operator-0", token=tokens["arm-a"]) as robot_as_op:
            with pytest.raises(HelpError, match="PERMISSION_DENIED: operator: this credential is robot"):
                robot_as_op.claim_next()
            with pytest.raises(HelpError, match="PERMISSION_DENIED"):
                robot_as_op.resolve(low.request_id)
        assert c.db.help_request(low.request_id).status == "open"
        with pytest.raises(ValueError, match="operator"):
            OperatorClient(c.address, " ")

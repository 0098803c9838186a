"""The canary (vla_rl/canary.py): its decision on unpaired fleet outcomes (Fisher's exact one-sided test),
the episodes it counts, the refs it moves, and the per-robot model a share of the simulated fleet asks for
(sim/fleet_runner.py) from a server that serves and follows the canary beside prod (server/config.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vla_rl_client.meta import Controller, EpisodeRecord, Segment, SegmentKind

from server.config import ServerConfig
from sim.fleet_runner import FleetConfig
from vla_rl import canary as canary_mod
from vla_rl.canary import ArmCounts, arm_counts, canary_since, check_canary, decide_canary

scipy_stats = pytest.importorskip("scipy.stats")


def _fisher(c: ArmCounts, p: ArmCounts) -> float:
    table = [[c.successes, c.episodes - c.successes], [p.successes, p.episodes - p.successes]]
    return scipy_stats.fisher_exact(table, alternative="greater").pvalue


def test_the_canary_waits_then_promotes_only_a_significant_gain() -> None:
    prod = ArmCounts("p", 100, 50)
    early = decide_canary(ArmCounts("c", 40, 30), ArmCounts("p", 40, 20), episodes=100)
    assert early.action == "wait" and "100 episodes an arm needed" in early.why  # even if it looks better
    better = decide_canary(ArmCounts("c", 100, 66), prod, episodes=100)
    assert better.action == "promote" and better.p_better == pytest.approx(_fisher(better.canary, prod))
    assert better.p_better <= 0.05 and "better than prod: canary 66/100 vs prod 50/100" in better.why
    noise = decide_canary(ArmCounts("c", 100, 55), prod, episodes=100)
    assert noise.action == "rollback" and noise.p_better > 0.05 and "not shown better" in noise.why
    assert noise.p_worse == pytest.approx(_fisher(prod, noise.canary))


def test_a_worse_canary_is_rolled_back_before_the_budget() -> None:
    d = decide_canary(ArmCounts("c", 30, 5), ArmCounts("p", 30, 18), episodes=100)
    assert d.action == "rollback" and d.p_worse <= 0.05 and d.why.startswith("worse than prod")
    assert d.to_dict()["canary"] == {"revision": "c", "episodes": 30, "successes": 5}


@pytest.mark.parametrize(
    ("kw", "message"), [({"alpha": 0.0}, "alpha: expected"), ({"episodes": 0}, "episodes: expected")]
)
def test_decide_canary_validates(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decide_canary(ArmCounts("c", 1, 1), ArmCounts("p", 1, 0), **kw)


def _ep(rev: tuple[str, ...], success: bool | None, takeover: bool = False) -> EpisodeRecord:
    segs = (Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 5),)
    if takeover:
        segs += (Segment(1, SegmentKind.INTERVENTION, Controller.HUMAN, 5, 9),)
    return EpisodeRecord("e", "sim-0", "t", "", "", "closed", None, success, 9, 0.0, 1.0, rev, segs)


def test_arm_counts_take_autonomous_successes_of_one_revision_alone() -> None:
    records = [
        _ep(("c",), True),
        _ep(("c", ""), True, takeover=True),  # counted (the operator's frames: no revision), not autonomous
        _ep(("c",), False),
        _ep(("p", "c"), True),  # a swap mid-episode: neither arm's
        _ep(("c",), None),  # no outcome
        _ep(("p",), True),
    ]
    assert arm_counts(records, "c") == ArmCounts("c", 3, 1)
    assert arm_counts(records, "p") == ArmCounts("p", 1, 1)
    assert ArmCounts("x", 0, 0).rate is None and ArmCounts("c", 4, 1).rate == 0.25


def test_check_canary_moves_the_refs_its_decision_names(monkeypatch: pytest.MonkeyPatch) -> None:
    refs = {"hub://org/arm@canary": "c", "hub://org/arm@prod": "p"}
    moves: list[tuple[str, str, str]] = []
    monkeypatch.setattr(canary_mod, "resolve", lambda ref: refs[ref])
    monkeypatch.setattr(canary_mod, "move_ref", lambda repo, name, rev: moves.append((repo, name, rev)))
    asked: list[Any] = []
    eps = [_ep(("c",), i < 70) for i in range(100)] + [_ep(("p",), i < 50) for i in range(100)]
    rounds = [
        SimpleNamespace(checkpoint_revision="c", finished_at=123.0),
        SimpleNamespace(checkpoint_revision="x", finished_at=999.0),
    ]
    db = SimpleNamespace(select_records=lambda q: asked.append(q) or eps, rounds=lambda: rounds)
    assert canary_since(db, "c") == 123.0 and canary_since(db, "zz") is None  # type: ignore[arg-type]
    d = check_canary(db, "org/arm", task="t")  # type: ignore[arg-type]
    assert d.action == "promote" and moves == [("org/arm", "prod", "c")]
    assert asked[0].since == 123.0 and set(asked[0].revisions) == {"c", "p"} and asked[0].task == "t"
    eps[:] = [_ep(("c",), i < 50) for i in range(100)] + [_ep(("p",), i < 50) for i in range(100)]
    assert check_canary(db, "org/arm", since=5.0).action == "rollback"  # type: ignore[arg-type]
    assert moves[-1] == ("org/arm", "canary", "p") and asked[-1].since == 5.0
    refs["hub://org/arm@canary"] = "p"
    with pytest.raises(ValueError, match="no candidate on the canary"):
        check_canary(db, "org/arm")  # type: ignore[arg-type]
    monkeypatch.setattr(canary_mod, "resolve", lambda ref: pytest.fail(f"asked the Hub for {ref}"))
    with pytest.raises(ValueError, match="alpha: expected a false-promotion rate"):
        check_canary(db, "org/arm", alpha=0.0)  # type: ignore[arg-type]


def test_a_share_of_the_fleet_asks_for_the_canary_model() -> None:
    assert FleetConfig(robots=4).canary_robots == 0
    assert FleetConfig(robots=4, canary_share=0.25).canary_robots == 1
    assert FleetConfig(robots=4, canary_share=0.9).canary_robots == 3  # prod keeps at least one robot
    assert FleetConfig(robots=12, canary_share=0.01).canary_robots == 1  # and the canary at least one
    with pytest.raises(ValueError, match="canary_share: expected a share of the robots in \\[0, 1\\)"):
        FleetConfig(robots=4, canary_share=1.0)
    with pytest.raises(ValueError, match="canary_share: a canary needs at least 2 robots"):
        FleetConfig(robots=1, canary_share=0.5)


def test_the_server_serves_and_follows_the_canary_beside_prod() -> None:
    plain = ServerConfig(checkpoint="hub://org/arm@prod", follow="self")
    assert plain.models() == {"default": "hub://org/arm@prod"} and plain.follow_map() == {
        "default": "hub://org/arm@prod"
    }
    both = ServerConfig(checkpoint="hub://org/arm@prod", follow="self", canary="hub://org/arm@canary")
    assert both.models() == {"default": "hub://org/arm@prod", "canary": "hub://org/arm@canary"}
    assert both.follow_map() == both.models()
    unfollowed = ServerConfig(checkpoint="hub://org/arm@prod", canary="hub://org/arm@canary")
    assert unfollowed.follow_map() == {"canary": "hub://org/arm@canary"}  # the canary always follows its ref
    with pytest.raises(ValueError, match="canary_model_id: expected a name other than --model-id"):
        ServerConfig(checkpoint="x", canary="y", canary_model_id="default")


def test_the_canary_share_of_a_live_fleet_runs_the_canary_and_is_counted_apart(tmp_path: Path) -> None:
    """A server serving prod and the canary (two checkpoints), a fleet of 2 with canary share 0.5: robot
    sim-0's episodes are acted in by the canary's revision alone, sim-1's by prod's, and the canary's
    counts read them apart from the metadata DB."""
    from test_sim_fleet import TOKEN, task_spec, tiny_checkpoint

    from fleet.collector import Collector, CollectorConfig
    from fleet.db import MetadataDB
    from fleet.selection import Selection
    from server.policy_server import PolicyServer
    from sim.fleet_runner import run_sim_fleet

    prod_ckpt = tiny_checkpoint(tmp_path / "prod", task_spec(), seed=0)
    canary_ckpt = tiny_checkpoint(tmp_path / "canary", task_spec(), seed=1)
    config = ServerConfig(checkpoint=str(prod_ckpt), model_id="push", port=0, torch_threads=1, device="cpu")
    server = PolicyServer(
        config, models={"push": str(prod_ckpt), "canary": str(canary_ckpt)}, token="x"
    ).start()
    collector = Collector(
        CollectorConfig(store=tmp_path / "store", port=0, chunk_len=16), token=TOKEN
    ).start()
    try:
        cfg = FleetConfig(
            progress=False,
            robots=2,
            canary_share=0.5,
            model_id="push",
            server=server.address,
            collector=collector.address,
            episodes=2,
            max_episode_steps=15,
            collector_token=TOKEN,
        )
        result = run_sim_fleet(cfg)
        assert result.errors == []
        assert collector.drain(60)
        prod_rev, canary_rev = server.slots["push"].active.commit, server.slots["canary"].active.commit
    finally:
        collector.stop()
        server.stop()
    assert prod_rev != canary_rev
    records = MetadataDB.for_store(tmp_path / "store").select_records(Selection())
    by_robot = {r.robot_id: set() for r in records}
    for r in records:
        by_robot[r.robot_id] |= set(r.revisions) - {""}
    assert by_robot == {"sim-0": {canary_rev}, "sim-1": {prod_rev}}
    assert arm_counts(records, canary_rev).episodes == 2 and arm_counts(records, prod_rev).episodes == 2

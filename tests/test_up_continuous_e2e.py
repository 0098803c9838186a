"""`vla-rl up --continuous` end to end at CI scale (slow: two rounds with the fleet running throughout): the
fleet records episodes while each round trains, each round trains on its snapshot (nothing closed after it
was queued), the second round triggers on episodes closed after the first one's snapshot, rounds never
overlap, the round's process runs at --trainer-nice, and the promoted checkpoint reaches the robots
without stopping them, at chunk boundaries (every chunk of every episode is one commit's).

Real processes throughout, on the kinematic test bed with the smoke-test round recipe (as tests/test_up.py);
promotion is forced (margin -0.99, gate_alpha 1, no report episodes): this checks the machinery."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from processes import run_watching
from vla_rl_client.meta import SegmentKind

from fleet.selection import Selection
from fleet.store import EpisodeStore
from vla_rl.cli.common import open_db

CLI = [sys.executable, "-m", "vla_rl.cli"]
ROBOTS, EPISODES, NICE = 2, 2, 7


def _up(work: Path) -> list[str]:
    return [
        *CLI, "up", "--continuous", "--trainer-nice", str(NICE), "--task", "kinematic/Reach-v0",
        "--robots", str(ROBOTS), "--episodes", str(EPISODES), "--rounds", "2", "--base-demos", "4",
        "--base-steps", "20", "--base-preset", "kinematic-sft", "--preset", "tiny-awr", "--eval-episodes", "4",
        "--margin", "-0.99", "--gate-alpha", "1", "--report-episodes", "0", "--no-dashboard",
        "--workdir", str(work), "--no-progress",
    ]  # fmt: skip


class _RoundNice:
    """Watches for the worker's round process (a spawned child of ``vla-rl round worker`` of this workdir)
    and records its niceness against the worker's (the worker's before the child renices itself, on its
    way up); says True once it saw the round's."""

    def __init__(self, work: Path) -> None:
        self.work, self.seen = str(work), []  # type: ignore[var-annotated]

    def __call__(self) -> bool:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "worker" in cmd and any(self.work in c for c in cmd):
                try:
                    rounds = [c for c in p.children() if "spawn_main" in " ".join(c.cmdline())]
                    self.seen += [(c.nice(), p.nice()) for c in rounds]
                except psutil.Error:
                    continue
        return any(child == worker + NICE for child, worker in self.seen)


def _n_exec(work: Path) -> int:
    """Actions a robot executes per chunk: the trained checkpoint's model config says."""

    def find(x: Any) -> int | None:
        if isinstance(x, dict):
            if isinstance(x.get("n_exec"), int):
                return int(x["n_exec"])
            return next((v for v in map(find, x.values()) if v is not None), None)
        return None

    for path in sorted((work / "rounds").rglob("config.json")):
        n = find(json.loads(path.read_text()))
        if n is not None:
            return n
    raise AssertionError("no checkpoint config names n_exec")


def _chunks_are_one_commit(store: EpisodeStore, eid: str, n_exec: int) -> set[str]:
    """The commits that acted in episode ``eid``, after checking that every chunk (``n_exec`` policy frames
    from an autonomous segment's start on) is one commit's and names it."""
    meta = store.read_metadata(eid)
    arrays = store.read_arrays(eid, ["revision", "controller"])
    revs = [meta.revisions[int(i)] if int(i) >= 0 else "" for i in arrays["revision"]]
    acted: set[str] = set()
    for seg in meta.segments:
        if seg.kind != SegmentKind.AUTONOMOUS:
            continue
        end = meta.length if seg.end is None else seg.end
        for a in range(seg.start, end, n_exec):
            chunk = {revs[t] for t in range(a, min(a + n_exec, end)) if int(arrays["controller"][t]) == 0}
            assert len(chunk) <= 1 and "" not in chunk, (eid, a, chunk)
            acted |= chunk
    return acted


@pytest.mark.slow
def test_continuous_up_keeps_the_fleet_working_while_rounds_train(tmp_path: Path) -> None:
    work = tmp_path / "up"
    nice = _RoundNice(work)
    r, seen = run_watching(_up(work), tmp_path / "up-run", 900, nice)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "fleet      continuous: it keeps working while a round trains" in r.stdout
    assert "successful / h" in r.stdout and "utilisation" in r.stdout  # the activity table
    assert seen and all(child in (worker, worker + NICE) for child, worker in nice.seen), nice.seen

    db = open_db(work / "store", None)
    rounds = db.rounds()
    assert [x.status for x in rounds] == ["succeeded", "succeeded"] and all(x.promoted for x in rounds)
    snaps = []
    for rec in rounds:
        snap = Selection.parse(rec.config["train"]["data"]).closed_until
        assert snap is not None and snap <= rec.created_at
        assert rec.data["selection"]["closed_until"] == snap
        # the round trained on exactly the episodes closed by its snapshot ...
        assert rec.data["episodes"] == len(db.select_ids(Selection(task=rec.task, closed_until=snap)))
        # ... while the fleet went on recording episodes (none of which it trained on)
        assert rec.finished_at is not None
        during = db.select_ids(
            Selection(robots=("sim-*",), closed_since=rec.created_at, closed_until=rec.finished_at)
        )
        assert during, f"round {rec.id}: the fleet recorded nothing while it trained"
        snaps.append(snap)
    first, second = rounds
    assert first.finished_at is not None and second.created_at >= first.finished_at  # never two at once
    fresh = db.select_ids(Selection(robots=("sim-*",), closed_since=snaps[0] + 1e-6, closed_until=snaps[1]))
    assert len(fresh) >= ROBOTS * EPISODES  # the trigger: new episodes since the first round's snapshot

    rows = [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()]
    assert [row["mode"] for row in rows] == ["continuous", "continuous"]
    for row in rows:
        a = row["activity"]
        assert a["episodes"] > 0 and 0.0 < a["utilisation"] <= 1.0 and a["successes_per_hour"] is not None
    assert rows[1]["activity"]["start"] == pytest.approx(rows[0]["activity"]["end"])  # contiguous windows

    # the swap: the fleet acted under round 1's commit without stopping, each chunk one commit's
    store = EpisodeStore(work / "store")
    n_exec = _n_exec(work)
    fleet = [e for e in store.episode_ids() if store.read_metadata(e).robot_id.startswith("sim-")]
    acted = {e: _chunks_are_one_commit(store, e, n_exec) for e in fleet}
    assert first.checkpoint_revision in set(itertools.chain(*acted.values()))
    mixed = [e for e, revs in acted.items() if len(revs) > 1]
    print(
        f"{len(fleet)} fleet episodes, {len(mixed)} swapped mid-episode (at a chunk boundary), n_exec {n_exec}"
    )
    assert np.isfinite(rows[-1]["minutes"])

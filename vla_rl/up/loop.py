"""The round loop of ``vla-rl up`` (:func:`run_up`): start the services, seed the base, then per round a
fleet batch, a queued round, its row. The package docstring (:mod:`vla_rl.up`) tells the whole story."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vla_rl.core.console import table
from vla_rl.core.seeds import ONLINE
from vla_rl.core.supervisor import Supervisor, http_child, tcp_ready
from vla_rl.up.activity import HEADER as ACTIVITY_HEADER
from vla_rl.up.activity import NOTE as ACTIVITY_NOTE
from vla_rl.up.activity import activity_cells, fleet_activity, overall, wait_closed
from vla_rl.up.base import seed_base
from vla_rl.up.children import STOP_ORDER, child_argv, child_configs
from vla_rl.up.config import UpConfig
from vla_rl.up.continuous import FOREVER_EPISODES, after, last_snapshot, snapshot_data, wait_for_trigger
from vla_rl.up.lerobot import policy_line
from vla_rl.up.report import HEADER, NOTE, fleet_summary, round_cells, round_line, round_row, summarise
from vla_rl.up.threads import training_threads
from vla_rl.up.workdir import Ports, shown_db_url, split_db_password, workdir_db, workdir_secret

if TYPE_CHECKING:
    from fleet.db import MetadataDB, RoundRecord
    from sim.fleet_runner import FleetConfig
    from vla_rl.rounds import RoundConfig

ROBOT_PREFIX = "sim"
"""The simulated fleet's robots are ``sim-0``, ``sim-1``, ...; the base's demos are not theirs."""


def run_up(cfg: UpConfig) -> list[dict[str, Any]]:
    """Run the loop; returns one row per round run by this call (also printed)."""
    from fleet.db import MetadataDB, default_url
    from fleet.selection import Selection
    from vla_rl.hub.registry import configure_hub

    Selection.parse(cfg.data, task=cfg.task)  # a bad --data fails now, not in every round
    work = cfg.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "up.json"
    store = work / "store"
    old = json.loads(state_path.read_text()) if state_path.exists() else {}
    # a workdir of a run before --db existed (no "db" key) used the store's SQLite
    recorded = old.get("db", shown_db_url(default_url(store)) if old else None)
    db_url = workdir_db(cfg.db, recorded, store)
    _check_same_policy(cfg, old)
    store.mkdir(exist_ok=True)  # the default SQLite file lives in it
    ports = Ports.load_or_pick(state_path)
    state = {"ports": vars(ports), "repo": cfg.repo, "task": cfg.task, "db": shown_db_url(db_url)}
    state["policy"] = cfg.policy
    state_path.write_text(json.dumps(state, indent=2))
    tokens = {k: workdir_secret(work / "secrets" / k) for k in ("hub", "collector", "server", "dashboard")}
    hub_url = f"http://127.0.0.1:{ports.hub}"
    db_url, db_env = split_db_password(db_url)  # the password goes through the environment
    env = {
        "VLA_RL_HUB": hub_url,
        "VLA_RL_HUB_TOKEN": tokens["hub"],
        "VLA_RL_COLLECTOR_TOKEN": tokens["collector"],
        "VLA_RL_SERVER_TOKEN": tokens["server"],
        **db_env,
    }
    os.environ.update(env)
    configure_hub(hub_url, tokens["hub"])
    sup = Supervisor(work / "logs")
    rows: list[dict[str, Any]] = []
    prod = f"hub://{cfg.repo}@prod"
    nice = cfg.trainer_nice if cfg.continuous else 0
    children = child_configs(
        work, store, db_url, hub_url, ports, cfg.repo, served=prod, round_nice=nice, continuous=cfg.continuous
    )
    try:
        hub_ready, hub_env = http_child(f"{hub_url}/api/health")
        sup.start(
            "hub",
            child_argv("hub", children["hub"], work),
            hub_ready,
            env | hub_env,
            stop_order=STOP_ORDER["hub"],
        )
        seed_base(cfg, work, store, prod, db_url)
        policy = policy_line(cfg, work)
        db = MetadataDB(db_url)
        done = len(db.rounds())
        if done >= cfg.rounds:
            print(
                f"vla-rl up: {cfg.workdir} already holds {done} rounds (--rounds {cfg.rounds} counts them): "
                f"pass --rounds {done + cfg.rounds} for {cfg.rounds} more, or another --workdir to start over; "
                f"`vla-rl round list --store {store}` shows them",
                flush=True,
            )
            return rows
        dashboard_url = f"http://127.0.0.1:{ports.dashboard}"
        if cfg.dashboard:
            dash = f"{dashboard_url}   operator token in {work / 'secrets' / 'dashboard'}"
        else:
            dash = "off (--no-dashboard)"
        print(
            f"vla-rl up: {cfg.robots} robots on {cfg.task}, {cfg.rounds} rounds of {cfg.algo if not cfg.preset else cfg.preset}\n"
            f"  policy     {policy}\n"
            f"  registry   {hub_url}   policy server 127.0.0.1:{ports.server}   collector 127.0.0.1:{ports.collector}\n"
            f"  dashboard  {dash}\n"
            f"  fleet      {_fleet_line(cfg)}\n"
            f"  store      {store}   db {shown_db_url(db_url)}   logs {work / 'logs'}\n"
            "  stop with Ctrl-C (everything stops within seconds; run the same command again to resume)",
            flush=True,
        )
        services = (
            ("server", tcp_ready(ports.server)),
            ("collector", tcp_ready(ports.collector)),
            ("worker", lambda: True),
        )
        for name, ready in services:
            sup.start(name, child_argv(name, children[name], work), ready, env, stop_order=STOP_ORDER[name])
        if cfg.dashboard:

            def dashboard_child(port: int) -> tuple[list[str], Callable[[], bool], dict[str, str]]:
                # the ready check believes only an answer carrying this child's nonce (not another
                # process that took the port: then start_on_port picks another one)
                ready, nonce_env = http_child(f"http://127.0.0.1:{port}/api/v1/health")
                argv = child_argv("dashboard", dataclasses.replace(children["dashboard"], port=port), work)
                return argv, ready, env | nonce_env | {"VLA_RL_DASHBOARD_TOKEN": tokens["dashboard"]}

            port = sup.start_on_port(
                "dashboard",
                ports.dashboard,
                dashboard_child,
                timeout_s=60,
                stop_order=STOP_ORDER["dashboard"],
            )
            if port is None:
                print(f"  dashboard  did not start; see {work / 'logs' / 'dashboard.log'}", flush=True)
            elif port != ports.dashboard:
                ports = dataclasses.replace(ports, dashboard=port)
                state["ports"] = vars(ports)
                state_path.write_text(json.dumps(state, indent=2))
                print(f"  dashboard  its port was taken meanwhile: now http://127.0.0.1:{port}", flush=True)
        run = _Run(cfg, db, sup, work, store, prod, db_url, ports, env, policy)
        with sup.watching():
            rows = _continuous_rounds(run) if cfg.continuous else _batch_rounds(run)
        if rows:
            _print_tables(cfg, rows, policy)
        for r in rows:
            if r["status"] != "succeeded":
                print(f"round {r['round']} {r['status']}, prod unchanged: {r['error']}", flush=True)
        for e in sup.events:
            print(f"supervisor: {e}", flush=True)
    finally:
        sup.stop_all()
    return rows


@dataclass
class _Run:
    """What the rounds of one ``up`` run share: its flags, metadata DB, supervisor and services."""

    cfg: UpConfig
    db: MetadataDB
    sup: Supervisor
    work: Path
    store: Path
    prod: str
    db_url: str
    ports: Ports
    env: dict[str, str]
    policy: str

    def fleet(self, n: int, episodes: int) -> FleetConfig:
        """The simulated fleet's config: ``episodes`` per robot, seeded for round ``n``."""
        from sim.fleet_runner import FleetConfig

        cfg = self.cfg
        return FleetConfig(
            robots=cfg.robots,
            episodes=episodes,
            operators=cfg.operators,
            rules=cfg.operator_rules(),
            task=cfg.task,
            server=f"127.0.0.1:{self.ports.server}",
            collector=f"127.0.0.1:{self.ports.collector}",
            seed=ONLINE + cfg.seed * 1_000_000 + n * 10_000,
            progress=False,
            rtc=cfg.rtc,
            help_requests=cfg.help_requests,
        )

    def round_config(self, n: int, data: str | None) -> RoundConfig:
        """Round ``n``'s config, training on ``data``."""
        return _round_config(self.cfg, n, self.prod, self.store, self.work, self.db_url, data)

    def finish(self, rid: int, fleet: dict[str, Any], start: float) -> dict[str, Any]:
        """Wait for round ``rid``, queued after the fleet did ``fleet`` (a summary); its row (printed,
        appended to rounds.jsonl), its window ``start`` .. now in the fleet's activity."""
        from fleet.store import EpisodeStore
        from vla_rl.hub.registry import resolve

        rec = _wait_round(self.db, rid, self.cfg.round_timeout_s)
        end = time.time()
        row = round_row(rid, rec, fleet, (end - start) / 60, resolve(self.prod), self.sup.events)
        row["policy"] = self.policy
        row["mode"] = "continuous" if self.cfg.continuous else "batch"
        wait_closed(self.db, start, end, ROBOT_PREFIX)  # the episodes running at `end` too
        store = EpisodeStore(self.store)
        row["activity"] = fleet_activity(self.db, store, start, end, self.cfg.robots, ROBOT_PREFIX)
        print(round_line(row), flush=True)
        with (self.work / "rounds.jsonl").open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row


def _batch_rounds(run: _Run) -> list[dict[str, Any]]:
    """The rounds the batch way: per round, the fleet collects its batch under prod and stops, then the
    round trains on everything so far."""
    from vla_rl.rounds import queue_round

    cfg, rows = run.cfg, []
    while len(run.db.rounds()) < cfg.rounds:
        n = len(run.db.rounds()) + 1
        start = time.time()
        run.sup.run(
            "fleet",
            child_argv("fleet", run.fleet(n, cfg.episodes), run.work, file=f"fleet-round-{n}"),
            run.env,
            run.work / "logs" / f"fleet-round-{n}.log",
            stop_order=STOP_ORDER["fleet"],
        )
        summary = _wait_fleet_episodes(run.db, start, cfg.robots * cfg.episodes)
        rid = queue_round(run.round_config(n, cfg.data), run.db)
        rows.append(run.finish(rid, summary, start))
    return rows


def _continuous_rounds(run: _Run) -> list[dict[str, Any]]:
    """The rounds the continuous way (:mod:`vla_rl.up.continuous`): the fleet works under prod throughout;
    a round is queued once it closed its episodes after the previous round's snapshot, and trains on the
    episodes closed by then."""
    from fleet.selection import Selection
    from vla_rl.rounds import queue_round

    cfg, db, rows = run.cfg, run.db, []
    n = len(db.rounds()) + 1
    fleet = child_argv("fleet", run.fleet(n, FOREVER_EPISODES), run.work, file="fleet-continuous")
    run.sup.start("fleet", fleet, lambda: True, run.env, stop_order=STOP_ORDER["fleet"])
    start, snapshot = time.time(), last_snapshot(db)
    while len(db.rounds()) < cfg.rounds:
        n = len(db.rounds()) + 1
        needed = cfg.robots * cfg.episodes
        at = wait_for_trigger(db, snapshot, needed, ROBOT_PREFIX, cfg.round_timeout_s, run.sup.check)
        new = Selection(robots=(f"{ROBOT_PREFIX}-*",), closed_since=after(snapshot), closed_until=at)
        rid = queue_round(run.round_config(n, snapshot_data(cfg.data, at)), db)
        rows.append(run.finish(rid, summarise(db.select_records(new)), start))
        start, snapshot = rows[-1]["activity"]["end"], at
    return rows


def _fleet_line(cfg: UpConfig) -> str:
    """How the fleet runs, as the start-up lines say it."""
    every = f"a round every {cfg.robots * cfg.episodes} fleet episodes"
    if cfg.operator_mode == "requests":
        every += f"; {cfg.operators} simulated operators answer the help queue"
    if cfg.continuous:
        return (
            f"continuous: it keeps working while a round trains ({every}; rounds at nice +{cfg.trainer_nice})"
        )
    return f"batch: it stops while a round trains ({every}; --continuous keeps it working)"


def _print_tables(cfg: UpConfig, rows: list[dict[str, Any]], policy: str) -> None:
    """The tables printed at the end: the rounds, then the fleet's activity per round and overall."""
    print()
    print(f"policy: {policy}", flush=True)
    print(table([round_cells(r) for r in rows], HEADER), flush=True)
    print(NOTE, flush=True)
    print()
    print(f"fleet ({'continuous' if cfg.continuous else 'batch'}, {cfg.robots} robots):", flush=True)
    whole = overall([r["activity"] for r in rows])
    assert whole is not None
    cells = [*(activity_cells(r["round"], r["activity"]) for r in rows), activity_cells("all", whole)]
    print(table(cells, ACTIVITY_HEADER), flush=True)
    print(ACTIVITY_NOTE, flush=True)


def _check_same_policy(cfg: UpConfig, old: dict[str, Any]) -> None:
    """A workdir's registry, store and rounds belong to one policy: a run naming another is refused (a
    workdir of a run before --policy existed ran flowvla)."""
    recorded = old.get("policy", "flowvla") if old else None
    if recorded is not None and recorded != cfg.policy:
        raise ValueError(
            f"policy: this workdir's earlier run improved {recorded}, not {cfg.policy}: resume with "
            f"--policy {recorded}, or start over in another --workdir"
        )


def _wait_fleet_episodes(
    db: MetadataDB, since: float, expected: int, timeout_s: float = 120
) -> dict[str, Any]:
    """The summary of the fleet's batch (robots ``sim-*``, episodes since ``since``) once the DB holds its
    ``expected`` episodes closed, or after ``timeout_s``: the collector acknowledges into its log first, so
    the store and the DB (what the round selects from) follow a moment later."""
    deadline = time.monotonic() + timeout_s
    summary = fleet_summary(db, since, ROBOT_PREFIX)
    while summary["episodes"] < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        summary = fleet_summary(db, since, ROBOT_PREFIX)
    return summary


def _round_config(
    cfg: UpConfig, n: int, prod: str, store: Path, work: Path, db_url: str, data: str | None
) -> RoundConfig:
    """Round ``n``'s config: cfg's algorithm or preset trained on top of ``prod`` on ``data`` (selection
    text; None = every episode of the task), on the cores idle now."""
    from vla_rl.rounds import RoundConfig
    from vla_rl.train.algorithms import make_config
    from vla_rl.train.presets import preset_config

    common: dict[str, Any] = {
        "base": prod,
        "store": store,
        "out": work / "rounds",
        "db_url": db_url,
        "seed": cfg.seed + n,
        "progress": False,
        "threads": training_threads(),
    }
    if data is not None:
        common["data"] = data
    if cfg.round_steps is not None:
        common["steps"] = cfg.round_steps
    train = preset_config(cfg.preset, **common) if cfg.preset else make_config(cfg.algo, **common)
    return RoundConfig(
        train=train,
        eval_episodes=cfg.eval_episodes,
        margin=cfg.margin,
        gate_alpha=cfg.gate_alpha,
        report_episodes=cfg.report_episodes,
        failure_predictor=cfg.failure_predictor,
        eval_envs=2,
        preset=cfg.preset,
    )


def _wait_round(db: MetadataDB, rid: int, timeout_s: float) -> RoundRecord:
    """Round ``rid``'s record once it finished (succeeded, failed or cancelled)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        rec = db.round(rid)
        if rec is not None and rec.status in ("succeeded", "failed", "cancelled"):
            return rec
        time.sleep(1.0)
    raise RuntimeError(f"round {rid} did not finish within {timeout_s:.0f} s; see the worker's log")

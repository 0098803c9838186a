"""The round loop of ``vla-rl up`` (:func:`run_up`): start the services, seed the base, then per round a
fleet batch, a queued round, its row. The package docstring (:mod:`vla_rl.up`) tells the whole story."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vla_rl.core.console import table
from vla_rl.core.seeds import ONLINE
from vla_rl.core.supervisor import Supervisor, http_child, tcp_ready
from vla_rl.up.base import seed_base
from vla_rl.up.children import STOP_ORDER, child_argv, child_configs
from vla_rl.up.config import UpConfig
from vla_rl.up.lerobot import policy_line
from vla_rl.up.report import HEADER, NOTE, fleet_summary, round_cells, round_line, round_row
from vla_rl.up.threads import training_threads
from vla_rl.up.workdir import Ports, shown_db_url, split_db_password, workdir_db, workdir_secret

if TYPE_CHECKING:
    from fleet.db import MetadataDB, RoundRecord
    from vla_rl.rounds import RoundConfig


def run_up(cfg: UpConfig) -> list[dict[str, Any]]:
    """Run the loop; returns one row per round run by this call (also printed)."""
    from fleet.db import MetadataDB, default_url
    from fleet.selection import Selection
    from sim.fleet_runner import FleetConfig
    from vla_rl.hub.registry import configure_hub, resolve
    from vla_rl.rounds import queue_round

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
    children = child_configs(work, store, db_url, hub_url, ports, cfg.repo, served=prod)
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
        with sup.watching():
            while len(db.rounds()) < cfg.rounds:
                n = len(db.rounds()) + 1
                t0, since = time.monotonic(), time.time()
                fleet = FleetConfig(
                    robots=cfg.robots,
                    episodes=cfg.episodes,
                    operators=cfg.operators,
                    task=cfg.task,
                    server=f"127.0.0.1:{ports.server}",
                    collector=f"127.0.0.1:{ports.collector}",
                    seed=ONLINE + cfg.seed * 1_000_000 + n * 10_000,
                    progress=False,
                    rtc=cfg.rtc,
                )
                sup.run(
                    "fleet",
                    child_argv("fleet", fleet, work, file=f"fleet-round-{n}"),
                    env,
                    work / "logs" / f"fleet-round-{n}.log",
                    stop_order=STOP_ORDER["fleet"],
                )
                summary = _wait_fleet_episodes(db, since, cfg.robots * cfg.episodes)
                rid = queue_round(_round_config(cfg, n, prod, store, work, db_url), db)
                rec = _wait_round(db, rid, cfg.round_timeout_s)
                row = round_row(rid, rec, summary, (time.monotonic() - t0) / 60, resolve(prod), sup.events)
                row["policy"] = policy
                rows.append(row)
                print(round_line(row), flush=True)
                with (work / "rounds.jsonl").open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
        if rows:
            print()
            print(f"policy: {policy}", flush=True)
            print(table([round_cells(r) for r in rows], HEADER), flush=True)
            print(NOTE, flush=True)
        for r in rows:
            if r["status"] != "succeeded":
                print(f"round {r['round']} {r['status']}, prod unchanged: {r['error']}", flush=True)
        for e in sup.events:
            print(f"supervisor: {e}", flush=True)
    finally:
        sup.stop_all()
    return rows


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
    summary = fleet_summary(db, since, "sim")
    while summary["episodes"] < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        summary = fleet_summary(db, since, "sim")
    return summary


def _round_config(cfg: UpConfig, n: int, prod: str, store: Path, work: Path, db_url: str) -> RoundConfig:
    """Round ``n``'s config: cfg's algorithm or preset trained on top of ``prod``, on the cores idle now."""
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
    if cfg.data is not None:
        common["data"] = cfg.data
    if cfg.round_steps is not None:
        common["steps"] = cfg.round_steps
    train = preset_config(cfg.preset, **common) if cfg.preset else make_config(cfg.algo, **common)
    return RoundConfig(
        train=train,
        eval_episodes=cfg.eval_episodes,
        margin=cfg.margin,
        gate_alpha=cfg.gate_alpha,
        report_episodes=cfg.report_episodes,
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

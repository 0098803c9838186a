"""The round loop of ``vla-rl up`` (:func:`run_up`): start the services, seed the base, then per round a
fleet batch, a queued round, its row. The package docstring (:mod:`vla_rl.up`) tells the whole story."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from vla_rl.core.console import table
from vla_rl.core.seeds import ONLINE
from vla_rl.core.supervisor import Supervisor, http_child, tcp_ready
from vla_rl.up.base import seed_base
from vla_rl.up.children import STOP_ORDER, child_argv, child_configs
from vla_rl.up.config import UpConfig
from vla_rl.up.report import HEADER, fleet_summary, pct
from vla_rl.up.threads import training_threads
from vla_rl.up.workdir import Ports, shown_db_url, split_db_password, workdir_db, workdir_secret


def run_up(cfg: UpConfig) -> list[dict[str, Any]]:
    """Run the loop; returns one row per round run by this call (also printed)."""
    from fleet.db import MetadataDB, default_url
    from fleet.selection import Selection
    from sim.fleet_runner import FleetConfig
    from vla_rl.hub.registry import configure_hub, resolve
    from vla_rl.rounds import RoundConfig, queue_round
    from vla_rl.train.algorithms import make_config
    from vla_rl.train.presets import preset_config

    Selection.parse(cfg.data, task=cfg.task)  # a bad --data fails now, not in every round
    work = cfg.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "up.json"
    store = work / "store"
    old = json.loads(state_path.read_text()) if state_path.exists() else {}
    # a workdir of a run before --db existed (no "db" key) used the store's SQLite
    recorded = old.get("db", shown_db_url(default_url(store)) if old else None)
    db_url = workdir_db(cfg.db, recorded, store)
    store.mkdir(exist_ok=True)  # the default SQLite file lives in it
    ports = Ports.load_or_pick(state_path)
    state = {"ports": vars(ports), "repo": cfg.repo, "task": cfg.task, "db": shown_db_url(db_url)}
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
            f"  registry   {hub_url}   policy server 127.0.0.1:{ports.server}   collector 127.0.0.1:{ports.collector}\n"
            f"  dashboard  {dash}\n"
            f"  store      {store}   db {shown_db_url(db_url)}   logs {work / 'logs'}\n"
            "  stop with Ctrl-C (everything stops within seconds; run the same command again to resume)",
            flush=True,
        )
        sup.start(
            "server",
            child_argv("server", children["server"], work),
            tcp_ready(ports.server),
            env,
            stop_order=STOP_ORDER["server"],
        )
        sup.start(
            "collector",
            child_argv("collector", children["collector"], work),
            tcp_ready(ports.collector),
            env,
            stop_order=STOP_ORDER["collector"],
        )
        sup.start(
            "worker",
            child_argv("worker", children["worker"], work),
            lambda: True,
            env,
            stop_order=STOP_ORDER["worker"],
        )
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
        table_rows: list[list[object]] = []
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
                )
                sup.run(
                    "fleet",
                    child_argv("fleet", fleet, work, file=f"fleet-round-{n}"),
                    env,
                    work / "logs" / f"fleet-round-{n}.log",
                    stop_order=STOP_ORDER["fleet"],
                )
                # the collector acknowledges into its log first: wait until the store holds the episodes
                # and the DB has them closed (what the round selects from)
                expected, deadline = cfg.robots * cfg.episodes, time.monotonic() + 120
                summary = fleet_summary(db, since, "sim")
                while summary["episodes"] < expected and time.monotonic() < deadline:
                    time.sleep(0.5)
                    summary = fleet_summary(db, since, "sim")
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
                rid = queue_round(
                    RoundConfig(
                        train=train,
                        eval_episodes=cfg.eval_episodes,
                        margin=cfg.margin,
                        eval_envs=2,
                        preset=cfg.preset,
                    ),
                    db,
                )
                rec = _wait_round(db, rid, cfg.round_timeout_s, sup)
                m = rec.metrics
                ci = m.get("ci95") or [None, None]
                row = {
                    "round": rid,
                    "algo": rec.algo,
                    "status": rec.status,
                    "success": m.get("success"),
                    "ci95": ci,
                    "base_success": m.get("base_success"),
                    "fleet": summary,
                    "minutes": (time.monotonic() - t0) / 60,
                    "promoted": rec.promoted,
                    "prod_revision": resolve(prod),
                    "error": (rec.error or "").splitlines()[0] if rec.error else None,
                    "restarts": list(sup.events),
                }
                rows.append(row)
                success = (
                    f"{m['success']:.0%} ({ci[0]:.0%}-{ci[1]:.0%})"
                    if rec.status == "succeeded"
                    else f"{rec.status}: {row['error']}"
                )
                cells = [
                    rid,
                    rec.algo,
                    success if rec.status == "succeeded" else f"{rec.status} (below)",
                    pct(m.get("base_success")),
                    pct(summary["success"]),
                    pct(summary["intervention_rate"]),
                    "n/a"
                    if summary["takeovers_per_episode"] is None
                    else f"{summary['takeovers_per_episode']:.2f}",
                    summary["frames"],
                    f"{row['minutes']:.1f}",
                    "yes" if rec.promoted else "no",
                ]
                table_rows.append(cells)
                print(
                    f"round {rid}: {rec.algo} {success}, base {pct(m.get('base_success'))}, fleet success "
                    f"{pct(summary['success'])} with {pct(summary['intervention_rate'])} of frames by the operator, "
                    f"promoted: {'yes' if rec.promoted else 'no'} ({row['minutes']:.1f} min)",
                    flush=True,
                )
                with (work / "rounds.jsonl").open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
        if table_rows:
            print()
            print(table(table_rows, HEADER), flush=True)
        for r in rows:
            if r["status"] != "succeeded":
                print(f"round {r['round']} {r['status']}, prod unchanged: {r['error']}", flush=True)
        for e in sup.events:
            print(f"supervisor: {e}", flush=True)
    finally:
        sup.stop_all()
    return rows


def _wait_round(db: Any, rid: int, timeout_s: float, sup: Supervisor) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        rec = db.round(rid)
        if rec is not None and rec.status in ("succeeded", "failed", "cancelled"):
            return rec
        time.sleep(1.0)
    raise RuntimeError(f"round {rid} did not finish within {timeout_s:.0f} s; see the worker's log")

"""The service children of ``vla-rl up``: each one's config (its command's own config dataclass, written
to a file the child reads), its command line, and the order they stop in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from vla_rl.up.workdir import Ports

CLI = [sys.executable, "-m", "vla_rl.cli"]

STOP_ORDER = {"fleet": 0, "worker": 0, "dashboard": 0, "server": 1, "collector": 1, "hub": 2}
"""The order :meth:`vla_rl.core.supervisor.Supervisor.stop_all` stops ``up``'s processes in: each before
what it uses (the fleet uses server and collector, the server follows prod on the registry), so none spins
on one gone."""


def child_configs(
    work: Path,
    store: Path,
    db_url: str,
    hub_url: str,
    ports: Ports,
    repo: str,
    served: str,
    round_nice: int = 0,
    continuous: bool = False,
) -> dict[str, Any]:
    """The config of every service child ``up`` starts, by child name: each command's own config dataclass,
    written to WORKDIR/configs/NAME.json and read back by ``vla-rl COMMAND --config FILE``. Secrets are not
    in them (tokens and the DB password reach the children through the environment). The policy server
    serves and follows the ref ``served``; the worker adds ``round_nice`` to its rounds' niceness. A
    ``continuous`` fleet never pauses, so the collector's store writers run at the fleet's priority (not
    below it, as when a batch ends and they catch up): a writer that falls behind leaves episodes open
    until the collector refuses new ones."""
    from fleet.collector import CollectorConfig
    from server.config import ServerConfig
    from vla_rl.dashboard.config import DashboardConfig
    from vla_rl.hub.config import HubConfig
    from vla_rl.round_worker import WorkerConfig

    return {
        "hub": HubConfig(data=work / "hub", port=ports.hub, token=None),
        "server": ServerConfig(checkpoint=served, follow="self", follow_interval=2.0, port=ports.server),
        "collector": CollectorConfig(
            store=store, db=db_url, port=ports.collector, **({"store_writer_nice": 0} if continuous else {})
        ),
        "worker": WorkerConfig(
            store=store, db_url=db_url, poll_s=1, heartbeat_s=2, stale_after_s=15, nice=round_nice
        ),
        "dashboard": DashboardConfig(
            store=store,
            db=db_url,
            hub=hub_url,
            server=(f"127.0.0.1:{ports.server}",),
            collector=f"127.0.0.1:{ports.collector}",
            host="127.0.0.1",
            port=ports.dashboard,
            repo=repo,
            workdir=work / "dashboard",
        ),
    }


CHILD_COMMANDS = {"hub": ("hub", "serve"), "worker": ("round", "worker"), "dashboard": ("dashboard",)}
CHILD_COMMANDS |= {"server": ("serve",), "collector": ("collect",), "fleet": ("fleet", "sim")}


def child_argv(name: str, cfg: Any, work: Path, file: str | None = None) -> list[str]:
    """Write ``cfg`` to WORKDIR/configs/(``file`` or NAME).json; the child's command line that reads it."""
    from vla_rl.core import configs

    path = configs.save(cfg, work / "configs" / f"{file or name}.json")
    return [*CLI, *CHILD_COMMANDS[name], "--config", str(path)]

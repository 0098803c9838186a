"""``vla-rl up``: the whole improvement loop on one machine, supervised.

It starts, on loopback, the embedded Hub registry, a policy server following ``prod``, the fleet collector,
a round worker and, where this install has ``vla-rl dashboard``, the dashboard (each its own ``vla-rl``
process, restarted if it dies; the loop goes on without the dashboard if it cannot run), seeds a
deliberately weak base policy (SFT on a few noisy demos; cached), publishes it as ``prod``, and loops:

    the simulated fleet (robots + a simulated operator) collects under prod
      -> a round is queued (the trigger: every ``episodes`` episodes per robot)
      -> the worker trains on the fleet's data, evaluates candidate vs base on fixed held-out seeds,
         pushes round-N and moves prod if it is better
      -> the server swaps live; the fleet carries on under the new commit

and prints one row per round. Running it again in the same workdir resumes (same store, DB, registry,
next round number). Ctrl-C (or SIGTERM) stops every process within seconds, in order (the fleet and the
worker, then the policy server and the collector, the registry last); nothing acknowledged is lost (the
collector's write-ahead log holds it). Should ``up`` itself be killed outright, its children stop by
themselves (:mod:`vla_rl.core.lifeline`).

Layout of ``workdir``: ``hub/`` (registry data), ``store/`` (episodes + metadata DB), ``base/`` (demos'
SFT run), ``rounds/round-N/`` (training runs), ``logs/*.log`` (one per process), ``up.json`` (ports,
repo, seed), ``secrets/`` (tokens, mode 0600; handed to children through the environment; ``dashboard``
is the dashboard's operator token).

A round that fails (its training raises, its data selection is empty, ...) is recorded in the DB as
failed with the error, ``prod`` stays where it was, its row says so, and the loop goes on with the next
round; ``vla-rl up`` then exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vla_rl.core.console import table
from vla_rl.core.instance import INSTANCE_ENV, instance_tag, new_nonce
from vla_rl.core.lifeline import supervised_env
from vla_rl.core.secrets import read_secret_file
from vla_rl.core.seeds import ONLINE

if TYPE_CHECKING:
    from fleet.db import MetadataDB

log = logging.getLogger(__name__)
CLI = [sys.executable, "-m", "vla_rl.cli"]


@dataclass
class UpConfig:
    """The whole improvement loop on this machine: registry, policy server following prod, collector,
    round worker and a simulated fleet with its operator; rounds train on what the fleet does, and the
    server swaps to each promoted checkpoint live. Stop it with Ctrl-C; run it again to resume."""

    task: str = "maniskill/PickCube-v1"
    """Simulated task the fleet works on."""
    robots: int = 4
    """Simulated robots (one process each)."""
    operators: int = 1
    """Robots the simulated operator can drive at once."""
    rounds: int = 3
    """Post-training rounds to run (counting rounds of earlier runs in this workdir); then it exits."""
    episodes: int = 10
    """Episodes per robot between rounds (the trigger): 40 fleet episodes a round with 4 robots. Why 10 and
    not 5: docs/benchmarks.md, "The improvement loop"."""
    algo: str = "awr"
    """Round algorithm (see `vla-rl round start --help`), unless --preset names a recipe."""
    preset: str | None = None
    """Named round recipe (vla_rl/train/presets.py); overrides --algo."""
    data: str | None = None
    """What each round trains on, as selection text (e.g. `success=true`; see `vla-rl round start
    --help`); None = every episode of the task (the base's demos and everything the fleet did)."""
    round_steps: int | None = None
    """Training steps of each round (over the algorithm's or the preset's); None = theirs."""
    base_preset: str | None = None
    """Named SFT recipe for the weak base; None = the defaults below."""
    base_demos: int = 25
    """Scripted demonstrations the base is trained on (the default makes the weak base a loop should start
    from; its measured success: docs/benchmarks.md, "The improvement loop")."""
    base_noise: float = 0.5
    """Expert sloppiness of those demonstrations."""
    base_steps: int | None = 1000
    """SFT steps of the base (over the preset's); None = the preset's (or SFT's default)."""
    eval_episodes: int = 50
    """Held-out episodes a round evaluates candidate and base on (the same seeds every round)."""
    margin: float = 0.0
    """Promote only if the candidate beats the base by more than this (a fraction)."""
    workdir: Path = Path("runs/up")
    """Everything lives here; running again in the same workdir resumes."""
    seed: int = 0
    """Seeds the demos, the base, the fleet's episodes and the rounds."""
    repo: str = "up/policy"
    """Registry repo the checkpoints go to."""
    progress: bool = True
    """Progress bars for the base's training."""
    round_timeout_s: float = 3600.0
    """Give up waiting for one round after this long (the loop stops with an error)."""
    dashboard: bool = True
    """Start `vla-rl dashboard` as one of the children, where this install has that command."""
    db: str | None = None
    """Metadata DB URL (e.g. postgresql://host/vla_rl) that the collector, worker, rounds and dashboard
    share; None = the SQLite file in <workdir>/store. A resumed run must name the same DB."""

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        for name in (
            "robots",
            "operators",
            "rounds",
            "episodes",
            "base_demos",
            "eval_episodes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.round_steps is not None and self.round_steps < 1:
            raise ValueError(f"round_steps: expected a positive integer or None, got {self.round_steps}")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s: expected > 0 seconds, got {self.round_timeout_s}")
        if self.db is not None and not self.db.strip():
            raise ValueError("db: expected a metadata DB URL (e.g. postgresql://host/vla_rl), got ''")


# ---------------------------------------------------------------------------- processes
@dataclass
class Child:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str]
    log_path: Path
    required: bool = True
    """False: the loop goes on without it when it cannot start or keeps dying (e.g. the dashboard)."""
    stop_order: int = 0
    """:meth:`Supervisor.stop_all` stops lower numbers first: what uses the others before what they use."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0


@dataclass
class Supervisor:
    """Starts services, restarts one that dies (with backoff), runs jobs (the fleet), stops them all on the
    way out. Each process gets its own process group (a terminal's Ctrl-C reaches ``up`` alone, which stops
    them in order) and :func:`vla_rl.core.lifeline.supervised_env`: it acts on SIGINT even where ``up`` was
    started ignoring it, and it stops by itself when ``up`` dies (SIGKILL, a crash)."""

    logs: Path
    max_restarts: int = 5
    children: dict[str, Child] = field(default_factory=dict)
    jobs: dict[str, Child] = field(default_factory=dict)
    """Processes run to their end (:meth:`run`), never restarted."""
    events: list[str] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], bool],
        env: dict[str, str],
        timeout_s: float = 180,
        required: bool = True,
        stop_order: int = 0,
    ) -> bool:
        """Start ``name`` and wait until ``ready()``; returns whether it runs. A required child that
        fails to start raises; an optional one is stopped, dropped and reported in ``events``."""
        child = Child(
            name, argv, ready, env, self.logs / f"{name}.log", required=required, stop_order=stop_order
        )
        error = self._launch(child, timeout_s)
        if error is None:
            return True
        if required:
            raise RuntimeError(error)
        self._drop(child, f"{error}; going on without it")
        return False

    def start_on_port(
        self,
        name: str,
        port: int,
        make: Callable[[int], tuple[list[str], Callable[[], bool], dict[str, str]]],
        timeout_s: float = 60,
        stop_order: int = 0,
    ) -> int | None:
        """Start the optional child ``name`` serving on ``port`` (``make(port)``: its argv, ready check
        and environment); returns the port it serves on, or None (dropped, reported in ``events``).

        A port picked free can be taken by another process before the child binds it: the child then
        fails (its ready check, which believes only its own nonce, never passes) and the port is still
        not free once it is gone. Then, once, a fresh port is picked and the child started again."""
        for attempt in (0, 1):
            argv, ready, env = make(port)
            child = Child(
                name, argv, ready, env, self.logs / f"{name}.log", required=False, stop_order=stop_order
            )
            error = self._launch(child, timeout_s)
            if error is None:
                return port
            self._remove(child)
            if attempt == 0 and not _port_free(port):
                taken, port = port, _free_port()
                msg = f"{name}: port {taken} was taken by another process; starting it on port {port}"
                self.events.append(msg)
                log.warning(msg)
                continue
            self._drop(child, f"{error}; going on without it")  # a failure the port does not explain
            break
        return None

    def _launch(self, child: Child, timeout_s: float) -> str | None:
        """Register and spawn ``child``, wait until it is ready; None, or why it is not."""
        self.children[child.name] = child
        self._spawn(child)
        try:
            self._wait_ready(child, timeout_s)
        except RuntimeError as e:
            return str(e)
        return None

    def _remove(self, child: Child) -> None:
        """Stop ``child`` (SIGKILL) and forget it."""
        if self.children.get(child.name) is child:
            self.children.pop(child.name)
        if child.proc is not None and child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()

    def _drop(self, child: Child, why: str) -> None:
        """Stop an optional child for good (the loop does not need it)."""
        self._remove(child)
        self.events.append(why)
        log.warning(why)

    def _spawn(self, child: Child) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        out = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            child.proc = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | child.env | supervised_env(),
                process_group=0,  # Ctrl-C at a terminal reaches `up`; it stops the children in order
            )
        finally:
            out.close()
        child.started_at = time.monotonic()

    def run(
        self, name: str, argv: list[str], env: dict[str, str], log_path: Path, stop_order: int = 0
    ) -> int:
        """Run ``argv`` to its end as job ``name`` (output appended to ``log_path``; not restarted; stopped
        with the rest by :meth:`stop_all`); returns its exit code."""
        if self._stopping.is_set():
            raise RuntimeError(f"{name}: not started, the supervisor is stopping")
        job = Child(name, argv, lambda: True, env, log_path, stop_order=stop_order)
        self.jobs[name] = job
        self._spawn(job)
        assert job.proc is not None
        code = job.proc.wait()  # an interrupt leaves it in jobs: stop_all stops it
        self.jobs.pop(name, None)
        return code

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.proc.returncode}; see {child.log_path}"
                )
            if self._stopping.is_set():
                raise RuntimeError(f"{child.name}: stopping")
            if child.ready():
                return
            self._stopping.wait(0.2)
        raise RuntimeError(f"{child.name} not ready after {timeout_s:.0f} s; see {child.log_path}")

    def check(self) -> None:
        """Restart any service that died (the loop calls this between its steps, and a thread every second)."""
        with self._lock:
            for child in list(self.children.values()):
                if self._stopping.is_set():
                    return
                assert child.proc is not None
                code = child.proc.poll()
                if code is None:
                    continue
                if child.restarts >= self.max_restarts:
                    why = f"{child.name} died {child.restarts + 1} times; see {child.log_path}"
                    if child.required:
                        raise RuntimeError(why)
                    self._drop(child, f"{why}; going on without it")
                    continue
                child.restarts += 1
                msg = f"{child.name} exited with code {code}; restarting it (restart {child.restarts})"
                self.events.append(msg)
                log.warning(msg)
                if self._stopping.wait(min(2.0, 0.2 * 2**child.restarts)):
                    return
                self._spawn(child)
                try:
                    self._wait_ready(child, 180)
                except RuntimeError as e:
                    if self._stopping.is_set():
                        return  # stop_all stops it
                    if child.required:
                        raise
                    self._drop(child, f"{e}; going on without it")

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(1.0):
                try:
                    self.check()
                except RuntimeError as e:
                    log.error("supervisor", extra={"error": str(e)})

        t = threading.Thread(target=loop, name="supervisor", daemon=True)
        t.start()
        try:
            yield
        except BaseException:
            self._stopping.set()  # on the way out (Ctrl-C): a restart under way gives up at once
            raise
        finally:
            stop.set()
            t.join(5)

    def stop_all(self, timeout_s: float = 8.0, stage_s: float = 1.5) -> None:
        """Stop every service and job within ``timeout_s`` in all (plus the kills), by ``stop_order``: each
        group is SIGINTed (as a user would) once the one before it has exited, or ``stage_s`` after it was
        told to (a process's own exit can take seconds on a loaded machine: its stop is done by then), so
        that nothing spins on a dependency already gone (the fleet and the worker first, then server and
        collector, the registry last). Then all are waited for against the one deadline; what still runs
        at it, or on a second Ctrl-C, is SIGKILLed."""
        self._stopping.set()  # a restart under way gives up (check() wakes from its waits)
        with self._lock:
            members = [c for c in [*self.jobs.values(), *self.children.values()] if c.proc is not None]
        procs = [c.proc for c in members if c.proc is not None]
        end = time.monotonic() + timeout_s
        try:
            for order in sorted({c.stop_order for c in members}):
                group = [c.proc for c in members if c.stop_order == order and c.proc is not None]
                for p in group:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(signal.SIGINT)
                _wait_all(group, min(end, time.monotonic() + stage_s))
            _wait_all(procs, end)
        except KeyboardInterrupt:
            log.warning("interrupted again: killing what still runs")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()


def _wait_all(procs: list[subprocess.Popen[bytes]], until: float) -> None:
    """Wait for every process in ``procs`` to exit, until the ``time.monotonic()`` deadline ``until``."""
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, until - time.monotonic()))


STOP_ORDER = {"fleet": 0, "worker": 0, "dashboard": 0, "server": 1, "collector": 1, "hub": 2}
"""The order :meth:`Supervisor.stop_all` stops ``up``'s processes in: each before what it uses (the fleet
uses server and collector, the server follows prod on the registry), so none spins on one gone."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tcp_ready(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    return ready


def _http_ready(url: str, instance: str) -> Callable[[], bool]:
    """Ready when ``GET url`` answers JSON whose ``instance`` is ``instance`` (the tag of the nonce the
    child was started with, :mod:`vla_rl.core.instance`): an answer from another process on the port (another
    ``vla-rl up``'s dashboard) has another tag, or none, and is not taken for our child."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                body = json.loads(r.read(64 * 1024))
        except (OSError, ValueError):
            return False
        return isinstance(body, dict) and body.get("instance") == instance

    return ready


def _http_child(url: str) -> tuple[Callable[[], bool], dict[str, str]]:
    """A ready check for an HTTP child and the environment that gives the child its nonce (a fresh one)."""
    nonce = new_nonce()
    return _http_ready(url, instance_tag(nonce)), {INSTANCE_ENV: nonce}


def _secret(path: Path) -> str:
    """The token kept in ``path``, made (random, mode 0600 in a 0700 folder) the first time."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
    return read_secret_file(path)


def shown_db_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (what up.json records and messages show)."""
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def split_db_password(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its password, and the environment that carries it instead (``PGPASSWORD``, which
    libpq reads): children get the DB on their command line, and a password never belongs in argv (nor
    in the round configs the DB records). A URL without a password, or not PostgreSQL, is kept."""
    from sqlalchemy import URL, make_url

    u = make_url(url)
    if u.password is None or u.get_backend_name() != "postgresql":
        return url, {}
    bare = URL.create(u.drivername, u.username, None, u.host, u.port, u.database, u.query)
    return bare.render_as_string(hide_password=False), {"PGPASSWORD": str(u.password)}


def workdir_db(given: str | None, recorded: str | None, store: Path) -> str:
    """The metadata DB URL of this run: ``given`` (--db), else the SQLite file in ``store``. A workdir
    whose earlier run recorded (password hidden) another DB is refused: its episodes, rounds and labels
    are there, a run against another DB would start over inside the same store and registry."""
    from sqlalchemy.exc import ArgumentError

    from fleet.db import default_url

    url = given or default_url(store)
    try:
        shown = shown_db_url(url)
    except ArgumentError as e:  # not a URL at all
        raise ValueError(
            f"db: expected an SQLAlchemy URL (e.g. postgresql://host/vla_rl), got {url!r}"
        ) from e
    if recorded is not None and recorded != shown:
        raise ValueError(
            f"db: this workdir's earlier run used the metadata DB {recorded}, not {shown}: resume with "
            f"--db {recorded} (its password too), or start over in another --workdir"
        )
    return url


DASHBOARD_PORT = 8780  # `vla-rl dashboard`'s own default; another free port when it is taken


def child_configs(
    work: Path, store: Path, db_url: str, hub_url: str, ports: Ports, repo: str, served: str
) -> dict[str, Any]:
    """The config of every service child ``up`` starts, by child name: each command's own config dataclass,
    written to WORKDIR/configs/NAME.json and read back by ``vla-rl COMMAND --config FILE``. Secrets are not
    in them (tokens and the DB password reach the children through the environment). The policy server
    serves and follows the ref ``served``."""
    from fleet.collector import CollectorConfig
    from server.config import ServerConfig
    from vla_rl.dashboard.config import DashboardConfig
    from vla_rl.hub.config import HubConfig
    from vla_rl.round_worker import WorkerConfig

    return {
        "hub": HubConfig(data=work / "hub", port=ports.hub, token=None),
        "server": ServerConfig(checkpoint=served, follow="self", follow_interval=2.0, port=ports.server),
        "collector": CollectorConfig(store=store, db=db_url, port=ports.collector),
        "worker": WorkerConfig(store=store, db_url=db_url, poll_s=1, heartbeat_s=2, stale_after_s=15),
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


# ---------------------------------------------------------------------------- the loop
@dataclass
class Ports:
    hub: int
    server: int
    collector: int
    dashboard: int

    @classmethod
    def load_or_pick(cls, path: Path) -> Ports:
        """The ports an earlier run in this workdir used where they are still free, else new ones (the
        dashboard's preferably its usual 8780, so its URL stays the same)."""
        old = json.loads(path.read_text()).get("ports", {}) if path.exists() else {}
        preferred = {"dashboard": DASHBOARD_PORT}
        picked: dict[str, int] = {}
        for k in ("hub", "server", "collector", "dashboard"):
            for candidate in (old.get(k), preferred.get(k)):
                if candidate and candidate not in picked.values() and _port_free(candidate):
                    picked[k] = candidate
                    break
            else:
                picked[k] = _free_port()
        return cls(**picked)


def fleet_summary(db: MetadataDB, since: float, robot_prefix: str) -> dict[str, Any]:
    """Success, intervention rate and takeovers of the closed episodes of robots ``robot_prefix*``
    created since ``since``: one selection in the metadata DB (the collector records every episode there
    once the store holds it)."""
    from vla_rl_client.meta import SegmentKind

    from fleet.selection import Selection

    recs = db.select_records(Selection(robots=(f"{robot_prefix}*",), since=since))
    frames = sum(r.length for r in recs)
    human = sum(
        (s.end if s.end is not None else r.length) - s.start
        for r in recs
        for s in r.segments
        if s.kind == SegmentKind.INTERVENTION
    )
    takeovers = sum(1 for r in recs for s in r.segments if s.kind == SegmentKind.INTERVENTION)
    n = len(recs)
    return {
        "episodes": n,
        "success": sum(bool(r.success) for r in recs) / n if n else None,
        "intervention_rate": human / frames if frames else None,
        "takeovers_per_episode": takeovers / n if n else None,
        "frames": frames,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


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
    tokens = {k: _secret(work / "secrets" / k) for k in ("hub", "collector", "server", "dashboard")}
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
        hub_ready, hub_env = _http_child(f"{hub_url}/api/health")
        sup.start(
            "hub",
            child_argv("hub", children["hub"], work),
            hub_ready,
            env | hub_env,
            stop_order=STOP_ORDER["hub"],
        )
        _seed_base(cfg, work, store, prod, db_url)
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
            _tcp_ready(ports.server),
            env,
            stop_order=STOP_ORDER["server"],
        )
        sup.start(
            "collector",
            child_argv("collector", children["collector"], work),
            _tcp_ready(ports.collector),
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
                ready, nonce_env = _http_child(f"http://127.0.0.1:{port}/api/v1/health")
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
                    _pct(m.get("base_success")),
                    _pct(summary["success"]),
                    _pct(summary["intervention_rate"]),
                    "n/a"
                    if summary["takeovers_per_episode"] is None
                    else f"{summary['takeovers_per_episode']:.2f}",
                    summary["frames"],
                    f"{row['minutes']:.1f}",
                    "yes" if rec.promoted else "no",
                ]
                table_rows.append(cells)
                print(
                    f"round {rid}: {rec.algo} {success}, base {_pct(m.get('base_success'))}, fleet success "
                    f"{_pct(summary['success'])} with {_pct(summary['intervention_rate'])} of frames by the operator, "
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


HEADER = [
    "round",
    "algo",
    "autonomous success (95% CI)",
    "base",
    "fleet success",
    "intervention",
    "takeovers/ep",
    "frames",
    "min",
    "promoted",
]


def training_threads(sample_s: float = 0.5) -> int:
    """Torch threads for the base's or a round's training: the cores idle right now (sampled over
    ``sample_s``), at least 1, at most 4. The fleet is idle while a round trains (it collects its batch
    before the round is queued), so on a machine of its own training takes every core; on a busy machine
    more threads than free cores is far slower than one (each op waits for a descheduled sibling thread;
    docs/benchmarks.md has both measured), hence the sample. The cap keeps a small policy from spreading
    over a big machine's cores."""
    cores = os.cpu_count() or 1
    try:
        first = _cpu_times()
        time.sleep(sample_s)
        second = _cpu_times()
    except OSError:  # no /proc/stat (not Linux): the safe choice
        return 1
    return threads_for(first, second, cores)


def threads_for(first: tuple[int, int], second: tuple[int, int], cores: int, cap: int = 4) -> int:
    """Threads for the cores that were idle between two (all, idle) CPU-time samples: ``idle / all *
    cores`` rounded down (a core 75% free counts), at least 1, at most ``min(cap, cores)``."""
    total, idle = second[0] - first[0], second[1] - first[1]
    free = idle / total * cores if total > 0 else 0.0
    return max(1, min(cap, cores, int(free + 0.25)))


def _cpu_times() -> tuple[int, int]:
    """(all, idle + iowait) jiffies over every core since boot, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]  # user nice system idle iowait irq softirq steal


def _seed_base(cfg: UpConfig, work: Path, store: Path, prod: str, db_url: str) -> None:
    """The deliberately weak base: SFT on a few noisy demos, pushed as ``base`` and ``prod`` (once)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    from fleet.db import MetadataDB
    from fleet.selection import EpisodeQuery
    from fleet.store import EpisodeStore
    from sim.demos import record_demos
    from vla_rl.hub.registry import push_folder, resolve
    from vla_rl.train.algorithms import make_config, train
    from vla_rl.train.presets import preset_config

    try:
        resolve(prod)
        return  # an earlier run seeded it
    except (RepositoryNotFoundError, RevisionNotFoundError):
        pass
    db = MetadataDB(db_url)
    s = EpisodeStore(store, create=True, db=db)
    if not db.query_episode_ids(EpisodeQuery(robots=("demo-*",)), limit=1):
        print(
            f"[base] recording {cfg.base_demos} scripted demos of {cfg.task} (noise {cfg.base_noise})",
            flush=True,
        )
        record_demos(
            s,
            cfg.task,
            episodes=cfg.base_demos,
            noise=cfg.base_noise,
            seed=cfg.seed,
            num_envs=1,
            progress=cfg.progress,
            robot_prefix="demo",
        )
    values = {
        "store": store,
        "out": work / "base",
        "db_url": db_url,
        "task": cfg.task,
        "seed": cfg.seed,
        "progress": cfg.progress,
        "threads": training_threads(),
    }
    if cfg.base_steps is not None:
        values["steps"] = cfg.base_steps
    sft = preset_config(cfg.base_preset, **values) if cfg.base_preset else make_config("sft", **values)
    print(f"[base] training SFT ({sft.steps} steps)", flush=True)
    result = train(sft)
    sha = push_folder(
        result.checkpoint, cfg.repo, message=f"base: sft on {cfg.base_demos} noisy demos", tag="base"
    )
    push_folder(result.checkpoint, cfg.repo, message="prod = base", tag="prod")
    print(f"[base] pushed hub://{cfg.repo}@base ({sha[:12]}) and prod", flush=True)


def _wait_round(db: Any, rid: int, timeout_s: float, sup: Supervisor) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        rec = db.round(rid)
        if rec is not None and rec.status in ("succeeded", "failed", "cancelled"):
            return rec
        time.sleep(1.0)
    raise RuntimeError(f"round {rid} did not finish within {timeout_s:.0f} s; see the worker's log")

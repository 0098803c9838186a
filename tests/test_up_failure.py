"""`vla-rl up` when things go wrong: a round whose training raises, and children the loop can do without.

The failing round is real: ``--data robot=nobody`` is a valid selection that matches no episode, so every
round's training raises (deterministically, in the round's own process under the real worker). The run
must record each as failed with the error, leave ``prod`` on the base, still run the next round's fleet
and round, and exit 1 (~25 s on 2 cores, up to ~100 s when other jobs share them); the same workdir then
resumes with a working config and its next round succeeds (slow-marked: it doubles the time). Same
CI-scale setup as tests/test_up.py (kinematic test bed, tiny recipes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fleet.store import EpisodeStore
from vla_rl.cli.common import open_db
from vla_rl.core.supervisor import Supervisor, free_port, http_child, http_ready, port_free
from vla_rl.up.children import child_argv, child_configs
from vla_rl.up.workdir import DASHBOARD_PORT, Ports, split_db_password, workdir_db

CLI = [sys.executable, "-m", "vla_rl.cli"]
ROBOTS, EPISODES = 2, 2


def _up(work: Path, rounds: int, db: str | None, *extra: str) -> list[str]:
    return [
        *CLI, "up", "--task", "kinematic/Reach-v0", "--robots", str(ROBOTS), "--episodes", str(EPISODES),
        "--rounds", str(rounds), "--base-demos", "4", "--base-steps", "20", "--base-preset", "kinematic-sft",
        "--preset", "tiny-awr", "--eval-episodes", "4", "--workdir", str(work), "--no-progress", "--no-continuous",
        *(["--db", db] if db else []), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def up_db(request: pytest.FixtureRequest) -> str | None:
    """The loop's metadata DB: None = the store's SQLite (no --db), or a PostgreSQL database (--db URL).
    PostgreSQL in the slow suite only: its run costs ~2 min, and `up --db` is run on PostgreSQL in CI by
    tests/test_up.py (a failed round's row on PostgreSQL: tests/test_round_jobs.py)."""
    return None if request.param == "sqlite" else request.getfixturevalue("pg").create_database()


@pytest.fixture(scope="module")
def failed(tmp_path_factory: pytest.TempPathFactory, up_db: str | None) -> tuple[Path, str]:
    """A workdir whose two rounds failed, and the commit prod (the base) points at."""
    work = tmp_path_factory.mktemp("up-fail")
    r = subprocess.run(
        _up(work, 2, up_db, "--data", "robot=nobody"), capture_output=True, text=True, timeout=600
    )
    (work / "out.txt").write_text(r.stdout + r.stderr + f"\nrc={r.returncode}\n")
    rows = [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()] if r.stdout else []
    return work, rows[0]["prod_revision"] if rows else ""


def test_a_failed_round_is_recorded_prod_stays_and_the_loop_goes_on(
    failed: tuple[Path, str], up_db: str | None
) -> None:
    work, base_commit = failed
    out = (work / "out.txt").read_text()
    assert out.rstrip().endswith("rc=1"), out[-4000:]  # a failed round: exit 1, not a traceback
    assert "Traceback" not in out
    assert "round 1: awr failed: ValueError: no closed episodes" in out
    assert "round 2: awr failed" in out, "the loop goes on after a failed round"
    assert "round 1 failed, prod unchanged: ValueError: no closed episodes" in out  # under the table
    db = open_db(work / "store", up_db)
    assert [(x.id, x.status, x.promoted) for x in db.rounds()] == [(1, "failed", False), (2, "failed", False)]
    assert all("no closed episodes" in (x.error or "") and x.checkpoint_ref is None for x in db.rounds())
    rows = [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()]
    assert [x["status"] for x in rows] == ["failed", "failed"]
    assert base_commit and rows[1]["prod_revision"] == base_commit, "prod stays on the base"
    assert all(x["fleet"]["episodes"] == ROBOTS * EPISODES for x in rows)  # both rounds' fleets ran
    for name in ("hub", "server", "collector", "dashboard"):  # tokens: one per service, owner-only
        mode = stat.S_IMODE((work / "secrets" / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    # run again with the same bound: nothing to do, and it says how to run more
    r = subprocess.run(_up(work, 2, up_db), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "already holds 2 rounds" in r.stdout and "--rounds 4" in r.stdout, r.stdout
    assert len(open_db(work / "store", up_db).rounds()) == 2


@pytest.mark.slow
def test_after_failed_rounds_the_next_round_trains_from_the_untouched_prod(
    failed: tuple[Path, str], up_db: str | None
) -> None:
    work, base_commit = failed
    r = subprocess.run(_up(work, 3, up_db), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (rec,) = [x for x in open_db(work / "store", up_db).rounds() if x.id == 3]
    assert rec.status == "succeeded" and rec.checkpoint_ref == "hub://up/policy@round-3"
    assert rec.base_revision == base_commit, "prod was still the base when round 3 started"
    store = EpisodeStore(work / "store")
    assert sum(store.read_metadata(e).robot_id.startswith("sim-") for e in store.episode_ids()) == 3 * 4


# ---------------------------------------------------------------------------- the supervisor's optional children
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_an_optional_child_that_cannot_start_is_dropped_a_required_one_raises(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    try:
        assert not sup.start(
            "dash", _py("raise SystemExit(3)"), lambda: False, {}, timeout_s=10, required=False
        )
        assert "dash" not in sup.children and "dash exited with code 3" in sup.events[-1]
        with pytest.raises(RuntimeError, match="server exited with code 3"):
            sup.start("server", _py("raise SystemExit(3)"), lambda: False, {}, timeout_s=10)
    finally:
        sup.stop_all(timeout_s=2)


def test_an_optional_child_that_keeps_dying_is_given_up_and_the_rest_stay_supervised(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", max_restarts=1)
    try:
        assert sup.start("worker", _py("import time; time.sleep(60)"), lambda: True, {})
        assert sup.start("dash", _py("import time; time.sleep(0.2)"), lambda: True, {}, required=False)
        end = time.monotonic() + 30
        while "dash" in sup.children and time.monotonic() < end:
            time.sleep(0.3)
            sup.check()  # restarts dash once, then drops it without raising
        assert "dash" not in sup.children and "worker" in sup.children
        assert any("dash exited with code 0; restarting it" in e for e in sup.events)
        assert "dash died 2 times" in sup.events[-1] and "going on without it" in sup.events[-1]
    finally:
        sup.stop_all(timeout_s=2)


# ---------------------------------------------------------------------------- the children's configs
def test_children_get_config_files_their_commands_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` builds each service child's config dataclass and hands it over as WORKDIR/configs/NAME.json
    (`vla-rl COMMAND --config FILE`), not as argv: every file parses back through the command's own flags
    parser into the same config, and no token or password is in a file or on a command line."""
    from vla_rl.cli import COMMANDS
    from vla_rl.cli.common import parse_config
    from vla_rl.core.configs import is_secret

    for var in ("VLA_RL_HUB_TOKEN", "VLA_RL_COLLECTOR_TOKEN", "VLA_RL_SERVER_TOKEN"):
        monkeypatch.setenv(var, f"secret-{var}")
    ports = Ports(hub=11, server=12, collector=13, dashboard=14)
    store = tmp_path / "store"
    children = child_configs(
        tmp_path,
        store,
        "postgresql://ana@db/vla",
        "http://127.0.0.1:11",
        ports,
        "fleet/up",
        "hub://fleet/up@prod",
    )
    assert children["server"].follow == "self" and children["server"].checkpoint == "hub://fleet/up@prod"
    assert (
        children["dashboard"].server == ("127.0.0.1:12",)
        and children["dashboard"].collector == "127.0.0.1:13"
    )
    assert children["hub"].port == 11 and children["worker"].db_url == "postgresql://ana@db/vla"
    by_path = {c.path: c for c in COMMANDS}
    for name, cfg in children.items():
        argv = child_argv(name, cfg, tmp_path)
        path = Path(argv[-1])
        assert argv[-2] == "--config" and path == tmp_path / "configs" / f"{name}.json"
        text = path.read_text()
        assert "secret-" not in text and "secret-" not in " ".join(argv)
        command = by_path[tuple(argv[3:-2])]
        cls = command.args if isinstance(command.args, type) else command.args()
        assert command.config_file and issubclass(cls, type(cfg))  # the command may add its secrets' flags
        back = parse_config(cls, ["--config", str(path)], "vla-rl")
        saved = [f.name for f in dataclasses.fields(cfg) if not is_secret(f)]
        assert {k: getattr(back, k) for k in saved} == {k: getattr(cfg, k) for k in saved}, name
    assert set(children) == {"hub", "server", "collector", "worker", "dashboard"}


def test_the_db_password_goes_to_children_through_the_environment(tmp_path: Path) -> None:
    """`up --db` hands its children the URL without the password and PGPASSWORD (libpq's) instead; a
    workdir's DB is the one its first run recorded (password hidden)."""
    assert split_db_password("postgresql://ana:s%40cret@db:5432/vla") == (
        "postgresql://ana@db:5432/vla",
        {"PGPASSWORD": "s@cret"},
    )
    for kept in ("postgresql://ana@db/vla", f"sqlite:///{tmp_path}/m.db"):
        assert split_db_password(kept) == (kept, {})
    store = tmp_path / "store"
    sqlite = f"sqlite:///{store.absolute() / 'metadata.db'}"
    assert workdir_db(None, None, store) == sqlite
    assert workdir_db("postgresql://ana:pw@db/vla", "postgresql://ana:***@db/vla", store).endswith(
        ":pw@db/vla"
    )
    with pytest.raises(ValueError, match=r"^db: this workdir's earlier run used the metadata DB sqlite:///"):
        workdir_db("postgresql://ana@db/vla", sqlite, store)
    with pytest.raises(ValueError, match=r"^db: expected an SQLAlchemy URL"):
        workdir_db("not a url", None, store)


def test_ports_are_kept_across_runs_and_the_dashboard_prefers_its_usual_port(tmp_path: Path) -> None:
    path = tmp_path / "up.json"
    usual_free = port_free(DASHBOARD_PORT)
    first = Ports.load_or_pick(path)
    assert len(set(vars(first).values())) == 4
    assert (first.dashboard == DASHBOARD_PORT) == usual_free
    path.write_text(json.dumps({"ports": vars(first)}))
    assert Ports.load_or_pick(path) == first
    path.write_text(json.dumps({"ports": {"hub": first.hub}}))  # an older up.json without the dashboard
    assert Ports.load_or_pick(path).hub == first.hub


# ---------------------------------------------------------------------------- ready checks
def test_a_ready_check_believes_only_its_own_childs_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` gives each HTTP child a nonce through the environment and its ready check wants the nonce's
    tag back: another process answering on the port (another `up`'s dashboard, one started without a
    nonce) is not taken for the child. Real dashboard apps on loopback and a real hub registry process."""
    from dashboard_world import Dashboard

    from vla_rl.core.instance import INSTANCE_ENV, instance_tag, new_nonce
    from vla_rl.dashboard import DashboardConfig
    from vla_rl.hub.server import HubServer

    store = EpisodeStore(tmp_path / "store", create=True).root
    nonces = {"ours": new_nonce(), "theirs": new_nonce(), "none": ""}
    dash: dict[str, Dashboard] = {}
    try:
        for who, nonce in nonces.items():
            monkeypatch.setenv(INSTANCE_ENV, nonce)  # what `up` puts in its child's environment
            dash[who] = Dashboard(DashboardConfig(store=store, workdir=tmp_path / who, sync_db=False))
        tag = instance_tag(nonces["ours"])
        health = {who: f"{d.url}/api/v1/health" for who, d in dash.items()}
        assert http_ready(health["ours"], tag)()
        assert not http_ready(health["theirs"], tag)()  # another up's dashboard on the port
        assert http_ready(health["theirs"], instance_tag(nonces["theirs"]))()
        assert not http_ready(health["none"], tag)()  # a dashboard started without a nonce
        assert not http_ready(f"http://127.0.0.1:{free_port()}/api/v1/health", tag)()  # nobody there
        body = dash["ours"].client(None).get("/api/v1/health").json()
        assert body["instance"] == tag and nonces["ours"] not in json.dumps(body)  # its hash, not itself
        assert dash["none"].client(None).get("/api/v1/health").json()["instance"] is None
        # a fresh child's check: its own nonce, handed over in the environment only
        ready, env = http_child(health["ours"])
        assert set(env) == {INSTANCE_ENV} and env[INSTANCE_ENV] not in nonces.values() and not ready()
    finally:
        for d in dash.values():
            d.stop()
    # the hub registry's health answers the same way (HubServer: a real `vla_rl.hub` process)
    monkeypatch.setenv(INSTANCE_ENV, nonces["ours"])
    hub = HubServer(tmp_path / "hub").start()
    try:
        assert http_ready(f"{hub.url}/api/health", tag)()
        assert not http_ready(f"{hub.url}/api/health", instance_tag(nonces["theirs"]))()
    finally:
        hub.stop()


# ---------------------------------------------------------------------------- a port taken under the dashboard
_HTTP_CHILD = """
import json, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from vla_rl.core.instance import own_instance_tag

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"instance": own_instance_tag()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_port_taken_before_the_dashboard_binds_it_gets_a_fresh_one(tmp_path: Path) -> None:
    """One mechanism for a dashboard port someone else holds (another `up`'s dashboard, answering health
    with its own nonce): our child fails to bind, the ready check never takes the other answer for ours,
    the port is still taken once our child is gone, so the supervisor picks a fresh port and starts the
    child there once. Real HTTP children on loopback, real nonces."""

    def make(port: int) -> tuple[list[str], Callable[[], bool], dict[str, str]]:
        ready, env = http_child(f"http://127.0.0.1:{port}/api/v1/health")
        return [*_py(_HTTP_CHILD), str(port)], ready, env

    taken = free_port()
    other_argv, other_ready, other_env = make(taken)  # "another up's dashboard"
    other = subprocess.Popen(other_argv, env=os.environ | other_env)
    sup = Supervisor(tmp_path / "logs")
    try:
        end = time.monotonic() + 20
        while not other_ready() and time.monotonic() < end:
            time.sleep(0.05)
        port = sup.start_on_port("dashboard", taken, make, timeout_s=20)
        assert port is not None and port != taken
        assert (
            f"dashboard: port {taken} was taken by another process; starting it on port {port}" in sup.events
        )
        child = sup.children["dashboard"]
        assert child.proc is not None and child.proc.poll() is None and child.ready()
        assert other.poll() is None and other_ready()  # the other process was left alone
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        # a child that fails for another reason (its port free) is dropped, not retried elsewhere
        free = free_port()
        assert (
            sup.start_on_port("broken", free, lambda p: (_py("raise SystemExit(3)"), lambda: False, {}))
            is None
        )
        assert "broken" not in sup.children and "broken exited with code 3" in sup.events[-1]
    finally:
        sup.stop_all(timeout_s=2)
        other.kill()
        other.wait()

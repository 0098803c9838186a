"""`vla-rl dashboard` as a user starts it (a real process on a free port), its tokens file, and the
policy server's latency window behind the fleet page's p50 / p99 (fast: no simulator, no training)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.store import EpisodeStore
from server.batching import LatencyWindow
from sim.demos import record_demos
from vla_rl.cli import main
from vla_rl.dashboard.auth import TokenError, parse_tokens

CLI = [sys.executable, "-m", "vla_rl.cli"]


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*CLI, "dashboard", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VLA_RL_DASHBOARD")} | env,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(r"dashboard on (http://127\.0\.0\.1:\d+/)(#token=(\S+))?", line)
        if m:
            return proc, m.group(0)
        assert line or proc.poll() is None, "".join(lines)
    raise AssertionError("the dashboard did not start: " + "".join(lines))


def _until(pred: Any, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dash-cli") / "store"
    record_demos(EpisodeStore(root, create=True), "kinematic/Reach-v0", episodes=2, seed=0, progress=False)
    return root


def test_dashboard_process_with_a_tokens_file_and_a_generated_token(store: Path, tmp_path: Path) -> None:
    secret = tmp_path / "ana.secret"
    secret.write_text("ana-secret-token-0123456789\n")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[[token]]\nname = "ana"\nrole = "labeller"\ntoken_file = "' + str(secret) + '"\n'
        '[[token]]\nname = "olga"\nrole = "operator"\ntoken = "olga-secret-token-0123456789"\n'
    )
    proc, line = _start(
        ["--store", str(store), "--workdir", str(tmp_path / "w")],
        {"VLA_RL_DASHBOARD_TOKENS_FILE": str(tokens)},
    )
    try:
        url = line.split()[-1] if "#token" in line else line.split("dashboard on ")[1].split()[0]
        assert "#token" not in line  # a configured token is never printed
        assert httpx.get(timeout=60, url=url + "api/v1/health").json()["store"]["ok"]
        who = httpx.get(
            timeout=60,
            url=url + "api/v1/session",
            headers={"Authorization": "Bearer ana-secret-token-0123456789"},
        )
        assert who.json() == {"name": "ana", "role": "labeller"}
        assert "ana-secret-token" not in " ".join(proc.args)  # nothing secret on the command line
        # the store was written without its DB: the dashboard records its closed episodes on start
        olga = {"Authorization": "Bearer olga-secret-token-0123456789"}
        got = _until(
            lambda: httpx.get(url + "api/v1/episodes", headers=olga, timeout=60).json()["total"] == 2
        )
        assert got, "the store's episodes never showed up in the list"
    finally:
        _stop(proc)
    proc, line = _start(["--store", str(store), "--workdir", str(tmp_path / "w")], {})
    try:
        base, _, token = line.split("dashboard on ")[1].partition("#token=")
        assert token
        who = httpx.get(timeout=60, url=base + "api/v1/session", headers={"Authorization": f"Bearer {token}"})
        assert who.json() == {"name": "operator", "role": "operator"}
    finally:
        _stop(proc)


def test_dashboard_cli_errors_name_the_flag(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[token]]\nname = "x"\nrole = "admin"\ntoken = "0123456789abcdefgh"\n')
    assert main(["dashboard", "--store", str(store), "--tokens-file", str(bad), "--port", "0"]) == 2
    assert (
        "--tokens-file" in (err := capsys.readouterr().err)
        and "role: expected one of viewer, labeller, operator" in err
    )
    monkeypatch.setenv("VLA_RL_DASHBOARD_TOKEN", "short")
    assert main(["dashboard", "--store", str(store), "--port", "0"]) == 2
    assert "VLA_RL_DASHBOARD_TOKEN: expected at least 16 characters" in capsys.readouterr().err
    assert main(["dashboard", "--store", str(store), "--server", "nonsense"]) == 2
    assert "host:port" in capsys.readouterr().err


def test_tokens_file_parsing() -> None:
    t = parse_tokens('[[token]]\nname = "ana"\nrole = "viewer"\ntoken = "0123456789abcdef"\n', "f")
    assert t.lookup("0123456789abcdef").name == "ana" and t.lookup("0123456789abcdeX") is None
    assert not t.lookup("0123456789abcdef").may("labeller") and t.lookup("0123456789abcdef").may("viewer")
    for text, msg in (
        ("", "expected [[token]] entries"),
        ("token = 3", "expected [[token]] entries"),
        ('[[token]]\nname = "a"\nrole = "viewer"\n', "exactly one of token and token_file"),
        ('[[token]]\nname = "a"\nrole = "viewer"\ntoken = "short"\n', "at least 16"),
        ('[[token]]\nname = ""\nrole = "viewer"\ntoken = "0123456789abcdef"\n', "name: expected"),
        ('[[token]]\nname = "a"\nrole = "viewer"\ntoken = "0123456789abcdef"\npassword = 1\n', "unknown key"),
        (
            '[[token]]\nname = "a"\nrole = "viewer"\ntoken = "0123456789abcdef"\n'
            '[[token]]\nname = "b"\nrole = "operator"\ntoken = "0123456789abcdef"\n',
            "the same token",
        ),
        (
            '[[token]]\nname = "a"\nrole = "viewer"\ntoken_file = "/no/such/file"\n',
            "token_file: /no/such/file",
        ),
        ("[[token", "not valid TOML"),
    ):
        with pytest.raises(TokenError, match=re.escape(msg)):
            parse_tokens(text, "f")


def test_latency_window_percentiles_rate_and_expiry() -> None:
    w = LatencyWindow(window_s=60.0, rate_window_s=10.0, max_samples=1000)
    assert w.summary(now=0.0) == (0.0, 0.0, 0.0)
    for i in range(100):
        w.add(float(i + 1), now=100.0 + i * 0.1)  # 1..100 ms over 10 s
    p50, p99, rate = w.summary(now=110.0)
    assert p50 == pytest.approx(50.5) and p99 == pytest.approx(99.01) and rate == pytest.approx(10.0)
    assert w.summary(now=125.0)[2] == 0.0 and w.summary(now=125.0)[0] == pytest.approx(
        50.5
    )  # rate: last 10 s
    assert w.summary(now=200.0) == (0.0, 0.0, 0.0)  # all older than the window
    small = LatencyWindow(max_samples=10)
    for i in range(50):
        small.add(float(i), now=1.0)
    assert small.summary(now=1.0)[0] == pytest.approx(44.5)  # the newest 10 only


def test_on_postgresql_a_db_that_goes_down_is_503_naming_it_and_recovers(store: Path, tmp_path: Path) -> None:
    """The dashboard on PostgreSQL: the list runs there; the server stops -> health and the API say so
    (503 naming the URL, never a traceback); it comes back -> the API works again by itself."""
    from dashboard_world import Dashboard
    from pg_cluster import start_cluster

    from vla_rl.dashboard import DashboardConfig

    pg = start_cluster()
    try:
        url = pg.create_database("dash")
        cfg = DashboardConfig(store=store, db=url, workdir=tmp_path / "w")
        d = Dashboard(cfg)
        try:
            c = d.client("viewer")
            assert _until(lambda: c.get("/api/v1/episodes").json()["total"] == 2)
            assert c.get("/api/v1/health").json()["db"]["ok"]
            opts = f"-p {pg.port} -k {pg.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
            pg._run("pg_ctl", "-D", str(pg.data), "-m", "fast", "-w", "stop", timeout=60)
            h = c.get("/api/v1/health").json()["db"]
            assert not h["ok"] and f"127.0.0.1:{pg.port}" in h["error"] and "--db" in h["error"]
            r = c.get("/api/v1/episodes")
            assert r.status_code == 503 and r.json()["detail"]["field"] == "db"
            assert f"127.0.0.1:{pg.port}" in r.json()["detail"]["message"]
            r = d.client("labeller").post(
                "/api/v1/labels", json={"episode_ids": ["x"], "key": "quality", "value": "good"}
            )
            assert r.status_code == 503 and r.json()["detail"]["field"] == "db"
            pg._run("pg_ctl", "-D", str(pg.data), "-o", opts, "-l", str(pg.dir / "log"), "-w", "start")
            seen: list[str] = []
            assert _until(
                lambda: seen.append(c.get("/api/v1/episodes").text[:600]) or seen[-1].startswith('{"total"')
            ), seen[-3:]
            assert c.get("/api/v1/health").json()["db"]["ok"]
        finally:
            d.stop()
    finally:
        pg.stop()

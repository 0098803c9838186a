"""docker/: the compose file and the images hold together without a Docker engine (~5 s: two services start as subprocesses).

There is no Docker engine on the development machines, so this checks what can be checked:

* docker/compose.yaml parses (PyYAML) and holds the loop's services;
* every service whose command starts with ``vla-rl`` is a real command: ``vla-rl PATH --help`` exits 0
  in-process and names every ``--flag`` the service uses;
* ports agree: a service's ``--port`` / ``--metrics-port`` is the container side of its ``ports``, its
  health check probes that port, and every ``host:port`` other services reach it at (URLs, environment)
  uses the service's name and that port; the database URLs point at the postgres service;
* every named volume and secret a service uses is declared at the top level, every ``--token-file`` is a
  mounted secret, and no token or password is written in the file;
* the hub's and the collector's health checks pass against the real service (started here on loopback)
  and fail once it stops; the policy server's is the collector's (the standard gRPC health service) on
  its own port;
* both Dockerfiles run scripts/setup.sh, COPY every top-level package folder plus requirements/ and
  scripts/, and end in a CMD that is a real command; .dockerignore keeps secrets and venvs out.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from test_docs import has_option, help_text

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
PACKAGES = ["vla_rl", "sim", "fleet", "policies", "server"]
PATH_WORD = re.compile(r"^[a-z][a-z0-9-]*$")

SPEC = yaml.safe_load(COMPOSE.read_text())
SERVICES: dict[str, dict] = SPEC["services"]


def words(command: str | list[str] | None) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def vla_rl_services() -> dict[str, list[str]]:
    return {
        n: words(s.get("command")) for n, s in SERVICES.items() if words(s.get("command"))[:1] == ["vla-rl"]
    }


def split(cmd: list[str]) -> tuple[list[str], list[str]]:
    """(subcommand path, the rest) of a vla-rl command's words (after ``vla-rl``)."""
    rest = cmd[1:]
    path = []
    while rest and PATH_WORD.match(rest[0]):
        path.append(rest.pop(0))
    return path, rest


def flag_value(cmd: list[str], flag: str) -> str | None:
    for i, w in enumerate(cmd):
        if w == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return None


def container_ports(service: dict) -> set[int]:
    """Container-side ports of a service's ``ports`` and ``expose``."""
    out = set()
    for p in [*service.get("ports", []), *service.get("expose", [])]:
        out.add(int(str(p["target"] if isinstance(p, dict) else p).split(":")[-1].split("/")[0]))
    return out


def listen_ports(name: str) -> set[int]:
    cmd = words(SERVICES[name].get("command"))
    if cmd[:1] != ["vla-rl"]:
        return container_ports(SERVICES[name])  # another image: what it publishes or exposes
    return {int(v) for f in ("--port", "--metrics-port") if (v := flag_value(cmd, f))}


def healthcheck_text(service: dict) -> str:
    test = service["healthcheck"]["test"]
    return test if isinstance(test, str) else " ".join(test)


def all_strings(obj: object) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in all_strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in all_strings(v)]
    return []


def test_compose_has_the_loop() -> None:
    assert {"hub", "policy-server", "collector", "round-worker", "dashboard", "postgres", "s3"} <= set(
        SERVICES
    )
    assert SERVICES["round-worker"]["deploy"]["replicas"] >= 2  # scales out
    assert SERVICES["postgres"]["image"].startswith("postgres:")
    assert "pg_isready" in healthcheck_text(SERVICES["postgres"])
    assert "8780:8780" in SERVICES["dashboard"]["ports"]
    assert "--tokens-file" in SERVICES["dashboard"]["command"]  # roles and tokens from a secret file
    for name, service in SERVICES.items():
        assert "healthcheck" in service, f"{name} has no health check"
    assert vla_rl_services().keys() == {"hub", "policy-server", "collector", "round-worker", "dashboard"}


@pytest.mark.parametrize("name", sorted(vla_rl_services()))
def test_service_command_is_a_real_vla_rl_command(name: str) -> None:
    cmd = vla_rl_services()[name]
    path, rest = split(cmd)
    code, help_ = help_text(tuple(path))
    assert code == 0, f"{name}: vla-rl {' '.join(path)} --help exited {code}:\n{help_}"
    flags = [w.split("=", 1)[0] for w in rest if w.startswith("--")]
    assert flags, name
    missing = [f for f in flags if not has_option(help_, f)]
    assert not missing, f"{name}: vla-rl {' '.join(path)} has no {missing}"


@pytest.mark.parametrize("name", sorted(vla_rl_services()))
def test_network_services_bind_all_interfaces(name: str) -> None:
    cmd = vla_rl_services()[name]
    if flag_value(cmd, "--port"):
        assert flag_value(cmd, "--host") == "0.0.0.0", (
            f"{name} binds loopback: unreachable from other containers"
        )
    if flag_value(cmd, "--metrics-port"):
        assert flag_value(cmd, "--metrics-host") == "0.0.0.0", name


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_ports_agree(name: str) -> None:
    service = SERVICES[name]
    cmd = words(service.get("command"))
    published = container_ports(service)
    for flag in ("--port", "--metrics-port"):
        if (v := flag_value(cmd, flag)) is not None:
            assert int(v) in published, f"{name}: {flag} {v} is not among its ports {sorted(published)}"
    if name == "postgres":
        assert 5432 in published
    if name == "s3":
        assert {
            int(flag_value(cmd, f).rsplit(":", 1)[1]) for f in ("--address", "--console-address")
        } <= published
    probed = {
        int(p) for p in re.findall(r"(?:127\.0\.0\.1|localhost|-p) ?:?(\d{2,5})", healthcheck_text(service))
    }
    assert probed <= listen_ports(name), (name, probed)
    if flag_value(cmd, "--port"):
        assert int(flag_value(cmd, "--port")) in probed, f"{name}: the health check does not probe --port"


def test_services_reach_each_other_at_their_ports() -> None:
    """Every ``service:port`` in another service's command, environment or health check is one it listens on."""
    pattern = re.compile(rf"(?<![\w.-])({'|'.join(map(re.escape, SERVICES))}):(\d{{2,5}})\b")
    seen = set()
    for name, service in SERVICES.items():
        for s in all_strings({k: service.get(k) for k in ("command", "environment", "healthcheck")}):
            for target, port in pattern.findall(s):
                if target == name:
                    continue
                assert int(port) in listen_ports(target), (
                    f"{name} reaches {target}:{port}, it listens on {listen_ports(target)}"
                )
                seen.add(target)
    assert {"hub", "postgres"} <= seen
    for name in ("collector", "round-worker"):
        cmd = words(SERVICES[name]["command"])
        url = flag_value(cmd, "--db") or flag_value(cmd, "--db-url")
        assert url and re.match(r"postgresql(\+psycopg)?://[^:@/]+@postgres:5432/", url), (
            name,
            url,
        )  # no password
        assert SERVICES["postgres"]["environment"]["POSTGRES_DB"] == url.rsplit("/", 1)[1]
        assert SERVICES["postgres"]["environment"]["POSTGRES_USER"] == url.split("//")[1].split("@")[0]
        assert "pgpass" in SERVICES[name]["secrets"]
    assert SERVICES["policy-server"]["environment"]["VLA_RL_HUB"] == "http://hub:8808"
    ref = flag_value(words(SERVICES["policy-server"]["command"]), "--checkpoint")
    assert ref.startswith("hub://") and ref.endswith("@prod")
    assert flag_value(words(SERVICES["policy-server"]["command"]), "--follow")


def test_volumes_are_declared_and_shared_where_needed() -> None:
    declared = set(SPEC["volumes"])
    mounts: dict[str, dict[str, str]] = {}
    for name, service in SERVICES.items():
        for v in service.get("volumes", []):
            source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            assert not source.startswith((".", "/")), f"{name}: bind mount {source}; use a named volume"
            assert source in declared, f"{name} uses undeclared volume {source}"
            mounts.setdefault(name, {})[source] = target
    assert {"hub-data", "store", "postgres-data"} <= declared
    assert set(declared) <= {s for m in mounts.values() for s in m}, "a declared volume nobody mounts"
    # each data folder a command names is on a volume, and the collector and workers share the store
    for name, cmd in vla_rl_services().items():
        for flag in ("--data", "--store"):
            if (path := flag_value(cmd, flag)) is not None:
                assert path in mounts.get(name, {}).values(), f"{name}: {flag} {path} is not a volume"
    assert mounts["collector"]["store"] == mounts["round-worker"]["store"]
    assert mounts["postgres"]["postgres-data"] == "/var/lib/postgresql/data"


def test_secrets_are_declared_mounted_and_not_baked_in() -> None:
    declared = SPEC["secrets"]
    for name, secret in declared.items():
        assert secret["file"].startswith("secrets/"), name  # docker/secrets/, ignored by git
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "docker/secrets/*" in gitignore
    for name, service in SERVICES.items():
        used = [s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])]
        assert set(used) <= set(declared), f"{name} uses undeclared secrets {set(used) - set(declared)}"
        cmd = words(service.get("command"))
        if (f := flag_value(cmd, "--token-file")) is not None:
            assert f.startswith("/run/secrets/") and f.removeprefix("/run/secrets/") in used, (name, f)
        for value in (service.get("environment") or {}).values():
            if str(value).startswith("/run/secrets/"):
                assert str(value).removeprefix("/run/secrets/") in used, (name, value)
        assert flag_value(cmd, "--token") is None, f"{name} passes a token on its command line"
        env = service.get("environment") or {}
        for key in env:
            assert not re.search(r"TOKEN$|PASSWORD$|SECRET", key), f"{name} sets {key} in the compose file"
    for name in vla_rl_services():
        if name != "round-worker":
            flag = "--tokens-file" if name == "dashboard" else "--token-file"  # the dashboard's carry roles
            assert flag_value(vla_rl_services()[name], flag), f"{name} runs without a token"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_with_the_setup_script(dockerfile: Path) -> None:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0].startswith("FROM ")
    copied = {ln.split()[1].rstrip("/") for ln in lines if ln.startswith("COPY ")}
    assert {*PACKAGES, "requirements", "scripts", "pyproject.toml"} <= copied, copied
    for src in copied:
        assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
    assert any(ln.startswith("RUN ") and "scripts/setup.sh" in ln for ln in lines)
    assert not any("VLA_RL_SKIP_APT=1" in ln for ln in lines)  # setup.sh installs the system packages
    env = " ".join(ln for ln in lines if ln.startswith("ENV "))
    assert "VLA_RL_PYTHON=" in env and "3.12" in env.split("VLA_RL_PYTHON=")[1].split()[0]
    assert re.search(r"PATH=\S*/\.venv/bin", env)
    assert not re.search(r"TOKEN|PASSWORD", env), "a secret baked into the image"
    cmd_lines = [ln for ln in lines if ln.startswith(("CMD ", "ENTRYPOINT "))]
    assert cmd_lines, f"{dockerfile.name} has no CMD"
    cmd = yaml.safe_load(cmd_lines[-1].split(None, 1)[1])  # the exec (JSON) form
    assert cmd[0] == "vla-rl"
    path, rest = split(cmd)
    code, help_ = help_text(tuple([*path, *rest] if "--help" not in rest else path))
    assert code == 0, help_


def test_cuda_image_has_a_cuda_base() -> None:
    first = next(ln for ln in DOCKERFILES[1].read_text().splitlines() if ln.startswith("FROM "))
    assert first.split()[1].startswith("nvidia/cuda:") and "runtime" in first


def test_dockerignore_keeps_secrets_and_venvs_out() -> None:
    entries = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    assert {".git", ".venv", "docker/secrets", "runs"} <= entries
    assert not entries & {*PACKAGES, "requirements", "scripts"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["hub", "collector"])
def test_health_check_passes_against_the_real_service(name: str, tmp_path: Path) -> None:
    """The health check's own command (python one-liner), run here against the service started on loopback."""
    import os
    import subprocess
    import sys
    import time

    service = SERVICES[name]
    cmd = words(service["command"])
    port, new = flag_value(cmd, "--port"), str(free_port())
    args = {
        "hub": ["hub", "serve", "--data", str(tmp_path / "hub")],
        "collector": ["collect", "--store", str(tmp_path / "s"), "--store-writers", "0"],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("VLA_RL_HUB_TOKEN", "VLA_RL_COLLECTOR_TOKEN"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vla_rl.cli", *args[name], "--port", new],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    probe = [sys.executable, *(w.replace(f":{port}", f":{new}") for w in test[2:])]
    try:
        deadline, code = time.monotonic() + 90, 1
        while time.monotonic() < deadline and proc.poll() is None:
            code = subprocess.run(probe, capture_output=True, timeout=30).returncode
            if code == 0:
                break
            time.sleep(0.5)
        assert code == 0, (
            f"{name}'s health check never passed: {proc.stderr.read().decode()[-2000:] if proc.poll() is not None else 'still failing'}"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    dead = [sys.executable, *(w.replace(f":{port}", f":{new}") for w in test[2:])]
    assert subprocess.run(dead, capture_output=True, timeout=30).returncode != 0  # fails once it is down


def test_policy_server_health_check_is_the_tested_grpc_probe() -> None:
    """The policy server needs a checkpoint to start, so its probe is checked to be the collector's, tested above."""
    collector, server = (SERVICES[n]["healthcheck"]["test"] for n in ("collector", "policy-server"))
    port_c = flag_value(words(SERVICES["collector"]["command"]), "--port")
    port_s = flag_value(words(SERVICES["policy-server"]["command"]), "--port")
    assert server == [w.replace(f":{port_c}", f":{port_s}") for w in collector]

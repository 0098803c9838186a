"""The policy server on a Unix domain socket (``--unix-socket``), for robots on the same host: served beside
TCP and instead of it, the same token checks, two clients told apart as two robots, and every path the
server must refuse (a folder others can reach, a non-socket file, a symbolic link, a live server's socket,
``..``, a path too long) refused with an error that names it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_server import TOKEN, make_checkpoint, make_obs, start_server
from vla_rl_client.aio_policy_client import AsyncPolicyClient
from vla_rl_client.policy_client import PolicyClient, PolicyError

from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.unix_socket import MAX_SOCKET_PATH_BYTES, SocketPathError, prepare_socket_path

SC = grpc.StatusCode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("unix") / "a", 0)


@pytest.fixture(scope="module")
def both(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    """A server on loopback TCP and on a socket in a folder it creates."""
    path = tmp_path_factory.mktemp("run") / "vla" / "policy.sock"
    srv = start_server({"arm": ckpt}, unix_socket=path)
    yield srv
    srv.stop()


def test_served_on_the_socket_as_on_tcp(both: PolicyServer) -> None:
    path = both.unix_socket
    assert path is not None and both.unix_address == f"unix://{path}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "only this user may connect"
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700, "the folder it created is its own"
    assert both.address == f"127.0.0.1:{both.port}", "TCP still the main address"
    obs = make_obs(np.random.default_rng(0))
    with PolicyClient(both.address, timeout_s=10) as tcp, PolicyClient(both.unix_address, timeout_s=10) as ux:
        want = tcp.act(obs, seed=3).actions
        np.testing.assert_allclose(ux.act(obs, seed=3).actions, want, rtol=0, atol=1e-6)
        with ux.stream() as s:
            r = s.act(obs, seed=3)
        np.testing.assert_allclose(r.actions, want, rtol=0, atol=1e-6)
        assert r.timing.total_us > 0 and r.timing.round_trip_us >= r.timing.total_us - 1
        assert ux.info()["arm"].commit == tcp.info()["arm"].commit
        assert ux.health() == "SERVING"

    async def aio() -> np.ndarray:
        async with AsyncPolicyClient(both.unix_address, timeout_s=10) as c, c.stream() as s:
            return (await s.act(obs, seed=3)).actions

    np.testing.assert_allclose(asyncio.run(aio()), want, rtol=0, atol=1e-6)


def test_the_socket_checks_the_control_token(both: PolicyServer) -> None:
    assert both.unix_address is not None
    for token in (None, "wrong-token"):
        with PolicyClient(both.unix_address, token=token, timeout_s=10, model_id="arm") as c:
            for call in (c.rollback, c.promote):
                with pytest.raises(PolicyError) as err:
                    call()
                assert err.value.code == SC.UNAUTHENTICATED
    with PolicyClient(both.unix_address, token=TOKEN, timeout_s=10, model_id="arm") as c:
        with pytest.raises(PolicyError) as err:
            c.rollback()  # authenticated, but nothing to roll back to
        assert err.value.code == SC.FAILED_PRECONDITION


def test_two_socket_clients_are_two_robots(both: PolicyServer) -> None:
    """Every client of a Unix socket has the same peer address (``unix:``): without the channel id each
    client sends, two robots would look like one to the adaptive batching wait."""
    assert both.unix_address is not None
    slot = both.slot("arm")
    obs = make_obs(np.random.default_rng(1))
    with (
        PolicyClient(both.unix_address, timeout_s=10) as a,
        PolicyClient(both.unix_address, timeout_s=10) as b,
    ):
        before = set(slot.queue._last_seen)
        a.act(obs, seed=0)
        with b.stream() as s:
            s.act(obs, seed=0)
        seen = {p for p in slot.queue._last_seen if p.startswith("unix:")} - before
        assert len(seen) == 2, seen


def test_socket_only_and_removed_on_stop(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--no-tcp needs --unix-socket"):
        ServerConfig(checkpoint=str(ckpt), tcp=False)
    folder = tmp_path / "own"
    folder.mkdir(mode=0o700)
    srv = start_server({"arm": ckpt}, unix_socket=folder / "p.sock", tcp=False)
    try:
        assert srv.address == f"unix://{folder / 'p.sock'}"
        with PolicyClient(srv.address, timeout_s=10) as c:
            assert c.act(make_obs(np.random.default_rng(0)), seed=0).actions.shape == (4, 3)
    finally:
        srv.stop()
    assert not (folder / "p.sock").exists()


def _folder(tmp_path: Path, mode: int = 0o700) -> Path:
    folder = tmp_path / "sockets"
    folder.mkdir()
    folder.chmod(mode)
    return folder


def test_paths_it_refuses(tmp_path: Path) -> None:
    open_folder = _folder(tmp_path, 0o777)
    with pytest.raises(SocketPathError, match=r"open to other users \(mode 0777\); expected 0700"):
        prepare_socket_path(open_folder / "p.sock")
    open_folder.chmod(0o700)
    regular = open_folder / "notes.txt"
    regular.write_text("keep me")
    with pytest.raises(SocketPathError, match="exists and is not a socket; refusing to replace it"):
        prepare_socket_path(regular)
    assert regular.read_text() == "keep me"
    (open_folder / "sub").mkdir()
    with pytest.raises(SocketPathError, match="is not a socket"):
        prepare_socket_path(open_folder / "sub")
    link = open_folder / "link.sock"
    link.symlink_to(tmp_path / "elsewhere.sock")
    with pytest.raises(SocketPathError, match="symbolic link"):
        prepare_socket_path(link)
    with pytest.raises(SocketPathError, match=r"without '\.\.'"):
        prepare_socket_path(open_folder / ".." / "p.sock")
    too_long = open_folder / ("x" * MAX_SOCKET_PATH_BYTES)
    with pytest.raises(SocketPathError, match=f"at most {MAX_SOCKET_PATH_BYTES} bytes"):
        prepare_socket_path(too_long)
    with pytest.raises(ValueError, match="unix_socket: expected a path without"):
        ServerConfig(checkpoint="x", unix_socket=open_folder / ".." / "p.sock")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    os.chown(folder, 65534, 65534)
    with pytest.raises(SocketPathError, match="belongs to uid 65534, not this user"):
        prepare_socket_path(folder / "p.sock")


def test_a_stale_socket_is_replaced_and_a_live_one_refused(
    ckpt: Path, both: PolicyServer, tmp_path: Path
) -> None:
    folder = _folder(tmp_path)
    stale = folder / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # closed without unlinking: what a killed server leaves
    assert prepare_socket_path(stale) == stale and not stale.exists()
    assert both.unix_socket is not None
    with pytest.raises(SocketPathError, match="a server is already listening on"):
        start_server({"arm": ckpt}, unix_socket=both.unix_socket)
    with PolicyClient(both.unix_address or "", timeout_s=10) as c:
        assert c.health() == "SERVING", "the first server keeps its socket"


def test_the_cli_refuses_a_path_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vla_rl.cli import main

    taken = _folder(tmp_path) / "notes.txt"
    taken.write_text("")
    argv = ["serve", "--checkpoint", str(tmp_path / "no-such-checkpoint"), "--unix-socket", str(taken)]
    assert main([*argv, "--no-tcp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --unix-socket: ") and err.count("\n") == 1, err
    assert "is not a socket; refusing to replace it" in err, err

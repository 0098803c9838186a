"""A small Hugging Face Hub-compatible server, so the real ``huggingface_hub`` client can push and pull
checkpoints on one machine (the real Hub is not always reachable, and no installable server does writes).

It implements exactly the routes the client (1.x, classic LFS transfer) uses for a round trip: create repo,
model info, preupload, the LFS batch API with upload URLs pointing back here, the NDJSON commit, tags,
branches, refs, commits, tree, paths-info and ``resolve`` downloads with the headers the client checks
(``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``/``X-Linked-Size``, ranges). Payload shapes were taken from the
client's own source. Storage lives in :mod:`vla_rl.hub.storage`,
the routes in :mod:`vla_rl.hub.routes` (one router per resource); this module builds the app and runs it.

Clients must disable Xet (``HF_HUB_DISABLE_XET=1``, see :func:`vla_rl.hub.registry.configure_hub`): Xet
uploads need a CAS service this server does not have (``/xet-write-token`` answers 501 with that advice).

Security model (enforced in :mod:`vla_rl.hub.routes.auth`): one shared token. When the server has one, every
write (create, preupload, LFS batch and verify, commit, tag, branch, delete) needs ``Authorization: Bearer
<token>``; reads are public unless the server is ``private`` or the repo was created private (then a read
without the token answers exactly like a missing repo: 404 RepoNotFound). LFS upload URLs carry an HMAC signature instead of the token because the client sends no
``Authorization`` header on those PUTs (it treats them as pre-signed storage URLs). Repo ids and every file
path are validated before use, and file paths never touch the filesystem (contents are stored by hash).
Binds 127.0.0.1 by default.

Request bodies are bounded by :class:`~vla_rl.hub.limits.Limits` (413 naming the setting), commits are
parsed as a stream, and all parsing, hashing and disk work runs in the threadpool, so one large upload does not
hold up other requests. Bad input answers 4xx with a JSON error, a full disk 507.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from vla_rl.core.instance import own_instance_tag
from vla_rl.core.lifeline import exit_with_parent
from vla_rl.core.scheduling import leave_realtime
from vla_rl.hub.config import HubConfig
from vla_rl.hub.limits import Limits
from vla_rl.hub.routes import ROUTERS
from vla_rl.hub.routes.errors import add_error_handlers
from vla_rl.hub.routes.state import Hub, Settings
from vla_rl.hub.storage import HubStorage

log = logging.getLogger("vla_rl.hub.server")


def create_app(
    data_dir: str | os.PathLike[str],
    *,
    token: str | None = None,
    private: bool = False,
    user: str = "local",
    limits: Limits | None = None,
) -> FastAPI:
    """Build the FastAPI app serving the repos under ``data_dir`` (created if missing)."""
    storage = HubStorage(data_dir)
    settings = Settings(
        token=token or None, private=private, user=user, secret=storage.secret(), limits=limits or Limits()
    )
    app = FastAPI(title="vla-rl local hub", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hub = Hub(storage=storage, settings=settings)
    app.state.instance = own_instance_tag()  # which supervisor's child this is (/api/health says)
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


# ----- running it --------------------------------------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _sock_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_keep_alive=30,
        lifespan="off",
        log_config=None,  # keep the host process's logging setup (vla_rl.core.logs)
    )
    return uvicorn.Server(config)


def _serve_socket(
    sock: socket.socket,
    data_dir: str | os.PathLike[str],
    token: str | None,
    private: bool,
    log_level: str,
    limits: Limits,
    started: Callable[[Any], None] | None = None,
) -> None:
    app = create_app(data_dir, token=token, private=private, limits=limits)
    server = _uvicorn_server(app, log_level)
    if started is not None:
        started(server)
    url = _sock_url(sock)
    log.info(
        "hub listening on %s",
        url,
        extra={"url": url, "data": str(Path(data_dir).resolve()), "auth": token is not None},
    )
    server.run(sockets=[sock])


def serve(config: HubConfig, *, private: bool = False, log_level: str = "info") -> None:
    """Run the Hub server ``config`` describes in the foreground until interrupted (Ctrl-C / SIGTERM).

    ``port=0`` picks a free port (logged as ``hub listening url=...``). Without a token anyone who can reach
    the port can write, so a non-loopback ``host`` without a token is allowed but warned about.
    """
    token = config.resolved_token()
    if token is None and not _is_loopback(config.host):
        log.warning("hub binds %s without a token: anyone on the network can push and delete", config.host)
    sock = _bind(config.host, config.port)
    try:
        _serve_socket(sock, config.data, token, private, log_level, config.limits)
    finally:
        sock.close()


_CHILD_ENV = "VLA_RL_HUB_CHILD"


def _serve_child() -> None:
    """Entry of :class:`HubServer` subprocesses: settings (token included) come through the environment, not
    argv, so the token never shows in ``ps``; the listening socket is inherited from the parent."""
    cfg = json.loads(os.environ.pop(_CHILD_ENV))
    # A killed test run or CLI must not leave a server holding the port and the data folder.
    exit_with_parent(cfg.get("parent", os.getppid()), code=0, interval_s=1.0, where="hub server process")
    logging.basicConfig(
        level=cfg["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    leave_realtime("hub server process")
    sock = socket.socket(fileno=cfg["fd"])
    _serve_socket(
        sock, cfg["data_dir"], cfg["token"], cfg["private"], cfg["log_level"], Limits(**cfg["limits"])
    )


class HubServer:
    """Run the Hub server in the background, for tests and for embedding in ``vla-rl up``.

    ``port=0`` (the default) picks a free port; :attr:`url` gives the address once started. By default the
    server runs in a thread of this process; ``subprocess=True`` runs it in a child process instead, which keeps
    its Python work off this process's GIL (use it when measuring throughput or when the host is busy) and
    lets a test kill it. The listening socket is bound here in both modes, so the port is known before start
    returns and there is no window in which another process could take it.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        private: bool = False,
        subprocess: bool = False,
        log_level: str = "warning",
        limits: Limits | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host, self.port = host, port
        self.token, self.private = token, private
        self.use_subprocess = subprocess
        self.log_level = log_level
        self.limits = limits or Limits()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._proc: Any = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("HubServer is not started")
        return self._url

    def start(self, timeout: float = 30.0) -> HubServer:
        if self._url is not None:
            return self
        self._sock = _bind(self.host, self.port)
        self._url = _sock_url(self._sock)
        if self.use_subprocess:
            self._start_process()
        else:
            self._start_thread()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_thread(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def started(server: Any) -> None:
            self._server = server
            ready.set()

        def run() -> None:
            try:
                assert self._sock is not None
                _serve_socket(
                    self._sock,
                    self.data_dir,
                    self.token,
                    self.private,
                    self.log_level,
                    self.limits,
                    started,
                )
            except BaseException as e:  # surfaced by _wait_ready
                failure.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, name="vla-rl-hub", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"hub server failed to start: {failure[0]!r}") from failure[0]

    def _start_process(self) -> None:
        assert self._sock is not None
        cfg = {
            "fd": self._sock.fileno(),
            "data_dir": str(self.data_dir),
            "token": self.token,
            "private": self.private,
            "log_level": self.log_level,
            "limits": dataclasses.asdict(self.limits),
            "parent": os.getpid(),  # known before the fork: a parent that dies first is noticed too
        }
        env = {**os.environ, _CHILD_ENV: json.dumps(cfg)}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from vla_rl.hub.server import _serve_child; _serve_child()"],
            env=env,
            pass_fds=(self._sock.fileno(),),
        )

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"hub server process exited with code {self._proc.returncode}")
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("hub server thread exited during startup")
            if self._server is not None and self._server.started:
                return
            if self._proc is not None:
                try:
                    if httpx.get(f"{self.url}/api/health", timeout=1.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"hub server at {self.url} not ready after {timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._server = None
        self._url = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

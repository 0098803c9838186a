"""A process supervisor: starts services and waits until each is ready, restarts one that dies (with
backoff), runs jobs to their end, and stops them all in stages on the way out.

It knows nothing of what it runs: a child is a command line, a ready check and its environment. The ready
checks a child may use are here too (a TCP port that accepts, an HTTP health answer carrying the child's
own nonce, :mod:`vla_rl.core.instance`), and the free-port helpers. ``vla-rl up`` (:mod:`vla_rl.up`) is
its user.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vla_rl.core.instance import INSTANCE_ENV, instance_tag, new_nonce
from vla_rl.core.lifeline import supervised_env

log = logging.getLogger(__name__)


@dataclass
class Child:
    """One supervised process: a service (:meth:`Supervisor.start`) or a job (:meth:`Supervisor.run`)."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str]
    log_path: Path
    required: bool = True
    """False: the supervisor goes on without it when it cannot start or keeps dying (an optional service)."""
    stop_order: int = 0
    """:meth:`Supervisor.stop_all` stops lower numbers first: what uses the others before what they use."""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0


@dataclass
class Supervisor:
    """Starts services, restarts one that dies (with backoff), runs jobs (processes run to their end), stops
    them all on the way out; each logs to ``logs/NAME.log``. Each process gets its own process group (a
    terminal's Ctrl-C reaches the supervising process alone, which stops them in order) and
    :func:`vla_rl.core.lifeline.supervised_env`: it acts on SIGINT even where the supervising process was
    started ignoring it, and it stops by itself when that process dies (SIGKILL, a crash)."""

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
            if attempt == 0 and not port_free(port):
                taken, port = port, free_port()
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
                process_group=0,  # Ctrl-C at a terminal reaches the supervisor; it stops the children in order
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
        """While the ``with`` block runs, a thread calls :meth:`check` every second (its errors are logged);
        an exception leaving the block (Ctrl-C) makes a restart under way give up at once."""
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
        that nothing spins on a dependency already gone (``vla-rl up``: the fleet and the worker first, then
        server and collector, the registry last). Then all are waited for against the one deadline; what still runs
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
                wait_all(group, min(end, time.monotonic() + stage_s))
            wait_all(procs, end)
        except KeyboardInterrupt:
            log.warning("interrupted again: killing what still runs")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()


def wait_all(procs: list[subprocess.Popen[bytes]], until: float) -> None:
    """Wait for every process in ``procs`` to exit, until the ``time.monotonic()`` deadline ``until``."""
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, until - time.monotonic()))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS's pick; another process may take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tcp_ready(port: int) -> Callable[[], bool]:
    """Ready when something accepts TCP connections on 127.0.0.1:``port``."""

    def ready() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    return ready


def http_ready(url: str, instance: str) -> Callable[[], bool]:
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


def http_child(url: str) -> tuple[Callable[[], bool], dict[str, str]]:
    """A ready check for an HTTP child and the environment that gives the child its nonce (a fresh one)."""
    nonce = new_nonce()
    return http_ready(url, instance_tag(nonce)), {INSTANCE_ENV: nonce}

"""Child processes end with the process that started them, and act on Ctrl-C however they were started.

Two ways a supervised child (``vla-rl up``'s registry, policy server, collector, worker, dashboard and
fleet; the fleet's robots; a worker's round process; a sim env worker) used to outlive the stop:

1. **Its parent dies without stopping it** (SIGKILL, the OOM killer, a crash): nothing tells the child.
   ``prctl(PR_SET_PDEATHSIG)`` fires when the *thread* that forked the child exits, not the process (and
   ``vla-rl up`` restarts children from a watcher thread that ends before it does), so instead the child
   runs :func:`exit_with_parent`: a daemon thread polls ``getppid()`` against the parent's pid, known from
   before the fork (an argument, :data:`SUPERVISOR_ENV`, or ``multiprocessing.parent_process()``), which
   changes the moment the parent is gone, whatever killed it. The child then stops the way Ctrl-C stops
   it (its clean path: a collector flushes what it acknowledged), or at once where there is nothing to
   save; past ``grace_s`` it exits regardless.
2. **SIGINT ignored from birth**: a process started as a background job of a non-interactive shell (``cmd
   &`` in a script, many CI runners and agents' shells) inherits SIGINT as ignored, every process it starts
   inherits that too, and Python then keeps it ignored (no KeyboardInterrupt). ``vla-rl up`` stops its
   children with SIGINT, so under such a parent the policy server, the collector and the worker ignored it
   and were SIGKILLed after the grace period (the hub, whose uvicorn installs its own handler, stopped).
   :func:`act_on_interrupt` puts Python's handler back: every ``vla-rl`` command stops on Ctrl-C.

A supervisor sets ``env |= supervised_env()`` on each child; every ``vla-rl`` process calls :func:`install`
first thing (``vla_rl.cli.main`` does, next to :func:`vla_rl.core.scheduling.leave_realtime`). This module
imports nothing of ours: ``fleet/``, ``sim/``, ``server/`` and ``vla_rl/`` all use it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "VLA_RL_SUPERVISOR_PID"
"""The environment variable naming the pid of the process a child must not outlive."""
STOP_GRACE_S = 5.0
"""How long a supervised child whose supervisor died may take to stop cleanly before it exits anyway."""


def supervised_env() -> dict[str, str]:
    """The environment entries that make a child started by this process stop when this process dies
    (the child calls :func:`install`)."""
    return {SUPERVISOR_ENV: str(os.getpid())}


def exit_with_parent(
    parent_pid: int | None = None,
    *,
    grace_s: float = 0.0,
    code: int = 1,
    interval_s: float = 0.25,
    where: str = "this process",
) -> threading.Thread:
    """Start a daemon thread that ends this process once ``parent_pid`` is no longer its parent.

    ``parent_pid`` None: ``multiprocessing.parent_process()``'s pid in a ``multiprocessing`` child (known
    from before it started, so a parent that died first is noticed too), else ``os.getppid()`` now.
    ``grace_s`` 0: ``os._exit(code)`` at once (nothing to save: a sim worker, a round process). ``grace_s``
    > 0: SIGINT to the main thread, as Ctrl-C would (its clean stop path runs where SIGINT has a handler:
    :func:`act_on_interrupt`), then ``os._exit(code)`` after ``grace_s`` if it is still running. Polls
    every ``interval_s`` seconds (a ``getppid`` call).
    """
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None and parent.pid is not None else os.getppid()
    if grace_s < 0 or interval_s <= 0:
        raise ValueError(f"grace_s >= 0 and interval_s > 0 expected, got {grace_s} and {interval_s}")
    pid = parent_pid

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(interval_s)
        if grace_s == 0:
            os._exit(code)
        log.warning(
            "%s: the process that started it (pid %d) is gone; stopping", where, pid, extra={"parent": pid}
        )
        # SIGINT to the main thread: its blocking call returns (EINTR) and Ctrl-C's handler runs there
        with contextlib.suppress(Exception):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        time.sleep(grace_s)
        os._exit(code)

    t = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    t.start()
    return t


def act_on_interrupt() -> bool:
    """Make SIGINT raise KeyboardInterrupt in this process (Python's own handler) where it was inherited
    as ignored or default; returns whether it changed anything. Only the main thread can set handlers:
    elsewhere it does nothing. A handler a program installed itself is kept."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL):
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside: SIGINT and SIGTERM both raise KeyboardInterrupt (whatever their inherited disposition), so a
    supervisor stopped either way runs its ``finally`` and stops its children. Handlers are restored on the
    way out. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    act_on_interrupt()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def install(where: str) -> int | None:
    """First thing in a vla-rl process (``vla_rl.cli.main``): make SIGINT stop it even where it was
    inherited as ignored (:func:`act_on_interrupt`; every vla-rl command stops on Ctrl-C), and when
    :data:`SUPERVISOR_ENV` names a pid, drop it from the environment (what this process starts is not that
    pid's child) and stop this process when that pid dies (:func:`exit_with_parent`: the clean stop first,
    at most :data:`STOP_GRACE_S`). Returns that pid, or None when not supervised (the variable unset, or
    not a pid: ignored with a warning)."""
    act_on_interrupt()
    raw = os.environ.pop(SUPERVISOR_ENV, None)
    if raw is None:
        return None
    try:
        pid = int(raw)
        if pid <= 1:
            raise ValueError(raw)
    except ValueError:
        log.warning("%s=%r: expected the supervisor's pid; ignored", SUPERVISOR_ENV, raw)
        return None
    exit_with_parent(pid, grace_s=STOP_GRACE_S, code=1, where=where)
    return pid

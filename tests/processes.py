"""Waiting for processes a test expects to end."""

from __future__ import annotations

import time

import psutil


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout`` s.

    Unlike ``psutil.wait_procs`` this counts a zombie as ended: an orphan that exited is a zombie until
    its new parent (init, or a container's pid 1) reaps it, which can take longer than the test waits."""

    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive

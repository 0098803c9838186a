"""Waiting for processes a test expects to end."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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


def run_watching(
    argv: Sequence[str], logs: Path, timeout_s: float, watch: Callable[[], bool]
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Run ``argv`` to its end (killed after ``timeout_s``) with its output in ``logs``.out / .err (a full
    pipe would block a chatty child), calling ``watch`` every second while it runs until it says True:
    the finished process and whether ``watch`` ever said True (what a test saw of the running child)."""
    out_path, err_path = logs.with_suffix(".out"), logs.with_suffix(".err")
    seen = False
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=err, text=True)
        try:
            end = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < end:
                seen = seen or watch()
                time.sleep(1.0)
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, out_path.read_text(), err_path.read_text()
    ), seen

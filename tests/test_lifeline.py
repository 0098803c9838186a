"""Supervised processes stop on SIGINT however they were started, and stop by themselves when the process
that started them dies (vla_rl/core/lifeline.py, used by `vla-rl up`'s Supervisor and the fleet's robots).

Real processes: a real `vla-rl collect` (one of the children that ignored up's SIGINT) started by a real
Supervisor, killed parents, a real ``multiprocessing`` spawn child. ~2-4 s each on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from processes import still_running

from vla_rl.core.lifeline import SUPERVISOR_ENV, act_on_interrupt, install, interruptible
from vla_rl.core.supervisor import Supervisor

CLI = [sys.executable, "-m", "vla_rl.cli"]
REPO = str(Path(__file__).resolve().parents[1])


READY = "collector listening on"


def _collector_argv(store: Path) -> list[str]:
    """A real `vla-rl` child of `up` that relies on Python's SIGINT handling (KeyboardInterrupt -> flush)."""
    return [*CLI, "collect", "--store", str(store), "--port", "0"]


def _logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


def _wait(pred: object, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_child_started_ignoring_sigint_still_stops_on_the_supervisors_sigint(tmp_path: Path) -> None:
    """The Ctrl-C flake's cause: under a parent that ignores SIGINT (a background job of a script, a CI
    runner) every child inherits it ignored and Python keeps it so; `up`'s SIGINT then did nothing and
    the children were SIGKILLed after the 8 s grace. Now the child restores Python's handler: it stops by
    itself, the clean way (flushed, exit code 0, not SIGKILLed: -9) well before the deadline."""
    sup = Supervisor(tmp_path / "logs")
    log = tmp_path / "logs" / "collector.log"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the child inherits
    try:
        sup.start("collector", _collector_argv(tmp_path / "store"), lambda: _logged(log, READY), {})
    finally:
        signal.signal(signal.SIGINT, previous)
    proc = sup.children["collector"].proc
    assert proc is not None
    status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
    ignored = int(next(x for x in status if x.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGINT - 1)), "the child still ignores SIGINT"
    t0 = time.monotonic()
    sup.stop_all(timeout_s=8)
    took = time.monotonic() - t0
    assert proc.returncode == 0 and "stopping collector" in log.read_text(), log.read_text()[-2000:]
    assert took < 7.0, took  # stopped by itself (the kill comes at 8 s)


_PARENT = """
import json, sys, time
from pathlib import Path
from vla_rl.core.supervisor import Supervisor
logs = Path(sys.argv[1])
sup = Supervisor(logs)
argv = json.loads(sys.argv[2])
log = logs / "collector.log"
sup.start("collector", argv, lambda: log.exists() and "collector listening on" in log.read_text(), {})
print(sup.children["collector"].proc.pid, flush=True)
time.sleep(120)
"""


def test_a_supervised_child_stops_when_its_supervisor_is_killed(tmp_path: Path) -> None:
    """`up` SIGKILLed (or crashed) used to leave its children running for good (an orphan `vla-rl serve`
    an hour later). A throwaway parent starts a real child the way `up` does and is SIGKILLed: the child
    notices within a second, stops the clean way (as on Ctrl-C) and is gone within a few seconds."""
    argv = json.dumps(_collector_argv(tmp_path / "store"))
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "logs"), argv],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": REPO},
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.ppid() == parent.pid and child.is_running()
        family = [child, *child.children(recursive=True)]  # its store writer too
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        alive = still_running(family, timeout=15)  # seconds when idle; the slack is for a loaded CI box
        assert not alive, (
            f"{[p.pid for p in alive]} still run {time.monotonic() - t0:.1f} s after the parent died"
        )
    finally:
        if parent.poll() is None:
            parent.kill()
    log = (tmp_path / "logs" / "collector.log").read_text()
    assert "is gone; stopping" in log and "stopping collector" in log, log[-2000:]  # the clean stop path


_MP_PARENT = """
import multiprocessing as mp, sys, time
import probe
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=probe.robot, daemon=True)
    p.start()
    print(p.pid, flush=True)
    time.sleep(120)
"""

_PROBE = """
import time
from vla_rl.core.lifeline import exit_with_parent

def robot():
    exit_with_parent(where="probe robot")  # what sim_robot_main does first
    time.sleep(120)
"""


def test_a_multiprocessing_child_goes_when_its_parent_is_killed(tmp_path: Path) -> None:
    """The fleet's robots are ``multiprocessing`` daemons: they go with a parent that exits cleanly, not
    with one that is SIGKILLed. exit_with_parent() (the parent's pid from multiprocessing itself) ends them."""
    (tmp_path / "probe.py").write_text(textwrap.dedent(_PROBE))
    (tmp_path / "parent.py").write_text(textwrap.dedent(_MP_PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])},
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)  # the child imports, then starts its watcher
        assert child.is_running() and child.ppid() == parent.pid
        parent.kill()
        parent.wait()
        assert not still_running([child], timeout=10), "the robot outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_interrupt_handling_is_restored_and_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    """act_on_interrupt() puts Python's handler back over an inherited SIG_IGN and keeps one a program
    set; interruptible() makes SIGTERM an interrupt too, and restores both; install() is a no-op
    (beyond SIGINT) without a supervisor, and ignores a malformed one."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert act_on_interrupt() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not act_on_interrupt()  # already Python's
        mine = signal.signal(signal.SIGINT, lambda *_: None)
        assert not act_on_interrupt()
        signal.signal(signal.SIGINT, mine)
        term = signal.getsignal(signal.SIGTERM)
        with interruptible(), pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
            time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) == term
        monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
        assert install("test") is None
        monkeypatch.setenv(SUPERVISOR_ENV, "not-a-pid")
        assert install("test") is None and SUPERVISOR_ENV not in os.environ
    finally:
        signal.signal(signal.SIGINT, previous)

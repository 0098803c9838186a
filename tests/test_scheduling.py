"""No vla-rl process passes real-time scheduling on (vla_rl/core/scheduling.py): started from a SCHED_FIFO thread,
the real entry points (the ``vla-rl`` CLI, a sim env worker) set themselves back to SCHED_OTHER first.

Needs permission to raise a thread to SCHED_FIFO (root, or CAP_SYS_NICE / RLIMIT_RTPRIO); the tests skip only
when that raise fails with PermissionError. Every real-time thread here is at priority 1 and only spawns
and waits, so it cannot starve the machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import pytest

from vla_rl.core.scheduling import leave_realtime, realtime_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="no POSIX scheduler calls")

CLI = [sys.executable, "-m", "vla_rl.cli"]


def _raise(tid: int, policy: int = os.SCHED_FIFO, priority: int = 1) -> None:
    """Thread ``tid`` (0: this one) to ``policy`` at ``priority``; skip the test where that is not allowed."""
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(priority))
    except PermissionError as e:
        pytest.skip(f"cannot raise a thread to real-time scheduling here ({e}): not root, no CAP_SYS_NICE")


def from_realtime_thread[T](fn: Callable[[], T]) -> T:
    """``fn()`` run in a new thread under SCHED_FIFO 1, so that what it starts inherits that policy."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except PermissionError as e:
            out["denied"] = e
            return
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, name="realtime-parent")
    t.start()
    t.join()
    if "denied" in out:
        pytest.skip(f"cannot raise a thread to real-time scheduling here ({out['denied']}): not root")
    if "error" in out:
        raise out["error"]
    return out["value"]


def process_policies(pid: int) -> dict[int, str | None]:
    """Each live thread of process ``pid``: its real-time policy's name, None for the normal ones."""
    return {int(t): realtime_policy(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def parked_thread() -> Iterator[Callable[[], int]]:
    """Start threads that only wait (returns their native ids); they end with the test."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start() -> int:
        t = threading.Thread(target=stop.wait, daemon=True)
        t.start()
        threads.append(t)
        assert t.native_id is not None
        return t.native_id

    yield start
    stop.set()
    for t in threads:
        t.join()


# ------------------------------------------------------------------------------------------ the helper
def test_leave_realtime_sets_every_realtime_thread_back(
    parked_thread: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    fifo, rr, batch = parked_thread(), parked_thread(), parked_thread()
    _raise(fifo, os.SCHED_FIFO, 3)
    _raise(rr, os.SCHED_RR, 2)
    os.sched_setscheduler(batch, os.SCHED_BATCH, os.sched_param(0))
    assert realtime_policy(fifo) == "SCHED_FIFO" and realtime_policy(rr) == "SCHED_RR"
    with caplog.at_level(logging.WARNING, "vla_rl.core.scheduling"):
        found = leave_realtime("the test")
    assert {(t.tid, t.policy, t.priority, t.error) for t in found} == {
        (fifo, "SCHED_FIFO", 3, None),
        (rr, "SCHED_RR", 2, None),
    }
    assert os.sched_getscheduler(fifo) == os.sched_getscheduler(rr) == os.SCHED_OTHER
    assert os.sched_getscheduler(batch) == os.SCHED_BATCH  # not real-time: left alone
    [record] = [r for r in caplog.records if r.name == "vla_rl.core.scheduling"]
    assert record.levelno == logging.WARNING
    assert (
        "the test ran under real-time scheduling (SCHED_FIFO 3, SCHED_RR 2 on 2 thread(s)" in record.message
    )
    assert leave_realtime("again") == []  # nothing left to do


# ------------------------------------------------------------------------------------------ entry points
def test_cli_started_by_a_realtime_thread_runs_normal(tmp_path: Path) -> None:
    """`vla-rl hub serve` (a long-running command) from a SCHED_FIFO 1 thread: it says what it found, and
    every thread it has once listening (the server's own included) is SCHED_OTHER."""
    argv = [*CLI, "hub", "serve", "--data", str(tmp_path / "hub"), "--port", "0"]
    proc = from_realtime_thread(
        lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    )
    try:
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "hub listening" in line:
                break
        assert proc.poll() is None, "".join(seen)
        assert any("vla-rl hub serve ran under real-time scheduling (SCHED_FIFO 1" in s for s in seen), (
            "".join(seen)
        )
        policies = process_policies(proc.pid)
        assert len(policies) >= 2 and set(policies.values()) == {None}, policies
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_sim_env_worker_started_by_a_realtime_thread_runs_normal(capfd: pytest.CaptureFixture[str]) -> None:
    """A spawned sim env worker (sim/vector.py) of a SCHED_FIFO 1 thread runs its simulator under SCHED_OTHER."""
    from sim.vector import VectorSimEnv

    resource_tracker.ensure_running()  # started here, not by the real-time thread (it outlives the test)
    env = from_realtime_thread(lambda: VectorSimEnv("kinematic/Reach-v0", num_envs=1, processes=True))
    try:
        [remote] = env._remotes
        policies = process_policies(remote.proc.pid)
        assert set(policies.values()) == {None}, policies
        env.reset()  # it still works
    finally:
        env.close()
    assert "sim env worker ran under real-time scheduling (SCHED_FIFO 1" in capfd.readouterr().err

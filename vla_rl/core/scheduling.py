"""Keep vla-rl processes off real-time scheduling (SCHED_FIFO, SCHED_RR, SCHED_DEADLINE).

Why: a thread's scheduling policy is inherited by every thread and process it starts. Run as root, SVT-AV1
(``libsvtav1``, LeRobot's default video encoder, reached through PyAV when ``store export-lerobot`` writes
camera videos) raises the thread that opens an encoder to SCHED_FIFO priority 99:
``avcodec_open2`` -> ``svt_av1_enc_init_handle`` -> ``pthread_setschedparam(pthread_self(), SCHED_FIFO,
99)`` whenever ``geteuid() == 0`` (seen 2026-12-01, docs/experiment-log.md). Everything that thread starts
later (simulator render threads, PostgreSQL, a browser, our own services) then runs at real-time priority
and can starve a small machine. A process started from a real-time parent (``chrt``, such a test worker)
carries it the same way.

So every entry point of a long-running vla-rl process (the ``vla-rl`` CLI, ``python -m fleet.store_writer``,
the sim robot and env workers, the round and Hub child processes) calls :func:`leave_realtime` first, and
the export calls it right after the encoder. This module imports nothing of ours: ``fleet/``, ``sim/`` and
``vla_rl/`` all use it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

SCHED_DEADLINE = 6  # linux/sched.h; ``os`` has no name for it
REALTIME_POLICIES: dict[int, str] = {
    getattr(os, "SCHED_FIFO", 1): "SCHED_FIFO",
    getattr(os, "SCHED_RR", 2): "SCHED_RR",
    SCHED_DEADLINE: "SCHED_DEADLINE",
}
_RESET_ON_FORK = getattr(os, "SCHED_RESET_ON_FORK", 0x40000000)


@dataclass(frozen=True)
class RealtimeThread:
    """A thread found under a real-time policy: ``tid`` (0: the calling thread, where ``/proc`` is
    missing), its name, the policy's name and priority, and ``error`` when it could not be set back."""

    tid: int
    name: str
    policy: str
    priority: int
    error: str | None = None


def _thread_ids() -> list[int]:
    """Every thread of this process (``/proc/self/task``); ``[0]`` (the calling thread) without ``/proc``."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [0]


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def realtime_policy(tid: int = 0) -> str | None:
    """The name of thread ``tid``'s real-time policy (0: the calling thread), None when it is not real-time
    (SCHED_OTHER, SCHED_BATCH, SCHED_IDLE) or gone. The SCHED_RESET_ON_FORK flag is ignored."""
    try:
        policy = os.sched_getscheduler(tid) & ~_RESET_ON_FORK
    except OSError:
        return None
    return REALTIME_POLICIES.get(policy)


def leave_realtime(where: str, level: int = logging.WARNING) -> list[RealtimeThread]:
    """Set every thread of this process that runs under a real-time policy to SCHED_OTHER, priority 0, so
    that nothing it starts from now on inherits real-time priority; returns the threads it found (empty:
    nothing to do, the usual case). Logs one line at ``level`` naming ``where`` and what it found.

    Lowering one's own policy needs no privilege (sched(7)); a thread that ends meanwhile is skipped, and one
    that cannot be changed is reported with ``error``. Where ``os`` has no scheduler calls (not Linux or
    another POSIX with them) it does nothing.
    """
    if not hasattr(os, "sched_getscheduler"):
        return []
    found: list[RealtimeThread] = []
    for tid in _thread_ids():
        name = realtime_policy(tid)
        if name is None:
            continue
        try:
            priority = os.sched_getparam(tid).sched_priority
        except OSError:
            priority = -1
        error = None
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        found.append(RealtimeThread(tid, _thread_name(tid) if tid else "self", name, priority, error))
    if found:
        policies = sorted({f"{t.policy} {t.priority}" for t in found})
        failed = [t for t in found if t.error]
        names = sorted({t.name for t in found})
        log.log(
            level,
            "%s ran under real-time scheduling (%s on %d thread(s): %s); set back to SCHED_OTHER so the "
            "processes it starts do not inherit it%s",
            where,
            ", ".join(policies),
            len(found),
            ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""),
            f"; {len(failed)} could not be changed: {failed[0].error}" if failed else "",
            extra={"realtime_threads": len(found), "policies": policies},
        )
    return found

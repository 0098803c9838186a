"""The dashboard's start-up work, done so that requests go first.

On start the dashboard records the store's closed episodes that the metadata DB lacks, computes the
auto-flags closed episodes lack (``fleet.flags``) and imports what round checks need (torch among it).
All of it is CPU work in this process, so done in one go it competes with the first page loads for
the GIL and the cores (what that cost on a just-started dashboard over 10,000 episodes:
docs/benchmarks.md, the dashboard section). Here it runs in background threads, at a lower OS priority,
in small steps:

* :class:`RequestGate` counts the HTTP requests in flight (:class:`GateRequests` is the ASGI
  middleware); :meth:`RequestGate.wait_quiet` blocks a background step until no request has been in
  flight for ``quiet_s`` (a page load is a burst of requests with short gaps), or ``max_wait_s`` has
  passed (so a dashboard that is never idle still finishes its sync, a step at a time). The first step
  waits for a longer lull (``FIRST_QUIET_S``). :func:`warm_imports` (seconds: torch) runs before the
  port opens, not beside a page load: an import holds the GIL.
* :func:`run_sync`: ids first (one column of the DB, the store's listing), then the missing episodes'
  ``commit.json`` in batches of ``record_batch``, each batch one short write transaction; then the
  auto-flags of the episodes that lack some, newest first (what the first page shows), in batches of
  ``flag_batch`` with a pause before every episode read and before each write.
* :class:`SyncProgress` is what ``/api/v1/health`` and the episode list report (``sync``); while it
  runs the list serves what the DB already has and does not compute flags itself (the sync does, with
  every length in the DB, in the background), and the page shows "syncing N/M".

An already-synced store costs two id queries and one flags query.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

import fleet.flags
from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from fleet.store_index import record_closed
from vla_rl.dashboard.errors import ApiError

log = logging.getLogger("vla_rl.dashboard")

QUIET_S = 0.2
"""A background step starts once no request has been in flight for this long (a page load is a burst
of requests with gaps of tens of ms: HTML, modules, API calls)."""
MAX_WAIT_S = 0.25
"""... or after waiting this long anyway: a dashboard that is never idle (a page buffering an episode's
frames) still finishes its sync, one short step every quarter second."""
FIRST_QUIET_S = 1.0
"""The sync's first step waits for a longer lull (at most 5 s): a just-started dashboard's first page
(HTML, then its modules, then its API calls) goes first."""
RECORD_BATCH = 100
"""Store episodes recorded per DB transaction (their commit.json reads, then one short write)."""
FLAG_BATCH = 256
"""Episodes per ``refresh_flags`` call (one length-index query each; a pause before every read)."""
NICE = 10
"""Background threads' OS priority is lowered by this (Linux: per thread)."""
STREAMING_SUFFIXES = ("/events",)
"""Requests that stay open (Server-Sent Events) do not count as in flight."""


class RequestGate:
    """How many HTTP requests are in flight, and when the last one started or ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._active = 0
        self._last = -math.inf

    @property
    def active(self) -> int:
        return self._active

    def enter(self) -> None:
        with self._cond:
            self._active += 1
            self._last = self._clock()

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._last = self._clock()
            self._cond.notify_all()

    def wait_quiet(self, quiet_s: float = QUIET_S, max_wait_s: float = MAX_WAIT_S) -> bool:
        """Block until no request is in flight and none started or ended in the last ``quiet_s``
        seconds (True), or ``max_wait_s`` passed first (False)."""
        deadline = self._clock() + max_wait_s
        with self._cond:
            while True:
                now = self._clock()
                if self._active == 0 and now - self._last >= quiet_s:
                    return True
                if now >= deadline:
                    return False
                wake = deadline if self._active else min(deadline, self._last + quiet_s)
                self._cond.wait(max(wake - now, 0.001))


class GateRequests:
    """ASGI middleware: every HTTP request but streaming ones is counted in ``gate`` while it runs, and
    its response says how long the server took until it began (``Server-Timing: app;dur=<ms>``, which
    a browser's resource timing shows: the server's share of a request, apart from the network's and
    the browser's)."""

    def __init__(self, app: ASGIApp, gate: RequestGate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).endswith(STREAMING_SUFFIXES):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def timed(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                dur = f"app;dur={1000 * (time.perf_counter() - t0):.1f}".encode()
                msg = {**msg, "headers": [*msg.get("headers", []), (b"server-timing", dur)]}
            await send(msg)

        self.gate.enter()
        try:
            await self.app(scope, receive, timed)
        finally:
            self.gate.leave()


class PhaseTimer:
    """A request's phases for its ``Server-Timing`` header (beside the middleware's ``app``): each
    :meth:`lap` names the time since the previous one (or since the timer was made)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + 1000 * (now - self._last)
        self._last = now

    def header(self) -> str:
        """``name;dur=<ms>, ...`` in lap order."""
        return ", ".join(f"{n};dur={ms:.1f}" for n, ms in self.phases.items())


@dataclass
class SyncProgress:
    """Where the start-up sync is. ``phase``: ``waiting`` (not begun), ``records`` (recording store
    episodes the DB lacks: ``checked`` of ``to_check`` looked at, ``recorded`` of them written),
    ``flags`` (``flagged`` of ``to_flag`` episodes' auto-flags computed), ``done``, ``failed``
    (``error`` says why; the list then computes flags per page as without a sync) or ``off``."""

    phase: str = "waiting"
    to_check: int = 0
    checked: int = 0
    recorded: int = 0
    to_flag: int = 0
    flagged: int = 0
    error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def running(self) -> bool:
        return self.phase in ("waiting", "records", "flags")

    def update(self, **changes: Any) -> None:
        with self._lock:
            for k, v in changes.items():
                setattr(self, k, v)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "phase": self.phase,
                "running": self.running,
                "to_check": self.to_check,
                "checked": self.checked,
                "recorded": self.recorded,
                "to_flag": self.to_flag,
                "flagged": self.flagged,
                "error": self.error,
            }


@dataclass
class Startup:
    """What the app's start-up threads and its routes share."""

    gate: RequestGate = field(default_factory=RequestGate)
    progress: SyncProgress = field(default_factory=SyncProgress)
    unreadable: set[str] = field(default_factory=set)
    """Episodes whose frames cannot be read: never flagged, warned about once (the list shares it)."""
    record_batch: int = RECORD_BATCH
    flag_batch: int = FLAG_BATCH

    def __post_init__(self) -> None:
        for name in ("record_batch", "flag_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")


def lower_priority(nice: int = NICE) -> None:
    """Lower the calling thread's OS scheduling priority (Linux: ``setpriority`` on the thread id);
    a no-op where that is not possible."""
    with contextlib.suppress(AttributeError, OSError, PermissionError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def run_sync(store_of: Callable[[], EpisodeStore], db_of: Callable[[], MetadataDB], startup: Startup) -> None:
    """The start-up sync (module docstring), reporting into ``startup.progress``. ``store_of`` /
    ``db_of`` open them (``Resources.store`` / ``.db``; an :class:`ApiError` there = down: ``failed``)."""
    gate, progress = startup.gate, startup.progress
    lower_priority()
    try:
        gate.wait_quiet(FIRST_QUIET_S, max_wait_s=5.0)
        store, db = store_of(), db_of()
        known = set(db.episode_ids())
        gate.wait_quiet()
        todo = [e for e in store.episode_ids() if e not in known]  # open ones too: checked, not recorded
        progress.update(phase="records", to_check=len(todo))
        for chunk in itertools.batched(todo, startup.record_batch):
            gate.wait_quiet()
            progress.add(recorded=record_closed(store, db, chunk), checked=len(chunk))
        if progress.recorded:
            log.info("recorded store episodes the metadata DB lacked", extra={"episodes": progress.recorded})
        gate.wait_quiet()
        lacking = db.closed_lacking_flags(fleet.flags.FLAG_NAMES)
        progress.update(phase="flags", to_flag=len(lacking))
        for chunk in itertools.batched(lacking, startup.flag_batch):
            gate.wait_quiet()
            fleet.flags.refresh_flags(
                store, db, list(chunk), unreadable=startup.unreadable, pause=gate.wait_quiet
            )
            progress.add(flagged=len(chunk))
        if lacking:
            log.info("computed auto-flags", extra={"episodes": len(lacking)})
        progress.update(phase="done")
    except ApiError as e:  # store or DB down: health reports it; nothing to sync then
        log.warning("could not sync the DB with the store", extra={"error": e.message})
        progress.update(phase="failed", error=e.message)
    except Exception as e:
        log.warning("syncing the DB with the store failed", exc_info=True)
        progress.update(phase="failed", error=f"{type(e).__name__}: {e}")


async def warm_requests(app: ASGIApp, paths: Sequence[str]) -> None:
    """Answer ``paths`` (GETs needing no token: the page, an asset) once, in process, before the port
    opens: a route's first answer costs more than later ones, and on a just-started dashboard the first
    page load is that first answer."""
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm") as c:
        for path in paths:
            with contextlib.suppress(httpx.HTTPError):
                await c.get(path)


def warm_queries(store_of: Callable[[], EpisodeStore], db_of: Callable[[], MetadataDB]) -> None:
    """Open the store and the DB and run the episode list's first page and flags query once, before the
    port opens: the first run of a query compiles its SQL, so the first list would be slower than the
    rest. Read-only; a store or DB that is down is left to health and the requests to report."""
    from fleet.selection import EpisodeQuery

    try:
        store_of()
        db = db_of()
        items, _ = db.query_episodes(EpisodeQuery.from_params({}))
        db.flags([i.id for i in items])
    except ApiError:
        pass
    except Exception:
        log.warning("warming the episode list's queries failed", exc_info=True)


def warm_imports() -> None:
    """Import what selection counts and round checks need (torch among it: seconds) before the first
    request that needs it: the app runs this before it starts serving (an import holds the GIL; run
    while a page loaded, it made every request of that page wait)."""
    try:
        import vla_rl.rounds
        import vla_rl.train.transitions  # noqa: F401
    except Exception:  # the request that needs them reports the problem
        log.warning("warming imports failed", exc_info=True)

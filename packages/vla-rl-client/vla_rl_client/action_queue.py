"""Action-chunk queue for a robot's control loop: ask for the next chunk early, merge overlapping chunks.

A policy answers one observation with a chunk of H actions. Executing them open-loop until the chunk runs
out and only then asking again stalls the robot for a whole round trip every H steps. LeRobot's async
client instead sends the next observation once the queue is down to ``chunk_size_threshold`` of a chunk,
keeps executing meanwhile, and merges the new chunk into what is left. This module does the same, with
numpy and no LeRobot import, for our client (sync or asyncio):

* Actions are indexed by control step. A chunk answering the observation taken at step ``s`` holds the
  actions for steps ``s, s+1, ...``; those whose step has already been executed when it arrives are
  dropped (that is the latency compensation), the rest are merged with what the queue holds.
* ``aggregate`` says how an overlap is merged, with LeRobot's names and weights
  (``lerobot.async_inference.configs.AGGREGATE_FUNCTIONS``): ``weighted_average`` 0.3 old + 0.7 new
  (LeRobot's default), ``latest_only`` (alias ``latest``), ``average`` 0.5/0.5, ``conservative`` 0.7 old +
  0.3 new; plus ``temporal_ensemble``, ACT's temporal ensembling: every prediction for a step is kept in a
  running average with weights ``exp(-coeff * i)``, ``i = 0`` for the oldest prediction (ACT's
  ``ACTTemporalEnsembler``; use it with ``chunk_size_threshold=1`` to ask every step, as ACT does).

:class:`ActionQueue` is the bookkeeping alone; :class:`QueuedPolicy` (threads) and
:class:`AsyncQueuedPolicy` (asyncio) drive it with any ``fetch(obs) -> ActResult``, e.g.
``client.act`` or ``client.stream().act``.

**Real-time chunking** (:class:`RTCOptions`, docs/serving.md): instead of blending overlapping chunks
after the fact, each request carries the actions still queued and the inference delay ``d`` (control
steps, given or estimated from the measured round trips and the control period), and the server makes
the new chunk continue them; a chunk the server made so replaces the queue from its first unexecuted
step (no blending). On by default where the delay is known and the server runs RTC (``mode="auto"``);
``fetch`` is then called as ``fetch(obs, rtc=RTCInput(...))`` (``client.act`` and ``stream().act``
take it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from vla_rl_client.policy_client import ActResult, RTCInput

__all__ = [
    "AGGREGATES",
    "RTC_MODES",
    "ActionQueue",
    "AsyncQueuedPolicy",
    "QueueStats",
    "QueuedPolicy",
    "RTCOptions",
]

# old, new -> merged (LeRobot's AGGREGATE_FUNCTIONS, same names and weights)
AGGREGATES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "weighted_average": lambda old, new: 0.3 * old + 0.7 * new,
    "latest_only": lambda old, new: new,
    "average": lambda old, new: 0.5 * old + 0.5 * new,
    "conservative": lambda old, new: 0.7 * old + 0.3 * new,
}
ALIASES = {"latest": "latest_only"}
TEMPORAL_ENSEMBLE = "temporal_ensemble"
RTCMode = Literal["auto", "on", "off"]
RTC_MODES: tuple[str, ...] = get_args(RTCMode)
RTT_WINDOW = 8  # round trips the delay estimate looks back over (the slowest of them counts)


@dataclass(frozen=True)
class RTCOptions:
    """Real-time chunking for a queued policy (see the module docstring).

    ``mode``: ``"auto"`` (the default) runs RTC when the delay is known (``delay_steps`` given, or
    ``control_period_s`` to estimate it) and the server can (``server_rtc``); ``"on"`` requires both and
    says which is missing; ``"off"`` never. ``delay_steps``: the inference delay d in control steps;
    None = ``ceil(round trip / control_period_s)`` over the slowest of the last few round trips.
    ``server_rtc``: the served model's ``GetInfo`` ``rtc_mode`` ("" = it cannot; None = not asked,
    assumed able: a server without RTC answers plain chunks, merged as without it).
    """

    mode: RTCMode = "auto"
    delay_steps: int | None = None
    control_period_s: float | None = None
    server_rtc: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in RTC_MODES:
            raise ValueError(f"rtc: expected one of {list(RTC_MODES)}, got {self.mode!r}")
        d = self.delay_steps
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"delay_steps: expected an integer >= 0 or None, got {d!r}")
        p = self.control_period_s
        if p is not None and not (isinstance(p, int | float) and 0 < p < math.inf):
            raise ValueError(f"control_period_s: expected seconds > 0 or None, got {p!r}")
        if self.mode == "on" and not self.delay_known:
            raise ValueError("rtc: 'on' needs the inference delay: give delay_steps or control_period_s")
        if self.mode == "on" and self.server_rtc == "":
            raise ValueError(
                "rtc: 'on' but the served model cannot run real-time chunking (GetInfo rtc_mode is empty); "
                "use 'auto' or 'off'"
            )

    @property
    def delay_known(self) -> bool:
        return self.delay_steps is not None or self.control_period_s is not None

    @property
    def enabled(self) -> bool:
        """Whether requests carry RTC's inference delay and queued actions."""
        return self.mode != "off" and self.delay_known and self.server_rtc != ""


class _RTCState:
    """The RTC side of a queued policy: the measured round trips and what a request carries."""

    def __init__(self, options: RTCOptions | None) -> None:
        self.options = options or RTCOptions()
        self.rtts: list[float] = []

    def delay(self, queue: ActionQueue) -> int:
        """d: given, or the slowest recent round trip in control periods (0 before any), below a chunk."""
        o = self.options
        if o.delay_steps is not None:
            d = o.delay_steps
        else:
            assert o.control_period_s is not None
            d = math.ceil(max(self.rtts, default=0.0) / o.control_period_s - 1e-9)
        return min(d, queue.chunk_len - 1) if queue.chunk_len else d

    def request(self, queue: ActionQueue) -> RTCInput | None:
        """What the next request carries (None: a plain request; nothing queued yet, or RTC off)."""
        if not self.options.enabled or not len(queue):
            return None
        queued = queue.queued(queue.chunk_len)
        return RTCInput(self.delay(queue), queued) if len(queued) else None

    def measured(self, sent_at: float) -> None:
        self.rtts = [*self.rtts[-(RTT_WINDOW - 1) :], time.monotonic() - sent_at]


def _merge_reply(queue: ActionQueue, res: ActResult, step: int) -> None:
    """A reply into the queue: a chunk RTC shaped replaces what it overlaps, others merge as configured."""
    queue.add_chunk(res.actions, step, aggregate="latest_only" if res.rtc is not None else None)


@dataclass
class QueueStats:
    chunks: int = 0  # chunks merged
    stale_dropped: int = 0  # actions that arrived after their step had been executed
    merged: int = 0  # actions aggregated with an earlier prediction for the same step
    starved: int = 0  # times the control loop had to wait for a chunk (queue empty)


class ActionQueue:
    """Actions by control step, merged from overlapping chunks. Not thread-safe: one control loop owns it."""

    def __init__(
        self,
        aggregate: str = "weighted_average",
        chunk_size_threshold: float = 0.5,
        ensemble_coeff: float = 0.01,
    ) -> None:
        name = ALIASES.get(aggregate, aggregate)
        if name not in AGGREGATES and name != TEMPORAL_ENSEMBLE:
            raise ValueError(
                f"aggregate: expected one of {[*AGGREGATES, *ALIASES, TEMPORAL_ENSEMBLE]}, got {aggregate!r}"
            )
        if not 0.0 <= chunk_size_threshold <= 1.0:
            raise ValueError(f"chunk_size_threshold: expected a number in [0, 1], got {chunk_size_threshold}")
        self.aggregate = name
        self.chunk_size_threshold = chunk_size_threshold
        self.ensemble_coeff = ensemble_coeff
        self.step = 0  # control step of the next action to execute
        self.chunk_len = 0  # longest chunk seen (LeRobot's action_chunk_size)
        self.stats = QueueStats()
        self._actions: dict[int, np.ndarray] = {}
        self._weights: dict[int, tuple[float, int]] = {}  # temporal ensemble: weight sum, predictions

    def __len__(self) -> int:
        return len(self._actions)

    def needs_chunk(self) -> bool:
        """Time to send the next observation: the queue is down to ``chunk_size_threshold`` of a chunk."""
        return self.chunk_len == 0 or len(self) / self.chunk_len <= self.chunk_size_threshold

    def queued(self, limit: int) -> np.ndarray:
        """float32 [n, A]: the actions queued for the steps from the current one on, without a gap, at most
        ``limit`` ([0, 0] when none)."""
        rows = []
        while len(rows) < limit and (self.step + len(rows)) in self._actions:
            rows.append(self._actions[self.step + len(rows)])
        return np.stack(rows).astype(np.float32) if rows else np.zeros((0, 0), np.float32)

    def add_chunk(self, actions: np.ndarray, start_step: int, aggregate: str | None = None) -> None:
        """Merge ``actions`` [H, A], the chunk answering the observation taken at ``start_step``
        (``aggregate``: this chunk's merge instead of the queue's, e.g. ``latest_only``)."""
        actions = np.asarray(actions, dtype=np.float32)
        how = self.aggregate if aggregate is None else ALIASES.get(aggregate, aggregate)
        if actions.ndim != 2:
            raise ValueError(f"actions: expected [H, A], got shape {list(actions.shape)}")
        self.chunk_len = max(self.chunk_len, actions.shape[0])
        self.stats.chunks += 1
        for i, new in enumerate(actions):
            t = start_step + i
            if t < self.step:
                self.stats.stale_dropped += 1
                continue
            old = self._actions.get(t)
            if how == TEMPORAL_ENSEMBLE:
                wsum, k = self._weights.get(t, (0.0, 0))
                w = math.exp(-self.ensemble_coeff * k)
                self._actions[t] = new.copy() if old is None else (old * wsum + new * w) / (wsum + w)
                self._weights[t] = (wsum + w, k + 1)
            else:
                self._actions[t] = new.copy() if old is None else AGGREGATES[how](old, new)
                self._weights.pop(t, None)  # a temporal ensemble restarts after a replacement
            if old is not None:
                self.stats.merged += 1

    def pop(self) -> np.ndarray | None:
        """The action for the current step (and advance), or None when the queue has none for it."""
        action = self._actions.pop(self.step, None)
        if action is None:
            return None
        self._weights.pop(self.step, None)
        self.step += 1
        return action


class QueuedPolicy:
    """A control loop's view of a remote policy: ``action = qp.act(obs)`` once per control step.

    Sends ``obs`` for a new chunk (in a background thread, one request in flight) whenever the queue says
    so, and returns the next action at once, blocking only when the queue is empty (the first step, or a
    server slower than the remaining actions): at most ``wait_s``, then the fetch error is raised, so the
    robot can stop safely rather than hang. ``rtc``: real-time chunking (:class:`RTCOptions`; the default
    ``auto`` is off here unless a delay or control period is given).
    """

    def __init__(
        self,
        fetch: Callable[..., ActResult],
        queue: ActionQueue | None = None,
        wait_s: float = 10.0,
        rtc: RTCOptions | None = None,
    ) -> None:
        self.fetch = fetch
        self.queue = queue or ActionQueue()
        self.wait_s = wait_s
        self.rtc = _RTCState(rtc)
        self.requests = 0
        self.last: ActResult | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="action-queue")
        self._inflight: tuple[int, float, concurrent.futures.Future[ActResult]] | None = None

    def _merge(self, block: bool) -> None:
        if self._inflight is None:
            return
        step, sent_at, fut = self._inflight
        if not block and not fut.done():
            return
        self._inflight = None
        res = fut.result(timeout=self.wait_s)  # raises the fetch's error (PolicyError, timeout)
        self.rtc.measured(sent_at)
        self.last = res
        _merge_reply(self.queue, res, step)

    def _send(self, obs: Mapping[str, Any]) -> None:
        rtc = self.rtc.request(self.queue)
        fut = (
            self._pool.submit(self.fetch, obs) if rtc is None else self._pool.submit(self.fetch, obs, rtc=rtc)
        )
        self._inflight = (self.queue.step, time.monotonic(), fut)
        self.requests += 1

    def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        self._merge(block=False)
        if self._inflight is None and self.queue.needs_chunk():
            self._send(obs)
        action = self.queue.pop()
        while action is None:  # nothing for this step yet: wait for the chunk in flight
            self.queue.stats.starved += 1
            if self._inflight is None:
                self._send(obs)
            self._merge(block=True)
            action = self.queue.pop()
        return action

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> QueuedPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncQueuedPolicy:
    """:class:`QueuedPolicy` for asyncio control loops: ``action = await qp.act(obs)``."""

    def __init__(
        self,
        fetch: Callable[..., Awaitable[ActResult]],
        queue: ActionQueue | None = None,
        wait_s: float = 10.0,
        rtc: RTCOptions | None = None,
    ) -> None:
        self.fetch = fetch
        self.queue = queue or ActionQueue()
        self.wait_s = wait_s
        self.rtc = _RTCState(rtc)
        self.requests = 0
        self.last: ActResult | None = None
        self._inflight: tuple[int, float, asyncio.Task[ActResult]] | None = None

    async def _merge(self, block: bool) -> None:
        if self._inflight is None:
            return
        step, sent_at, task = self._inflight
        if not block and not task.done():
            return
        self._inflight = None
        res = await asyncio.wait_for(task, self.wait_s)
        self.rtc.measured(sent_at)
        self.last = res
        _merge_reply(self.queue, res, step)

    def _send(self, obs: Mapping[str, Any]) -> None:
        rtc = self.rtc.request(self.queue)
        call = self.fetch(obs) if rtc is None else self.fetch(obs, rtc=rtc)
        self._inflight = (self.queue.step, time.monotonic(), asyncio.ensure_future(call))
        self.requests += 1

    async def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        await self._merge(block=False)
        if self._inflight is None and self.queue.needs_chunk():
            self._send(obs)
        action = self.queue.pop()
        while action is None:
            self.queue.stats.starved += 1
            if self._inflight is None:
                self._send(obs)
            await self._merge(block=True)
            action = self.queue.pop()
        return action

    async def close(self) -> None:
        if self._inflight is not None:
            self._inflight[2].cancel()
            self._inflight = None

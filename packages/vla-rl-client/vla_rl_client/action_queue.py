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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vla_rl_client.policy_client import ActResult

__all__ = ["AGGREGATES", "ActionQueue", "AsyncQueuedPolicy", "QueueStats", "QueuedPolicy"]

# old, new -> merged (LeRobot's AGGREGATE_FUNCTIONS, same names and weights)
AGGREGATES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "weighted_average": lambda old, new: 0.3 * old + 0.7 * new,
    "latest_only": lambda old, new: new,
    "average": lambda old, new: 0.5 * old + 0.5 * new,
    "conservative": lambda old, new: 0.7 * old + 0.3 * new,
}
ALIASES = {"latest": "latest_only"}
TEMPORAL_ENSEMBLE = "temporal_ensemble"


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

    def add_chunk(self, actions: np.ndarray, start_step: int) -> None:
        """Merge ``actions`` [H, A], the chunk answering the observation taken at ``start_step``."""
        actions = np.asarray(actions, dtype=np.float32)
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
            if self.aggregate == TEMPORAL_ENSEMBLE:
                wsum, k = self._weights.get(t, (0.0, 0))
                w = math.exp(-self.ensemble_coeff * k)
                self._actions[t] = new.copy() if old is None else (old * wsum + new * w) / (wsum + w)
                self._weights[t] = (wsum + w, k + 1)
            else:
                self._actions[t] = new.copy() if old is None else AGGREGATES[self.aggregate](old, new)
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
    robot can stop safely rather than hang.
    """

    def __init__(
        self,
        fetch: Callable[[Mapping[str, Any]], ActResult],
        queue: ActionQueue | None = None,
        wait_s: float = 10.0,
    ) -> None:
        self.fetch = fetch
        self.queue = queue or ActionQueue()
        self.wait_s = wait_s
        self.requests = 0
        self.last: ActResult | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="action-queue")
        self._inflight: tuple[int, concurrent.futures.Future[ActResult]] | None = None

    def _merge(self, block: bool) -> None:
        if self._inflight is None:
            return
        step, fut = self._inflight
        if not block and not fut.done():
            return
        self._inflight = None
        res = fut.result(timeout=self.wait_s)  # raises the fetch's error (PolicyError, timeout)
        self.last = res
        self.queue.add_chunk(res.actions, step)

    def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        self._merge(block=False)
        if self._inflight is None and self.queue.needs_chunk():
            self._inflight = (self.queue.step, self._pool.submit(self.fetch, obs))
            self.requests += 1
        action = self.queue.pop()
        while action is None:  # nothing for this step yet: wait for the chunk in flight
            self.queue.stats.starved += 1
            if self._inflight is None:
                self._inflight = (self.queue.step, self._pool.submit(self.fetch, obs))
                self.requests += 1
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
        fetch: Callable[[Mapping[str, Any]], Awaitable[ActResult]],
        queue: ActionQueue | None = None,
        wait_s: float = 10.0,
    ) -> None:
        self.fetch = fetch
        self.queue = queue or ActionQueue()
        self.wait_s = wait_s
        self.requests = 0
        self.last: ActResult | None = None
        self._inflight: tuple[int, asyncio.Task[ActResult]] | None = None

    async def _merge(self, block: bool) -> None:
        if self._inflight is None:
            return
        step, task = self._inflight
        if not block and not task.done():
            return
        self._inflight = None
        res = await asyncio.wait_for(task, self.wait_s)
        self.last = res
        self.queue.add_chunk(res.actions, step)

    def _send(self, obs: Mapping[str, Any]) -> None:
        self._inflight = (self.queue.step, asyncio.ensure_future(self.fetch(obs)))
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
            self._inflight[1].cancel()
            self._inflight = None

"""A help desk of N operators that answer robots' help requests (issue 44: one operator for many robots).

In the ``requests`` operator mode (:class:`sim.operator.OperatorRules`, ``mode="requests"``) the simulated
operator does not watch the simulator: a robot *asks* for help (its uncertainty alarm or the learned
failure predictor fired, or a random spot check picked it) and the desk answers:

* a request carries an **urgency** (the alarm's score); the open requests form a queue ordered by urgency,
  older first on ties (then the lower robot index, so that the order is deterministic);
* the desk has ``capacity`` operators, each handling one robot at a time. A free operator picks the head of
  the queue and reaches the robot ``reaction_s`` seconds later (reading the request, opening the robot's
  camera, taking the controls); it is busy from the moment it picks the request;
* the robot then is taken over (:meth:`HelpDesk.poll` returns True once) until the operator hands back
  (:meth:`HelpDesk.release`);
* a request withdrawn before it was answered (the episode ended: :meth:`HelpDesk.withdraw`) counts as
  unanswered, and frees the operator that was on its way.

Time is whatever clock the caller passes as ``now`` (seconds): the fleet's robots pass the wall clock
(``time.monotonic``, shared by the processes of one machine), a lock-step simulation its simulated time,
which keeps every decision deterministic. Requests are dispatched lazily, whenever any robot calls the
desk, so the robots' own step loop drives it and no desk thread is needed.

The state lives in shared memory behind one lock (a ``multiprocessing`` context's raw arrays), so one desk
can be handed to robot processes at start, as :class:`sim.operator.OperatorDesk` is.

:class:`Desk` is what a robot's :class:`sim.operator.SimulatedOperator` calls; it has two backends: this
shared-memory one (one machine's processes; bench/operators.py's lock-step default) and
:class:`sim.help_queue_desk.QueueDesk`, the product's help queue (the collector and the metadata DB, the
dashboard's help queue page), where simulated operators claim and resolve requests as a person does.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

IDLE, QUEUED, REACTING, DRIVING = 0, 1, 2, 3
"""A robot's state at the desk: no open request, waiting in the queue, an operator on its way, driven."""

# the desk-wide counters, by index in the shared array
_REQUESTS, _ANSWERED, _UNANSWERED, _WAIT_S, _BUSY_S, _SEATS, _QUEUED_BUSY = range(7)


def check_desk(robots: int, capacity: int, reaction_s: float) -> None:
    """ValueError naming the first of a desk's sizes out of bounds."""
    if robots < 1:
        raise ValueError(f"robots: expected >= 1, got {robots}")
    if capacity < 1:
        raise ValueError(f"capacity: expected >= 1 operator, got {capacity}")
    if not (math.isfinite(reaction_s) and reaction_s >= 0):
        raise ValueError(f"reaction_s: expected a finite number of seconds >= 0, got {reaction_s}")


@runtime_checkable
class Desk(Protocol):
    """A help desk as a robot's operator sees it (the requests mode): ask, learn the operator arrived,
    hand back. ``now`` is the desk's clock in seconds; ``reason``, ``episode_id`` and ``note`` are what the
    product's queue shows (the shared-memory desk does not keep them)."""

    def ask(self, robot: int, urgency: float, now: float, reason: str = "", episode_id: str = "") -> None: ...

    def poll(self, robot: int, now: float) -> bool: ...

    def release(self, robot: int, now: float, note: str = "") -> None: ...

    def stats(self) -> DeskStats: ...


@dataclass(frozen=True)
class DeskStats:
    """What the desk did so far (a snapshot)."""

    capacity: int
    reaction_s: float
    requests: int
    """Help requests opened (a robot's further alarms while it waits raise its urgency, not this count)."""
    answered: int
    """Requests an operator reached in time: takeovers."""
    unanswered: int
    """Requests withdrawn before an operator reached the robot (its episode ended)."""
    wait_s: float
    """Summed seconds from request to takeover over the answered requests."""
    busy_s: float
    """Operator-seconds spent on robots (reaction time included) by operators that are free again."""
    queued_while_busy: int
    """Requests that found every operator busy."""

    @property
    def mean_wait_s(self) -> float:
        """Mean seconds from request to takeover (NaN: nothing answered)."""
        return self.wait_s / self.answered if self.answered else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_wait_s": self.mean_wait_s}


class HelpDesk:
    """``capacity`` operators answering the help requests of ``robots`` robots (see the module docstring)."""

    def __init__(self, robots: int, capacity: int = 1, reaction_s: float = 0.0, ctx: Any = None) -> None:
        check_desk(robots, capacity, reaction_s)
        ctx = ctx or mp.get_context("spawn")
        self.robots, self.capacity, self.reaction_s = robots, capacity, float(reaction_s)
        self._lock = ctx.Lock()
        self._state = ctx.RawArray("b", robots)
        self._urgency = ctx.RawArray("d", robots)
        self._asked_at = ctx.RawArray("d", robots)
        self._picked_at = ctx.RawArray("d", robots)
        self._counters = ctx.RawArray("d", 7)

    # ------------------------------------------------------------------ the robots' side
    def ask(self, robot: int, urgency: float, now: float, reason: str = "", episode_id: str = "") -> None:
        """Robot ``robot`` asks for help with this urgency at ``now``. A robot already waiting keeps its
        place (its request's age) and takes the higher urgency; one already being answered is unchanged."""
        self._check(robot)
        with self._lock:
            state = self._state[robot]
            if state == QUEUED:
                self._urgency[robot] = max(self._urgency[robot], float(urgency))
            elif state == IDLE:
                self._state[robot] = QUEUED
                self._urgency[robot] = float(urgency)
                self._asked_at[robot] = now
                self._counters[_REQUESTS] += 1
                if self._counters[_SEATS] >= self.capacity:
                    self._counters[_QUEUED_BUSY] += 1
            self._dispatch(now)

    def poll(self, robot: int, now: float) -> bool:
        """True once, at the first call where an operator has reached ``robot`` (its takeover starts now);
        dispatches the queue to free operators first."""
        self._check(robot)
        with self._lock:
            self._dispatch(now)
            if self._state[robot] != REACTING or now < self._picked_at[robot] + self.reaction_s:
                return False
            self._state[robot] = DRIVING
            self._counters[_ANSWERED] += 1
            self._counters[_WAIT_S] += now - self._asked_at[robot]
            return True

    def release(self, robot: int, now: float, note: str = "") -> None:
        """The operator hands ``robot`` back (or the robot gives up its request): the operator is free.
        A request still waiting, or an operator still on its way, counts as unanswered."""
        self._check(robot)
        with self._lock:
            state = self._state[robot]
            if state in (REACTING, DRIVING):
                self._counters[_SEATS] -= 1
                self._counters[_BUSY_S] += max(0.0, now - self._picked_at[robot])
            if state in (QUEUED, REACTING):
                self._counters[_UNANSWERED] += 1
            self._state[robot] = IDLE
            self._dispatch(now)

    withdraw = release
    """The robot's episode ended: its open request (if any) is withdrawn, unanswered."""

    def state(self, robot: int) -> int:
        """``IDLE``, ``QUEUED``, ``REACTING`` or ``DRIVING``."""
        self._check(robot)
        return int(self._state[robot])

    # ------------------------------------------------------------------ the desk's side
    def queue(self) -> list[int]:
        """The robots waiting, head (the next one an operator picks) first."""
        with self._lock:
            return self._ordered()

    def stats(self) -> DeskStats:
        with self._lock:
            c = list(self._counters)
        return DeskStats(
            capacity=self.capacity,
            reaction_s=self.reaction_s,
            requests=int(c[_REQUESTS]),
            answered=int(c[_ANSWERED]),
            unanswered=int(c[_UNANSWERED]),
            wait_s=float(c[_WAIT_S]),
            busy_s=float(c[_BUSY_S]),
            queued_while_busy=int(c[_QUEUED_BUSY]),
        )

    @property
    def busy_waits(self) -> int:
        """Requests that found every operator busy (:attr:`sim.operator.OperatorDesk.busy_waits`' role)."""
        return self.stats().queued_while_busy

    def _ordered(self) -> list[int]:
        waiting = [i for i in range(self.robots) if self._state[i] == QUEUED]
        return sorted(waiting, key=lambda i: (-self._urgency[i], self._asked_at[i], i))

    def _dispatch(self, now: float) -> None:
        """Free operators pick the most urgent requests (call with the lock held)."""
        free = self.capacity - int(self._counters[_SEATS])
        for robot in self._ordered()[: max(0, free)]:
            self._state[robot] = REACTING
            self._picked_at[robot] = now
            self._counters[_SEATS] += 1

    def _check(self, robot: int) -> None:
        if not 0 <= robot < self.robots:
            raise ValueError(f"robot: expected an index in [0, {self.robots}), got {robot}")


def operator_metrics(
    episodes: Sequence[dict[str, Any]],
    robot_s: float,
    wall_s: float,
    operators: int,
    busy_s: float,
    desk: DeskStats | None = None,
) -> dict[str, Any]:
    """The desk's numbers for a run (issue 44): success, interventions per robot-hour, successful episodes
    per operator-hour, operator utilisation, requests, unanswered failures and the mean wait.

    ``episodes`` are episode reports (``success``, ``takeovers``); ``robot_s`` the robots' summed working
    seconds, ``wall_s`` the run's duration (the operators are paid for all of it), ``busy_s`` the
    operator-seconds spent on robots; ``desk`` the help desk's counters (None: no requests, today's
    omniscient operator)."""
    if operators < 1:
        raise ValueError(f"operators: expected >= 1, got {operators}")
    if robot_s <= 0 or wall_s <= 0:
        raise ValueError(f"robot_s and wall_s: expected > 0, got {robot_s} and {wall_s}")
    n = len(episodes)
    successes = sum(bool(e["success"]) for e in episodes)
    takeovers = sum(int(e["takeovers"]) for e in episodes)
    operator_h = operators * wall_s / 3600
    return {
        "episodes": n,
        "successes": successes,
        "success_rate": successes / max(n, 1),
        "takeovers": takeovers,
        "interventions_per_robot_hour": takeovers / (robot_s / 3600),
        "successful_episodes_per_operator_hour": successes / operator_h,
        "operator_utilisation": busy_s / (operators * wall_s),
        "failures": n - successes,
        "failures_without_takeover": sum(not e["success"] and not e["takeovers"] for e in episodes),
        "requests": desk.requests if desk else None,
        "requests_unanswered": desk.unanswered if desk else None,
        "mean_wait_s": desk.mean_wait_s if desk and desk.answered else None,
        "robot_hours": robot_s / 3600,
        "operator_hours": operator_h,
    }

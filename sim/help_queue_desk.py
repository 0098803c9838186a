"""The help desk on the product's help queue: simulated operators are clients of the queue a person works
from on the dashboard (issue 44: one help desk, not two).

The second backend of :class:`sim.help_desk.Desk` (the first, :class:`sim.help_desk.HelpDesk`, keeps the
queue in shared memory). Here every step goes through the collector into the metadata DB's
``help_requests`` (:mod:`fleet.db.help`), the rows the dashboard's help queue page shows:

* a robot asks (:meth:`QueueDesk.ask`): ``RequestHelp`` with its reason and urgency (again only when the
  urgency rises: the DB raises the queued one and keeps its age);
* :class:`SimOperators`, ``capacity`` operators named ``sim-operator-0``, ``sim-operator-1``, ..., each
  holding one request at a time, claim the most urgent open request (``ClaimHelp``, the same conditional
  ``UPDATE ... WHERE status = 'open'`` as the page's "Take next robot", so a person and a simulated
  operator never both get one), and are free again once their request is closed;
* the robot polls its request (:meth:`QueueDesk.poll`, ``GetHelp``): claimed, it hands control over
  ``reaction_s`` after the claim (the operator reading the request and taking the controls; with the
  operators in another process, after the robot first saw the claim);
* the operator's hands are the task's scripted expert, which drives the robot's own simulator, so they run
  in the robot's process: when they hand back (or the episode ends), the robot's desk resolves the request
  *as the operator that claimed it* (``ResolveHelp``; the fleet's shared credential may, a robot's own
  may not) with a note saying what happened. A request a person claimed is left to that person's
  "Resolve" on the page; the robot does not take it over twice;
* a request still open when the episode ends is withdrawn (unanswered), as is one whose operator had not
  arrived yet; one the page expired (``--help-expire-s``) counts as unanswered too.

A failed call (collector down, a refusal) is logged and skipped: the robot keeps its policy in control and
asks again on its next alarm; the operators try again on their next round. Nothing raises into the robot's
loop.

Time is the caller's clock (``now``), as for the shared-memory desk: the fleet's robots and its operators'
thread pass the wall clock, bench/operators.py its simulated clock, where the operators run in the robots'
process and are dispatched on every call (:class:`QueueDesk` ``operators=``), which keeps the desk's
decisions in lock-step with the simulation.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from vla_rl_client.help_client import HelpClient, HelpError, HelpStatus, OperatorClient

from sim.help_desk import DRIVING, IDLE, QUEUED, REACTING, DeskStats, check_desk

log = logging.getLogger("vla_rl.fleet")

SIM_OPERATOR_PREFIX = "sim-operator-"
"""Simulated operators are named ``sim-operator-K``; a claim by any other name is a person's."""
MAX_REASON = 256  # the collector's limit (vla_rl_client.help_client.MAX_REASON_CHARS)


@dataclass
class _Asking:
    """One robot's request at the desk, as this process knows it."""

    state: int = IDLE
    request_id: int = 0
    urgency: float = 0.0
    asked_at: float = 0.0
    seen_at: float = 0.0  # when the claim was made, or (operators elsewhere) first seen: the reaction starts
    polled_at: float = -1e18
    claimed_by: str = ""


class SimOperators:
    """``capacity`` simulated operators working the help queue through the collector (module docstring).

    :meth:`dispatch` is one round: seats whose request was closed are freed, free seats claim the next open
    requests. ``queued_while_busy`` counts the claims of requests asked before their seat was last freed
    (they found the operators busy; a request withdrawn while it waited is not seen here). Call it from a loop (:meth:`start`: a thread, the fleet) or on every desk call (bench
    lock-step). A seat held longer than ``max_hold_s`` (its robot never handed back: the robot died) is
    resolved by its operator and freed."""

    def __init__(
        self,
        collector: str,
        capacity: int,
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        max_hold_s: float = 300.0,
    ) -> None:
        check_desk(1, capacity, 0.0)
        if not max_hold_s > 0:
            raise ValueError(f"max_hold_s: expected a number of seconds > 0, got {max_hold_s!r}")
        self.capacity, self.max_hold_s = capacity, float(max_hold_s)
        self.names = [f"{SIM_OPERATOR_PREFIX}{k}" for k in range(capacity)]
        self.clients = [OperatorClient(collector, n, token=token, timeout_s=timeout_s) for n in self.names]
        self.held: list[tuple[int, float] | None] = [None] * capacity  # (request id, picked at)
        self.free_since = [0.0] * capacity  # wall clock: when each seat was last freed
        self.claims = self.queued_while_busy = self.errors = 0
        self.busy_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def dispatch(self, now: float) -> list[int]:
        """One round at ``now``: free the seats whose request closed, then claim for the free ones. Returns
        the requests claimed this round. A failed call ends the round (logged; the next round retries)."""
        claimed: list[int] = []
        with self._lock:
            try:
                self._free_closed(now)
                for k, held in enumerate(self.held):
                    if held is not None:
                        continue
                    got = self.clients[k].claim_next()
                    if got is None:
                        break  # nothing open
                    self.held[k] = (got.request_id, now)
                    self.claims += 1
                    self.queued_while_busy += int(got.created_at < self.free_since[k])
                    claimed.append(got.request_id)
            except HelpError as e:
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("simulated operators: help queue call failed", extra={"error": str(e)})
        return claimed

    def picked_at(self, request_id: int) -> float | None:
        """When one of these operators claimed ``request_id`` (their clock); None: none of them holds it."""
        with self._lock:
            for held in self.held:
                if held is not None and held[0] == request_id:
                    return held[1]
        return None

    def _free_closed(self, now: float) -> None:
        for k, held in enumerate(self.held):
            if held is None:
                continue
            rid, picked = held
            st = self.clients[k].status(rid)
            if not st.closed and now - picked > self.max_hold_s:
                note = f"the robot did not hand back within {self.max_hold_s:g} s"
                st = _resolve(self.clients[k], rid, note) or st
            if st.closed:
                self.held[k] = None
                self.busy_s += max(0.0, now - picked)
                self.free_since[k] = time.time()

    def start(self, poll_s: float = 0.05) -> SimOperators:
        """Work the queue from a thread, a round every ``poll_s`` seconds of the wall clock."""

        def loop() -> None:
            while not self._stop.wait(poll_s):
                self.dispatch(time.time())

        self._thread = threading.Thread(target=loop, name="sim-operators", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (if started) and close the channels."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for c in self.clients:
            c.close()


def _resolve(client: OperatorClient, request_id: int, note: str) -> HelpStatus | None:
    try:
        return client.resolve(request_id, note[:MAX_REASON])
    except HelpError as e:  # closed meanwhile (the robot withdrew, the page expired it): nothing to do
        log.info("help request not resolved", extra={"request": request_id, "error": str(e)})
        return None


class QueueDesk:
    """The robots' side of the help queue (module docstring), with :class:`sim.help_desk.HelpDesk`'s
    interface: robot ``i`` is ``robot_ids[i]``. Picklable (the channels open lazily in the process that
    uses them), so one is handed to robot processes and Ray actors as the shared-memory desk is.

    ``operators``: simulated operators dispatched on every call (lock-step, one process); None when they
    work the queue elsewhere (the fleet's driver). ``poll_s``: at most one ``GetHelp`` per robot per this
    many seconds of the desk's clock while it waits (0 = every call)."""

    def __init__(
        self,
        collector: str,
        robot_ids: list[str],
        *,
        token: str | None = None,
        reaction_s: float = 0.0,
        operators: SimOperators | None = None,
        poll_s: float = 0.0,
        timeout_s: float = 2.0,
    ) -> None:
        check_desk(len(robot_ids), 1, reaction_s)
        if not poll_s >= 0:
            raise ValueError(f"poll_s: expected a number of seconds >= 0, got {poll_s!r}")
        self.collector, self.robot_ids, self.token = collector, list(robot_ids), token
        self.robots, self.reaction_s, self.poll_s = len(robot_ids), float(reaction_s), float(poll_s)
        self.timeout_s = timeout_s
        self.operators = operators
        self.capacity = operators.capacity if operators else 0
        self._asking = [_Asking() for _ in robot_ids]
        self._counts = {"requests": 0, "answered": 0, "unanswered": 0, "errors": 0, "queued_while_busy": 0}
        self.wait_s = 0.0
        self._clients: dict[int, HelpClient] = {}
        self._hands: dict[str, OperatorClient] = {}

    def __getstate__(self) -> dict[str, Any]:
        if self.operators is not None:
            raise TypeError("a QueueDesk with in-process operators stays in its process")
        return {**self.__dict__, "_clients": {}, "_hands": {}}

    # ------------------------------------------------------------------ the robots' side
    def ask(self, robot: int, urgency: float, now: float, reason: str = "", episode_id: str = "") -> None:
        """Robot ``robot`` asks for help (``reason``, in ``episode_id``); a request still waiting takes a
        higher urgency and keeps its age; one already answered is unchanged."""
        a = self._robot(robot)
        if a.state not in (IDLE, QUEUED) or (a.state == QUEUED and urgency <= a.urgency):
            self._dispatch(now)
            return
        episode = episode_id or f"{self.robot_ids[robot]}-episode"
        try:
            got = self._client(robot).ask(episode, (reason or "asked")[:MAX_REASON], float(urgency))
        except (HelpError, ValueError) as e:
            return self._failed("help request failed", robot, e)
        new = a.state == IDLE
        if new:
            if got.status != "open":  # a person still holds this episode's earlier request: not again
                return
            a.state, a.request_id, a.asked_at, a.polled_at = QUEUED, got.request_id, now, -1e18
            self._counts["requests"] += 1
        a.urgency = float(urgency)
        self._dispatch(now)
        # in-process operators: a new request none of them took at once found every one busy
        if new and self.operators is not None and self.operators.picked_at(a.request_id) is None:
            self._counts["queued_while_busy"] += 1

    def poll(self, robot: int, now: float) -> bool:
        """True once, at the first call where the operator has reached ``robot`` (its takeover starts)."""
        a = self._robot(robot)
        self._dispatch(now)
        if a.state == QUEUED and now - a.polled_at >= self.poll_s:
            a.polled_at = now
            try:
                st = self._client(robot).status(a.request_id)
            except HelpError as e:
                self._failed("help request not polled", robot, e)
                return False
            if st.claimed:  # the reaction runs from the claim (in-process operators: known) or from now
                picked = self.operators.picked_at(a.request_id) if self.operators else None
                a.state, a.seen_at, a.claimed_by = REACTING, now if picked is None else picked, st.claimed_by
            elif st.closed:  # expired on the page, or closed by someone else: nobody came
                self._counts["unanswered"] += 1
                self._asking[robot] = _Asking()
        if a.state != REACTING or now < a.seen_at + self.reaction_s:
            return False
        a.state = DRIVING
        self._counts["answered"] += 1
        self.wait_s += now - a.asked_at
        return True

    def release(self, robot: int, now: float, note: str = "") -> None:
        """The operator hands ``robot`` back, or its episode ended (``note``: why): the request is closed,
        by the simulated operator that claimed it, or withdrawn when nobody had reached the robot yet (then
        unanswered). A person's claim is left for the person to resolve."""
        a = self._robot(robot)
        state, self._asking[robot] = a.state, _Asking()
        if state == IDLE:
            return self._dispatch(now)
        if state in (QUEUED, REACTING):
            self._counts["unanswered"] += 1
        by_sim = a.claimed_by.startswith(SIM_OPERATOR_PREFIX)
        try:
            if state == QUEUED:
                self._client(robot).withdraw(a.request_id)
            elif by_sim:
                why = note or "handed back"
                _resolve(
                    self._hand(a.claimed_by),
                    a.request_id,
                    why if state == DRIVING else f"{why} before the operator arrived",
                )
        except HelpError as e:
            self._failed("help request not closed", robot, e)
        self._dispatch(now)

    withdraw = release

    def state(self, robot: int) -> int:
        """``IDLE``, ``QUEUED``, ``REACTING`` or ``DRIVING`` (as this process knows it)."""
        return self._robot(robot).state

    def request_id(self, robot: int) -> int:
        """The robot's open request (0: none)."""
        return self._robot(robot).request_id

    def stats(self) -> DeskStats:
        """This process's robots' counters, and the in-process operators' busy time (none: 0, the fleet's
        driver adds its operators' own). ``queued_while_busy`` counts, as the shared-memory desk does, the
        requests that found every operator busy when asked (in-process operators only)."""
        ops = self.operators
        return DeskStats(
            capacity=self.capacity,
            reaction_s=self.reaction_s,
            requests=self._counts["requests"],
            answered=self._counts["answered"],
            unanswered=self._counts["unanswered"],
            wait_s=self.wait_s,
            busy_s=ops.busy_s if ops else 0.0,
            queued_while_busy=self._counts["queued_while_busy"],
        )

    @property
    def busy_waits(self) -> int:
        return self.stats().queued_while_busy

    @property
    def errors(self) -> int:
        """Help-queue calls that failed (logged and skipped)."""
        return self._counts["errors"]

    def close(self) -> None:
        for c in [*self._clients.values(), *self._hands.values()]:
            c.close()
        self._clients, self._hands = {}, {}

    # ------------------------------------------------------------------ internals
    def _robot(self, robot: int) -> _Asking:
        if not 0 <= robot < self.robots:
            raise ValueError(f"robot: expected an index in [0, {self.robots}), got {robot}")
        return self._asking[robot]

    def _client(self, robot: int) -> HelpClient:
        if robot not in self._clients:
            rid = self.robot_ids[robot]
            self._clients[robot] = HelpClient(self.collector, rid, token=self.token, timeout_s=self.timeout_s)
        return self._clients[robot]

    def _hand(self, operator: str) -> OperatorClient:
        """The simulated operator's hands in this process: they resolve as that operator."""
        if operator not in self._hands:
            self._hands[operator] = OperatorClient(
                self.collector, operator, token=self.token, timeout_s=self.timeout_s
            )
        return self._hands[operator]

    def _dispatch(self, now: float) -> None:
        if self.operators is not None:
            self.operators.dispatch(now)

    def _failed(self, what: str, robot: int, e: Exception) -> None:
        self._counts["errors"] += 1
        if self._counts["errors"] == 1 or self._counts["errors"] % 100 == 0:
            log.warning(what, extra={"robot": self.robot_ids[robot], "error": str(e)})

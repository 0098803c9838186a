"""A simulated teleoperator: watches robots, takes over when the policy stalls or drifts, hands back.

It stands in for the human of a real deployment (HELP's teleoperator watching 12 robots, LWD's fleet),
so that the data path and the credit assignment that depends on "who was in control of each frame" can
be exercised in simulation. It drives with the task's privileged scripted expert
(:func:`sim.experts.make_expert`), which is reactive and can take over at any state.

Rules (:class:`OperatorRules`), checked before each step while the policy is in control:

* **stall**: the dense reward has not beaten its best by ``progress_eps`` for ``stall_steps`` steps;
* **drift**: the gripper is more than ``drift_radius`` metres from the object (it left the workspace);
* **spot check**: with probability ``spot_check_prob`` per step, at random;
* **uncertainty** (off by default): a one-sided CUSUM over the policy's per-chunk uncertainty (the
  ``accel`` score the policy server returns with every chunk, docs/algorithms.md §6a) crosses ``uncertainty_h``.
  Each new chunk's score x is standardised with reference statistics, ``z = (x - uncertainty_mean) /
  uncertainty_std``, and accumulated as ``S = max(0, S + z - uncertainty_k)``; the alarm fires when
  ``S > uncertainty_h``, before the chunk is executed (:meth:`SimulatedOperator.observe_chunk`). The
  statistics and ``h`` come from held-out *successful* episodes (:func:`fleet.uncertainty.calibrate_cusum`:
  split conformal on their peak CUSUM; the CUSUM functions live in :mod:`fleet.uncertainty`); S restarts at 0 each episode and after each handback. Scores that are not
  available (NaN: a LeRobot policy) leave S unchanged.
* **failure predictor** (off by default, ``failure_alarm``): the policy server's learned failure predictor
  alarmed on the new chunk (``ActResult.failure_alarm``, docs/algorithms.md §6c); checked like the
  uncertainty alarm, before the chunk is executed.

**Modes** (``mode``): the rules above are the ``omniscient`` operator (the default, today's baseline): the
stall and drift rules read the simulator's privileged state and it watches every robot. In the
``requests`` mode the operator sees no simulator state: the robot *asks* for help when one of its alarms
fires (the uncertainty CUSUM, urgency ``S / h``; the failure predictor, urgency its ``p``) or a spot check
picks it (urgency 0), and a help desk of N operators (:class:`sim.help_desk.Desk`: the product's help
queue, :class:`sim.help_queue_desk.QueueDesk`, or the shared-memory :class:`sim.help_desk.HelpDesk`)
answers the requests in order of urgency, each operator reaching its robot ``reaction_s`` seconds after
picking the request; stall and drift are not checked. While a request waits the policy keeps driving. Once taken over, the operator
drives with the scripted expert in both modes (it stands in for a person's teleoperation).

A takeover lasts ``drive_steps`` steps (or until the episode ends), then control goes back to the policy,
which keeps it at least ``min_autonomous_steps``. The operator works within a budget per episode: at most
``max_takeovers`` takeovers and ``max_fraction`` of the episode's step limit under its control. It can be
shared: an :class:`OperatorDesk` with ``capacity`` seats is passed to several robots (even in other
processes); a robot that needs help while every seat is busy keeps running its policy and asks again
on the next step, like a robot waiting for the one teleoperator watching many.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import numpy as np

from fleet.uncertainty import cusum_path, cusum_step
from sim.base import Privileged
from sim.experts import ScriptedExpert, make_expert
from sim.help_desk import Desk, HelpDesk

OperatorMode = Literal["omniscient", "requests"]
OPERATOR_MODES: tuple[str, ...] = get_args(OperatorMode)


@dataclass(frozen=True)
class OperatorRules:
    """When the simulated operator takes a robot over, and for how long."""

    stall_steps: int = 8
    """No progress for this many steps -> take over (0 = never)."""
    progress_eps: float = 0.01
    """Dense-reward gain that counts as progress."""
    drift_radius: float = 0.3
    """Metres between gripper and object beyond which the robot has drifted (0 = off)."""
    spot_check_prob: float = 0.0
    """Chance per autonomous step of a random takeover."""
    drive_steps: int = 15
    """Steps per takeover (0 = until the episode ends)."""
    min_autonomous_steps: int = 3
    """After a handback, the policy keeps control at least this long."""
    max_takeovers: int = 3
    """Takeovers per episode at most."""
    max_fraction: float = 0.5
    """Share of the episode's step limit under operator control at most."""
    noise: float = 0.0
    """The operator's own sloppiness (expert noise)."""
    uncertainty_h: float = 0.0
    """CUSUM alarm threshold on standardised per-chunk uncertainty, in reference stds (0 = alarm off)."""
    uncertainty_k: float = 0.25
    """CUSUM allowance (slack) per chunk, in reference stds (the reference recipe: 0.25)."""
    uncertainty_mean: float = 0.0
    """Reference mean of per-chunk scores (from held-out successful episodes)."""
    uncertainty_std: float = 1.0
    """Reference std of per-chunk scores (> 0)."""
    failure_alarm: bool = False
    """Take over when the policy server's learned failure predictor alarms on a chunk (its calibrated
    threshold; the checkpoint must carry a predictor, else the alarm never comes)."""
    mode: OperatorMode = "omniscient"
    """omniscient = the rules above, reading the simulator's state (stall, drift), every robot watched;
    requests = no simulator state: robots ask for help on their alarms (uncertainty, failure predictor)
    and spot checks, and a help desk of --operators answers them by urgency after --reaction-s."""
    reaction_s: float = 0.0
    """requests mode: seconds from an operator picking a request to taking the robot over."""

    def __post_init__(self) -> None:
        for name in ("stall_steps", "drive_steps", "min_autonomous_steps", "max_takeovers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction: expected a value in [0, 1], got {self.max_fraction}")
        if not 0.0 <= self.spot_check_prob <= 1.0:
            raise ValueError(f"spot_check_prob: expected a value in [0, 1], got {self.spot_check_prob}")
        if self.drift_radius < 0 or self.progress_eps < 0:
            raise ValueError("drift_radius and progress_eps: expected >= 0")
        for name in ("uncertainty_h", "uncertainty_k", "uncertainty_mean"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: expected a finite number, got {getattr(self, name)}")
        if self.uncertainty_h < 0 or self.uncertainty_k < 0:
            raise ValueError("uncertainty_h and uncertainty_k: expected >= 0")
        if not (math.isfinite(self.uncertainty_std) and self.uncertainty_std > 0):
            raise ValueError(f"uncertainty_std: expected a finite number > 0, got {self.uncertainty_std}")
        if self.mode not in OPERATOR_MODES:
            raise ValueError(f"mode: expected one of {list(OPERATOR_MODES)}, got {self.mode!r}")
        if not (math.isfinite(self.reaction_s) and self.reaction_s >= 0):
            raise ValueError(f"reaction_s: expected a finite number of seconds >= 0, got {self.reaction_s}")
        if self.requests and not (self.uncertainty_alarm or self.failure_alarm or self.spot_check_prob):
            raise ValueError(
                "mode: 'requests' needs a way for robots to ask for help: uncertainty_h > 0, "
                "failure_alarm or spot_check_prob > 0"
            )

    @property
    def requests(self) -> bool:
        """The operator answers help requests only (sees no simulator state)."""
        return self.mode == "requests"

    @property
    def uncertainty_alarm(self) -> bool:
        return self.uncertainty_h > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------ CUSUM
def first_alarm(scores: Sequence[float], rules: OperatorRules) -> int | None:
    """Index of the first chunk whose CUSUM exceeds ``rules.uncertainty_h`` (None: no alarm / alarm off)."""
    if not rules.uncertainty_alarm:
        return None
    path = cusum_path(scores, rules.uncertainty_mean, rules.uncertainty_std, rules.uncertainty_k)
    hits = np.flatnonzero(path > rules.uncertainty_h)
    return int(hits[0]) if hits.size else None


class OperatorDesk:
    """Seats of operator attention shared by robots (process-safe: pass it to ``mp`` workers at start)."""

    def __init__(self, capacity: int = 1, ctx: Any = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        ctx = ctx or mp.get_context("spawn")
        self.capacity = capacity
        self._sem = ctx.BoundedSemaphore(capacity)
        self._busy_waits = ctx.Value("q", 0)

    def try_acquire(self) -> bool:
        ok = bool(self._sem.acquire(block=False))
        if not ok:
            with self._busy_waits.get_lock():
                self._busy_waits.value += 1
        return ok

    def release(self) -> None:
        self._sem.release()

    @property
    def busy_waits(self) -> int:
        """How many times a robot needed help while every seat was taken."""
        return int(self._busy_waits.value)


@dataclass(frozen=True)
class Event:
    """A change of control: ``takeover`` (operator drives from this step) or ``handback``."""

    kind: str
    reason: str


class SimulatedOperator:
    """One robot's view of the operator: decides takeovers, drives, hands back (see the module docstring).

    ``robot`` is this robot's index at a :class:`~sim.help_desk.Desk` (``requests`` mode; without a
    desk the robot gets an operator of its own, a shared-memory :class:`~sim.help_desk.HelpDesk`). ``now`` arguments are the desk's clock in seconds (None =
    ``time.monotonic()``); the omniscient mode ignores them."""

    def __init__(
        self,
        task: str,
        rules: OperatorRules | None = None,
        desk: OperatorDesk | Desk | Any | None = None,
        robot: int = 0,
    ) -> None:
        self.task = task
        self.rules = rules or OperatorRules()
        if self.rules.requests:
            desk = desk if desk is not None else HelpDesk(1, 1, self.rules.reaction_s)
            if not isinstance(desk, Desk):
                raise TypeError(f"desk: the requests mode needs a help desk, got {type(desk).__name__}")
        elif isinstance(desk, Desk):
            raise TypeError("desk: a help desk answers requests; set rules.mode = 'requests'")
        self.desk = desk
        self.robot = robot
        self.expert: ScriptedExpert = make_expert(task, noise=self.rules.noise, seed=0)
        self.rng = np.random.default_rng(0)
        self.driving = False
        self.asking = False  # requests mode: a request of this robot is open at the desk
        self.reset(0, 1)

    def reset(self, seed: int, max_steps: int, now: float | None = None, episode_id: str = "") -> None:
        """A new episode (``max_steps`` = its step limit, for the time budget; ``episode_id``: what its
        help requests name, at the product's help queue)."""
        if self.driving or self.asking:
            self._release(now, "a new episode began")
        self.episode_id = episode_id
        self.rng = np.random.default_rng(seed)
        self.expert.reset(seed)
        self.max_steps = max_steps
        self.takeovers = 0
        self.human_steps = 0
        self.driven = 0
        self.best = -np.inf
        self.last_progress = 0
        self.since_handback = 10**9
        self.reasons: list[str] = []
        self.cusum = 0.0  # the uncertainty CUSUM S over the chunks the policy produced
        self.scores: list[float] = []  # per-chunk uncertainty seen this episode (for reports)
        self.requests = 0  # help requests this robot opened this episode (requests mode)
        self.pending: tuple[float, str] = (0.0, "")  # the open request's urgency and reason

    @property
    def budget_steps(self) -> int:
        return int(self.rules.max_fraction * self.max_steps)

    def observe(
        self, t: int, priv: Privileged, dense_reward: float, now: float | None = None
    ) -> Event | None:
        """Look at the robot before step ``t``; returns a change of control, if any. The requests mode
        reads neither ``priv`` nor ``dense_reward`` here (it sees no simulator state)."""
        r = self.rules
        if self.driving:
            if self.human_steps >= self.budget_steps:
                reason = f"operator budget used ({self.human_steps} steps)"
                return self._handback(t, dense_reward, reason, now)
            if r.drive_steps and self.driven >= r.drive_steps:
                return self._handback(t, dense_reward, f"drove {self.driven} steps", now)
            return None
        self.since_handback += 1
        if r.requests:
            if self._alarm():  # still alarmed: ask again (a waiting request keeps its place)
                self._ask(self.cusum / r.uncertainty_h, self._alarm_reason(), now)
            elif r.spot_check_prob and self.rng.random() < r.spot_check_prob:
                self._ask(0.0, "spot check", now)
            return self._answered(now)
        if dense_reward > self.best + r.progress_eps:
            self.best = dense_reward
            self.last_progress = t
        reason = None
        dist = self._drift(priv) if r.drift_radius else 0.0
        if r.drift_radius and dist > r.drift_radius:
            reason = f"drift: gripper {dist:.2f} m from the object (> {r.drift_radius:g})"
        elif r.stall_steps and t - self.last_progress >= r.stall_steps:
            reason = f"stall: no progress for {t - self.last_progress} steps"
        elif self._alarm():  # an alarm the operator could not answer yet (busy desk, too soon)
            reason = self._alarm_reason()
        elif r.spot_check_prob and self.rng.random() < r.spot_check_prob:
            reason = "spot check"
        return self._take_over(reason)

    def observe_chunk(
        self,
        t: int,
        uncertainty: float,
        failure_alarm: bool = False,
        failure: float = float("nan"),
        now: float | None = None,
    ) -> Event | None:
        """The policy produced a new chunk at step ``t`` with this uncertainty (NaN = not available) and
        the server's failure-predictor alarm (and score ``failure``: the request's urgency): update the
        CUSUM; a takeover (reason ``uncertainty: ...``, or ``failure predictor: ...`` under
        ``rules.failure_alarm``) when an alarm fires, before the chunk is executed; in the requests mode,
        a help request, and a takeover only when the desk's operator has reached the robot. Call only while
        the policy is in control, after :meth:`observe` of the same step."""
        if self.driving:
            return None
        x = float(uncertainty)
        self.scores.append(x)
        r = self.rules
        if r.requests:
            if r.failure_alarm and failure_alarm:
                p = float(failure) if math.isfinite(failure) else 1.0
                self._ask(p, f"failure predictor: alarm on this chunk (p {p:.2f})", now)
            if r.uncertainty_alarm:
                self.cusum = cusum_step(self.cusum, x, r.uncertainty_mean, r.uncertainty_std, r.uncertainty_k)
                if self._alarm():
                    self._ask(self.cusum / r.uncertainty_h, self._alarm_reason(), now)
            return self._answered(now)
        if r.failure_alarm and failure_alarm:
            event = self._take_over("failure predictor: alarm on this chunk")
            if event is not None:
                return event
        if not r.uncertainty_alarm:
            return None
        self.cusum = cusum_step(self.cusum, x, r.uncertainty_mean, r.uncertainty_std, r.uncertainty_k)
        return self._take_over(self._alarm_reason() if self._alarm() else None)

    def _alarm(self) -> bool:
        return self.rules.uncertainty_alarm and self.cusum > self.rules.uncertainty_h

    def _alarm_reason(self) -> str:
        return f"uncertainty: CUSUM {self.cusum:.2f} > {self.rules.uncertainty_h:.2f}"

    @staticmethod
    def _drift(priv: Privileged) -> float:
        """Gripper to object distance (to the goal point on tasks without an object: kinematic Reach)."""
        target = priv["obj_pos"] if "obj_pos" in priv else priv["goal_pos"]
        return float(np.linalg.norm(np.asarray(priv["tcp_pos"]) - np.asarray(target)))

    def _may_take_over(self) -> bool:
        """Not too soon after a handback, and within the episode's budget."""
        r = self.rules
        return (
            self.since_handback >= r.min_autonomous_steps
            and self.takeovers < r.max_takeovers
            and self.human_steps < self.budget_steps
        )

    def _take_over(self, reason: str | None) -> Event | None:
        if reason is None or not self._may_take_over():
            return None
        if self.desk is not None and not self.desk.try_acquire():
            return None  # every seat is busy: the policy keeps going, ask again next step
        return self._start(reason)

    def _start(self, reason: str) -> Event:
        self.driving = True
        self.takeovers += 1
        self.driven = 0
        self.expert.reset(
            int(self.rng.integers(2**31))
        )  # fresh memory: the state is whatever the policy left
        self.reasons.append(reason)
        return Event("takeover", reason)

    def _ask(self, urgency: float, reason: str, now: float | None) -> None:
        """Requests mode: open (or raise the urgency of) this robot's help request, budget permitting."""
        if not self._may_take_over():
            return
        if not self.asking:
            self.asking, self.requests, self.pending = True, self.requests + 1, (urgency, reason)
        elif urgency > self.pending[0]:
            self.pending = (urgency, reason)
        self.desk.ask(self.robot, urgency, self._clock(now), reason, self.episode_id)  # type: ignore[union-attr]

    def _answered(self, now: float | None) -> Event | None:
        """Requests mode: the takeover, once the desk's operator has reached this robot."""
        if not self.asking or not self.desk.poll(self.robot, self._clock(now)):  # type: ignore[union-attr]
            return None
        self.asking = False
        return self._start(self.pending[1])

    def act(self, priv: Privileged) -> np.ndarray:
        """The operator's action for this step (call only while :attr:`driving`)."""
        self.driven += 1
        self.human_steps += 1
        return self.expert.act(priv)

    def end_episode(self, now: float | None = None) -> None:
        """The episode ended: hand back, and withdraw a request still open (unanswered)."""
        if self.driving or self.asking:
            ended = f"the episode ended after {self.driven} operator steps" if self.driving else ""
            self._release(now, ended or "the episode ended")

    def _handback(self, t: int, dense_reward: float, reason: str, now: float | None) -> Event:
        self._release(now, f"handed back: {reason}")
        self.since_handback = 0
        self.best = dense_reward  # judge the policy from where the operator left it
        self.last_progress = t
        self.cusum = 0.0  # and its uncertainty from here on
        return Event("handback", reason)

    def _release(self, now: float | None, note: str) -> None:
        self.driving = self.asking = False
        if isinstance(self.desk, Desk):
            self.desk.release(self.robot, self._clock(now), note)
        elif self.desk is not None:
            self.desk.release()

    @staticmethod
    def _clock(now: float | None) -> float:
        return time.monotonic() if now is None else now

"""Latency as a robot feels it: a rollout in which the robot keeps executing while it waits for a chunk.

Time is simulated in control steps (the env's control period), not wall clock, so runs are deterministic
and as fast as the simulator. Each episode draws two delays from its own seed (:class:`LatencySpec`):

* ``observation``: the sensor pipeline's lag. A request sent at step ``t`` carries the observation of step
  ``t - obs_steps`` (the episode's first observation while ``t < obs_steps``). The robot does not know this
  lag: it stamps the request with ``t``.
* ``network``: request sent -> chunk available (the round trip, inference included). A request sent at
  ``t`` arrives at step ``t + net_steps`` and joins the robot's :class:`~vla_rl_client.action_queue.ActionQueue`
  as the chunk for steps ``t, t+1, ...``: the actions of steps already executed are dropped (the queue's
  latency compensation), the rest merged with what the queue holds (``merge``).

A delay of ``d`` ms is ``ceil(d * control_hz / 1000)`` steps (a chunk arriving mid-period is first used at
the next tick): 300 ms at 20 Hz is 6 steps. Each step, for each robot, in this order: chunks due by now
join the queue; if the queue is down to ``chunk_size_threshold`` of a chunk and no request is in flight,
the robot sends one (all robots sending in a step share ONE batched ``propose`` call; a zero-latency chunk
joins at once); the robot executes the queue's action for this step. When the queue has none the step is
*starved*: the robot stands ``still`` (zero motion, the gripper keeps its last command; what a position-
controlled arm does when no command arrives) or, with ``when_starved="hold"``, repeats its last action.

:class:`LatencyRollout` is a :class:`~sim.rollout.ChunkRollout` whose chunks are the single executed
actions (its hooks and records are the driver's: ``on_step`` sees every executed action, ``on_episode``
every episode with its :class:`LatencyStats`), so evaluation and training rollouts run with latency
through the same driver. With zero latency and ``latest_only`` it executes exactly what a
``ChunkRollout`` with ``n_exec = chunk_size_threshold * H`` executes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, get_args

import numpy as np
from vla_rl_client.action_queue import AGGREGATES, ALIASES, TEMPORAL_ENSEMBLE, ActionQueue

from sim.base import GRIPPER_OPEN
from sim.rollout import ChunkRecord, ChunkRollout, EpisodeRecord, Obs, Proposer, VectorEnv, select_robots

__all__ = [
    "ContextProposer",
    "Delay",
    "EpisodeLatency",
    "LatencyOptions",
    "LatencyRollout",
    "LatencySpec",
    "LatencyStats",
    "RequestContext",
    "stack_rows",
    "to_steps",
]

DelayKind = Literal["const", "uniform", "exp"]
DELAY_KINDS: tuple[str, ...] = get_args(DelayKind)
WhenStarved = Literal["still", "hold"]
WHEN_STARVED: tuple[str, ...] = get_args(WhenStarved)
DELAY_FORMS = "const:100ms, uniform:50ms-200ms, exp:100ms or exp:100ms:400ms (mean, cap)"
EXP_CAP = 4.0
"""An exponential delay given without a cap is capped at this many times its mean."""
_SALT = 0x1A7E
"""Mixed into the episode seed, so the latency draws are independent of the simulator's use of the seed."""


def _ms(text: str, what: str) -> float:
    """``"100ms"`` / ``"0.1s"`` / ``"0"`` -> milliseconds (``what`` names the value in errors)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*", text)
    if m is None or (m.group(2) is None and float(m.group(1)) != 0.0):
        raise ValueError(f"{what}: expected a duration such as 100ms or 0.1s, got {text!r}")
    return float(m.group(1)) * (1000.0 if m.group(2) == "s" else 1.0)


def to_steps(ms: float, control_hz: float) -> int:
    """Control steps a delay of ``ms`` spans: the first tick at or after it (0 ms -> 0 steps)."""
    return max(0, math.ceil(ms * control_hz / 1000.0 - 1e-9))


@dataclass(frozen=True)
class Delay:
    """One delay's per-episode distribution, in milliseconds: ``const`` (``lo_ms``), ``uniform`` on
    ``[lo_ms, hi_ms]``, or ``exp`` with mean ``lo_ms`` capped at ``hi_ms``."""

    kind: DelayKind = "const"
    lo_ms: float = 0.0
    hi_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DELAY_KINDS:
            raise ValueError(f"delay kind: expected one of {list(DELAY_KINDS)}, got {self.kind!r}")
        if self.lo_ms < 0 or self.hi_ms < 0:
            raise ValueError(f"delay: expected durations >= 0 ms, got {self.lo_ms} and {self.hi_ms}")
        if self.kind == "uniform" and self.hi_ms < self.lo_ms:
            raise ValueError(f"uniform delay: expected low <= high, got {self.lo_ms}ms-{self.hi_ms}ms")
        if self.kind == "exp" and self.hi_ms < self.lo_ms:
            raise ValueError(
                f"exp delay: expected the cap >= the mean, got mean {self.lo_ms}ms cap {self.hi_ms}ms"
            )

    @classmethod
    def parse(cls, text: str) -> Delay:
        """``const:100ms``, ``uniform:50ms-200ms``, ``exp:100ms`` (capped at 4x the mean) or
        ``exp:100ms:400ms``; ``0`` / ``none`` is no delay."""
        text = text.strip()
        if text in ("0", "none", ""):
            return cls()
        kind, _, rest = text.partition(":")
        if kind == "const":
            return cls("const", _ms(rest, "const delay"))
        if kind == "uniform":
            lo, sep, hi = rest.partition("-")
            if not sep:
                raise ValueError(
                    f"uniform delay: expected uniform:LOW-HIGH such as uniform:50ms-200ms, got {text!r}"
                )
            return cls("uniform", _ms(lo, "uniform delay low"), _ms(hi, "uniform delay high"))
        if kind == "exp":
            mean, _, cap = rest.partition(":")
            mean_ms = _ms(mean, "exp delay mean")
            return cls("exp", mean_ms, _ms(cap, "exp delay cap") if cap else EXP_CAP * mean_ms)
        raise ValueError(f"delay: expected one of {DELAY_FORMS}, got {text!r}")

    def draw(self, rng: np.random.Generator) -> float:
        """One episode's delay in ms."""
        if self.kind == "uniform":
            return float(rng.uniform(self.lo_ms, self.hi_ms))
        if self.kind == "exp":
            return float(min(rng.exponential(self.lo_ms), self.hi_ms)) if self.lo_ms > 0 else 0.0
        return self.lo_ms

    def __str__(self) -> str:
        if self.kind == "uniform":
            return f"uniform:{self.lo_ms:g}ms-{self.hi_ms:g}ms"
        if self.kind == "exp":
            return f"exp:{self.lo_ms:g}ms:{self.hi_ms:g}ms"
        return f"const:{self.lo_ms:g}ms"


@dataclass(frozen=True)
class EpisodeLatency:
    """One episode's drawn delays, in ms and in control steps."""

    network_ms: float
    observation_ms: float
    network_steps: int
    observation_steps: int


@dataclass(frozen=True)
class LatencySpec:
    """The network and observation delays episodes draw from. :meth:`parse` reads the command line's form."""

    network: Delay = field(default_factory=Delay)
    observation: Delay = field(default_factory=Delay)

    @classmethod
    def parse(cls, text: str) -> LatencySpec:
        """``const:100ms`` (the network delay alone) or comma-separated ``net=DELAY`` / ``obs=DELAY``
        (e.g. ``net=exp:100ms,obs=const:50ms``); ``0`` / ``none`` is no latency."""
        if "=" not in text:
            return cls(network=Delay.parse(text))
        parts: dict[str, Delay] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in ("net", "obs") or key in parts:
                raise ValueError(
                    f"latency: expected DELAY or comma-separated net=DELAY,obs=DELAY (each once), got {text!r}"
                )
            parts[key] = Delay.parse(value)
        return cls(network=parts.get("net", Delay()), observation=parts.get("obs", Delay()))

    @property
    def is_zero(self) -> bool:
        return all(d.kind == "const" and d.lo_ms == 0 for d in (self.network, self.observation))

    def draw(self, episode_seed: int | None, control_hz: float) -> EpisodeLatency:
        """The delays of the episode with seed ``episode_seed`` (the same seed, the same draws)."""
        rng = np.random.default_rng([_SALT, 0 if episode_seed is None else episode_seed])
        net, obs = self.network.draw(rng), self.observation.draw(rng)
        return EpisodeLatency(net, obs, to_steps(net, control_hz), to_steps(obs, control_hz))

    def __str__(self) -> str:
        return f"net={self.network},obs={self.observation}"


@dataclass(frozen=True)
class LatencyOptions:
    """How the latency world runs: the delays, the queue's merge and request threshold, and what a
    starved step executes."""

    latency: LatencySpec = field(default_factory=LatencySpec)
    merge: str = "weighted_average"
    """The queue's ``aggregate``: weighted_average, latest_only, temporal_ensemble, ... (ActionQueue)."""
    chunk_size_threshold: float = 0.5
    """Send the next request when the queue is down to this share of a chunk (1: as often as possible)."""
    ensemble_coeff: float = 0.01
    when_starved: WhenStarved = "still"
    control_hz: float | None = None
    """Control rate the delays are counted in; None: the env's (its spec's ``control_hz``, else 20 Hz)."""
    gripper: int | None = 3
    """Index of the gripper command, which standing still keeps (open before the episode's first action;
    None: every dimension goes to 0)."""

    def __post_init__(self) -> None:
        merges = [*AGGREGATES, *ALIASES, TEMPORAL_ENSEMBLE]
        if self.merge not in merges:
            raise ValueError(f"merge: expected one of {merges}, got {self.merge!r}")
        if not 0.0 <= self.chunk_size_threshold <= 1.0:
            raise ValueError(
                f"chunk_size_threshold: expected a share of a chunk in [0, 1], got {self.chunk_size_threshold}"
            )
        if self.when_starved not in WHEN_STARVED:
            raise ValueError(f"when_starved: expected one of {list(WHEN_STARVED)}, got {self.when_starved!r}")
        if self.control_hz is not None and not self.control_hz > 0:
            raise ValueError(f"control_hz: expected a positive rate, got {self.control_hz}")

    def make_queue(self) -> _StepQueue:
        return _StepQueue(self.merge, self.chunk_size_threshold, self.ensemble_coeff)


class _StepQueue(ActionQueue):
    """The client's queue, plus a look at the actions it holds for the coming steps (RTC's prefix)."""

    def upcoming(self, count: int) -> np.ndarray:
        """The queued actions for steps ``step .. step + count - 1`` while they run without a gap."""
        out = []
        for t in range(self.step, self.step + count):
            if t not in self._actions:
                break
            out.append(self._actions[t])
        return np.stack(out) if out else np.zeros((0, 0), np.float32)


@dataclass
class LatencyStats:
    """What latency did to one episode."""

    network_ms: float
    observation_ms: float
    network_steps: int
    observation_steps: int
    requests: int = 0
    chunks: int = 0
    """Chunks that arrived and joined the queue."""
    starved: int = 0
    """Steps with no queued action (the robot stood still or held its last action)."""
    stale_dropped: int = 0
    """Actions that arrived after their step had been executed."""
    jumps: list[float] = field(default_factory=list)
    """||first action executed after a chunk joined - the action executed before it|| at each boundary
    (not at the episode's first chunk; after starved steps, "before it" is the starved step's action)."""

    @property
    def mean_jump(self) -> float:
        return float(np.mean(self.jumps)) if self.jumps else float("nan")

    @property
    def max_jump(self) -> float:
        return float(np.max(self.jumps)) if self.jumps else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mean_jump": self.mean_jump, "max_jump": self.max_jump}


@dataclass(frozen=True)
class RequestContext:
    """What a robot knows when it sends a request: for real-time chunking, which continues the actions
    the robot will execute while it waits."""

    step: int
    """The episode step the request is stamped with (the chunk's first action is for this step)."""
    delay_steps: int
    """The episode's network delay in steps: the chunk's first ``delay_steps`` actions arrive too late."""
    queued: np.ndarray
    """float32 [k, A]: the queued actions for steps ``step ..`` (k may be below or above the delay)."""


class ContextProposer(Protocol):
    """A proposer that also takes each robot's :class:`RequestContext` (mark it ``wants_context = True``)."""

    wants_context: bool

    def __call__(self, robots: list[int], obs: Obs, context: list[RequestContext]) -> np.ndarray: ...


@dataclass
class _Robot:
    """One robot's episode in the latency world."""

    latency: EpisodeLatency
    queue: _StepQueue
    history: deque[Obs]
    stats: LatencyStats
    inflight: tuple[int, np.ndarray] | None = None
    """(arrival step, the chunk stamped with its sending step ``arrival - network_steps``)."""
    last: np.ndarray | None = None
    acted: bool = False
    """A queued action has executed: later chunks join at a boundary (the first chunk has none)."""


def stack_rows(rows: list[Obs]) -> Obs:
    """One batched observation from robots' rows (the inverse of :func:`~sim.rollout.select_robots`)."""
    first = rows[0]
    out: Obs = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = stack_rows([r[k] for r in rows]) if v else {}
        elif isinstance(v, np.ndarray):
            out[k] = np.stack([r[k] for r in rows])
        else:
            out[k] = [r[k] for r in rows]
    return out


class LatencyRollout(ChunkRollout):
    """A :class:`~sim.rollout.ChunkRollout` in the latency world (see the module docstring): one action
    per chunk record, the robot's queue and requests kept here. ``propose`` is the driver's proposer, or
    a :class:`ContextProposer`. A finished episode's :class:`LatencyStats` is its record's ``latency``."""

    def __init__(
        self,
        env: VectorEnv,
        propose: Proposer | ContextProposer,
        options: LatencyOptions,
        *,
        seed: int | None = None,
        reward_key: str | None = None,
        discount: float = 1.0,
        on_step: Callable[[Any], None] | None = None,
        on_chunks: Callable[[list[ChunkRecord]], None] | None = None,
        on_episode: Callable[[EpisodeRecord], None] | None = None,
    ) -> None:
        self.options = options
        self.robots: list[_Robot | None] = [None] * env.num_envs
        super().__init__(
            env,
            propose,  # type: ignore[arg-type]
            1,
            seed=seed,
            reward_key=reward_key,
            discount=discount,
            on_step=on_step,
            on_chunks=on_chunks,
            on_episode=on_episode,
        )

    @property
    def control_hz(self) -> float:
        """The rate delays are counted in: the options', else the env spec's, else 20 Hz."""
        if self.options.control_hz is not None:
            return self.options.control_hz
        spec = getattr(self.env, "spec", None)
        return float(spec.control_hz) if spec is not None else 20.0

    def _start_episode(self, i: int, obs: Obs) -> _Robot:
        lat = self.options.latency.draw(self.seeds[i], self.control_hz)
        stats = LatencyStats(lat.network_ms, lat.observation_ms, lat.network_steps, lat.observation_steps)
        history: deque[Obs] = deque([obs], maxlen=lat.observation_steps + 1)
        return _Robot(lat, self.options.make_queue(), history, stats)

    def _deliver(self, robot: _Robot, now: int) -> bool:
        """Merge the chunk in flight if it has arrived by step ``now``; True when one joined the queue."""
        if robot.inflight is None or robot.inflight[0] > now:
            return False
        arrival, chunk = robot.inflight
        robot.inflight = None
        before = robot.queue.stats.stale_dropped
        robot.queue.add_chunk(chunk, arrival - robot.latency.network_steps)
        robot.stats.chunks += 1
        robot.stats.stale_dropped += robot.queue.stats.stale_dropped - before
        return True

    def _send(self, senders: list[int]) -> None:
        """One batched request for ``senders``, each with its delayed observation."""
        robots = [self.robots[i] for i in senders]
        obs = stack_rows([r.history[0] for r in robots if r is not None])
        if getattr(self.propose, "wants_context", False):
            context = [
                RequestContext(r.queue.step, r.latency.network_steps, r.queue.upcoming(r.queue.chunk_len))
                for r in robots
                if r is not None
            ]
            chunks = np.asarray(self.propose(senders, obs, context))  # type: ignore[call-arg]
        else:
            chunks = np.asarray(self.propose(senders, obs))
        if chunks.ndim != 3 or chunks.shape[0] != len(senders) or chunks.shape[1] < 1:
            raise ValueError(f"propose: expected chunks [{len(senders)}, H, A], got {list(chunks.shape)}")
        for j, r in enumerate(robots):
            assert r is not None
            r.inflight = (r.queue.step + r.latency.network_steps, chunks[j].astype(np.float32))
            r.stats.requests += 1

    def _starved_action(self, robot: _Robot) -> np.ndarray:
        robot.stats.starved += 1
        if robot.last is not None and self.options.when_starved == "hold":
            return robot.last.copy()
        still = np.zeros(self.action_dim, np.float32)
        g = self.options.gripper
        if g is not None and g < len(still):
            still[g] = GRIPPER_OPEN if robot.last is None else robot.last[g]
        return still

    @property
    def action_dim(self) -> int:
        """The env's action size (from its spec; 1 for specless test envs without one)."""
        spec = getattr(self.env, "spec", None)
        return int(spec.action_dim) if spec is not None else 1

    def refill(self) -> list[int]:
        """Every robot executes one action per step: deliver, send, pop (see the module docstring)."""
        n = self.env.num_envs
        for i in range(n):
            row = select_robots(self.obs, i)
            robot = self.robots[i]
            if robot is None or self.episode_steps[i] == 0:
                self.robots[i] = self._start_episode(i, row)
            else:
                robot.history.append(row)
        boundary = [self._deliver(r, r.queue.step) for r in self.robots if r is not None]
        senders = [
            i
            for i, r in enumerate(self.robots)
            if r is not None and r.inflight is None and r.queue.needs_chunk()
        ]
        if senders:
            self._send(senders)
            for i in senders:
                r = self.robots[i]
                assert r is not None
                boundary[i] = self._deliver(r, r.queue.step) or boundary[i]
        for i, r in enumerate(self.robots):
            assert r is not None
            action = r.queue.pop()
            if action is None:
                action = self._starved_action(r)
                r.queue.step += 1  # the world moved on: actions for this step are stale from now
            else:
                if boundary[i] and r.acted and r.last is not None:
                    r.stats.jumps.append(float(np.linalg.norm(action - r.last)))
                r.acted = True
            r.last = action
            self.queues[i].append(action)
            self.chunks[i] = ChunkRecord(
                robot=i,
                seed=self.seeds[i],
                start_step=int(self.episode_steps[i]),
                obs=select_robots(self.obs, i),
                planned=action[None],
            )
        return list(range(n))

    def _end_episode(self, last: ChunkRecord) -> EpisodeRecord:
        robot = self.robots[last.robot]
        assert robot is not None
        return dataclasses.replace(super()._end_episode(last), latency=robot.stats)

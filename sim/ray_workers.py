"""Simulator workers as Ray actors: the ``--ray auto|ADDRESS`` backend of :class:`sim.vector.VectorSimEnv`.

Each robot of a vector env is one Ray actor holding one :class:`sim.base.SimEnv` (built by
:func:`sim.registry.make_env`, exactly as a subprocess worker builds it), so a vector env can spread
its robots over the nodes of a Ray cluster instead of the processes of one machine. Nothing else
changes: the driver (the vector env in the learner's process) keeps the seed sequence, the episode
counters and the auto-reset, and sends each actor the same ``reset(seed)`` / ``step(action)`` calls a
subprocess worker gets, so a run with Ray workers and one with local workers, same seed, see the same
observations, actions and rewards.

Where: ``auto`` joins the cluster this machine belongs to (``RAY_ADDRESS`` or a running ``ray start``)
and, when there is none, starts a local head bound to 127.0.0.1 only (no dashboard, a 200 MB object
store, ``max(cores, 16)`` CPU slots so a training env and an evaluation env fit side by side, as
subprocess workers would oversubscribe the cores too). Any other value is a cluster address
(``host:port`` or ``ray://host:port``). Ray's token authentication stays as Ray sets it up: the token
comes from ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``, never from our command line. Every node needs
vla-rl and the simulators installed (the same image as the learner).

Faults: every actor is created with ``max_restarts`` (Ray starts a new process and rebuilds the env
when one dies). The driver keeps, per robot, the current episode's seed and the actions sent since its
reset. When a call fails because the actor died (killed, OOM, node lost), or takes longer than
``step_timeout_s`` (then the driver kills it, and Ray restarts it), the driver waits for the
replacement, re-runs the episode on it (``reset(seed)`` then the same actions: the simulators are
deterministic given the seed and the actions) and repeats the call. The caller sees the results it
would have seen without the fault; ``replaced`` counts the replacements per robot.

Never blocked for more than one step: a vector step is one remote call per actor, gathered with
``ray.wait`` under the ``step_timeout_s`` deadline, so the learner waits for at most one env step of
its slowest worker, never for a worker's episode or rollout; a worker that does not answer in time is
replaced as above rather than waited for.

``import ray`` happens only when a Ray backend is built: the subprocess backend does not need Ray.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

AUTO = "auto"
_ADDRESS = re.compile(r"^(ray://)?[A-Za-z0-9._-]+:\d{1,5}$")
LOCAL_HEAD_MIN_CPUS = 16
"""CPU slots a local head started by ``auto`` advertises at least (see the module docstring)."""


class RayUnavailable(RuntimeError):
    """No Ray cluster to run workers on (bad address, cluster down, too few free CPUs): a setup error the
    user can fix, reported in one line."""


def check_ray_address(value: str | None, field: str = "ray") -> str | None:
    """``value`` if it names where Ray workers run (``auto``, ``host:port``, ``ray://host:port``), None for
    none/empty; otherwise a ValueError naming ``field`` and what it expects."""
    if value is None or value == "":
        return None
    value = str(value).strip()
    if value == AUTO or _ADDRESS.match(value):
        return value
    raise ValueError(
        f"{field}: expected 'auto' or a Ray cluster address (host:port or ray://host:port), got {value!r}"
    )


@dataclass
class RayWorkerOptions:
    """How a vector env's Ray actors are placed and supervised."""

    num_cpus: float = 1.0
    """CPUs each actor reserves from the cluster (one simulator per core, like a subprocess worker)."""
    max_restarts: int = 3
    """Times Ray restarts a dead actor (each restart re-runs the robot's episode; see the module docstring)."""
    step_timeout_s: float = 120.0
    """A call (reset, step, render) not answered within this many seconds: the actor is killed and replaced."""
    start_timeout_s: float = 300.0
    """Seconds to wait for the actors to build their envs (first start or a replacement)."""
    object_store_mb: int = 200
    """Object store of a local head started by ``auto`` (observations are small and copied out at once)."""

    def __post_init__(self) -> None:
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus: expected > 0, got {self.num_cpus}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected >= 0, got {self.max_restarts}")
        for name in ("step_timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0 seconds, got {getattr(self, name)}")
        if self.object_store_mb < 80:
            raise ValueError(f"object_store_mb: expected >= 80 (Ray's minimum), got {self.object_store_mb}")


def local_head_options(num_cpus: int, object_store_mb: int = 200) -> dict[str, Any]:
    """``ray.init`` keywords of a small local head for simulator workers (what ``auto`` starts; tests too):
    no dashboard, a small object store, no idle workers started ahead (``enable_worker_prestart``), and
    workers at the driver's priority: Ray runs its workers at ``nice 15`` by default, which on a shared
    machine made a simulator actor several times slower than a subprocess worker (``worker_niceness``)."""
    return dict(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_mb * 2**20,
        _system_config={"enable_worker_prestart": False, "worker_niceness": 0},
    )


def connect(address: str, options: RayWorkerOptions | None = None, min_cpus: int = 1) -> None:
    """Make this process a Ray driver (once): join ``address`` or, for ``auto``, the running cluster or a
    new loopback-only local head. Errors say what failed and how to fix it (RuntimeError)."""
    options = options or RayWorkerOptions()
    address = check_ray_address(address) or AUTO
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address != AUTO:
        try:
            ray.init(address=address, **quiet)  # type: ignore[arg-type]
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailable(
                f"ray: cannot join the Ray cluster at {address} ({e}); start one with `ray start --head` "
                "and give its address, or use --ray auto for a local one"
            ) from None
        return
    try:
        ray.init(address="auto", **quiet)  # type: ignore[arg-type]
        return
    except ConnectionError:
        pass  # no cluster on this machine: start our own
    # Loopback only: Ray otherwise binds its head to the machine's routable address (and all interfaces).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants  # read at import; ray may already be imported

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        **local_head_options(
            max(os.cpu_count() or 1, LOCAL_HEAD_MIN_CPUS, min_cpus), options.object_store_mb
        ),
        **quiet,  # type: ignore[arg-type]
    )
    log.info("started a local Ray head", extra={"address": ray.get_runtime_context().gcs_address})


class SimActor:
    """One simulated robot in a Ray actor (the class Ray wraps; see :func:`_actor_class`)."""

    def __init__(self, make_kwargs: dict[str, Any]) -> None:
        import sys

        from sim.registry import make_env
        from vla_rl.core.scheduling import leave_realtime

        leave_realtime("sim Ray actor")
        self.env = make_env(**make_kwargs)
        if "torch" in sys.modules:  # one simulator per core; torch's pool would only fight it
            sys.modules["torch"].set_num_threads(1)

    def hello(self) -> tuple[dict[str, Any], int, int]:
        return self.env.spec.to_dict(), self.env.max_episode_steps, os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def reset(self, seed: int | None) -> Any:
        return self.env.reset(seed=seed)

    def step(self, action: np.ndarray) -> Any:
        return self.env.step(action)

    def render(self, _: Any = None) -> np.ndarray:
        return self.env.render()

    def replay(self, seed: int | None, actions: list[np.ndarray]) -> int:
        """Re-run the current episode: reset to ``seed`` and take ``actions`` again; returns how many."""
        self.env.reset(seed=seed)
        for a in actions:
            self.env.step(a)
        return len(actions)

    def close(self, _: Any = None) -> None:
        self.env.close()


_ACTOR: Any = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(SimActor)
    return _ACTOR


def _writable(x: Any) -> Any:
    """Results as a local call returns them: Ray hands numpy arrays back read-only (zero-copy views)."""
    if isinstance(x, np.ndarray):
        return x if x.flags.writeable else x.copy()
    if isinstance(x, dict):
        return {k: _writable(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_writable(v) for v in x)
    if isinstance(x, list):
        return [_writable(v) for v in x]
    return x


class RayWorkers:
    """``num_envs`` :class:`SimActor` s and the per-robot episode log that lets a replacement catch up."""

    def __init__(
        self,
        make_kwargs: dict[str, Any],
        num_envs: int,
        address: str,
        options: RayWorkerOptions | None = None,
    ) -> None:
        import ray

        self.options = options or RayWorkerOptions()
        connect(address, self.options, min_cpus=num_envs)
        self.num_envs = num_envs
        need = num_envs * self.options.num_cpus
        have = float(ray.available_resources().get("CPU", 0.0))
        if have < need:
            raise RayUnavailable(
                f"ray: the cluster has {have:g} free CPUs but {num_envs} sim workers x {self.options.num_cpus:g} "
                f"CPU need {need:g}; add nodes, lower num_envs, or end the other jobs on it"
            )
        cls = _actor_class().options(
            num_cpus=self.options.num_cpus,
            max_restarts=self.options.max_restarts,
            max_task_retries=0,  # a call is repeated by us, after the episode is re-run, never blindly by Ray
        )
        self.actors = [cls.remote(make_kwargs) for _ in range(num_envs)]
        self.replaced = [0] * num_envs
        # Per robot: the seed of its current episode and the actions taken in it since the reset.
        self._episode: list[tuple[int | None, list[np.ndarray]]] = [(None, []) for _ in range(num_envs)]
        try:
            hellos = self._gather(
                {a.hello.remote(): i for i, a in enumerate(self.actors)}, self.options.start_timeout_s
            )
        except Exception:
            self.close()
            raise
        if any(isinstance(h, BaseException) for h in hellos.values()):
            self.close()
            bad = {i: h for i, h in hellos.items() if isinstance(h, BaseException)}
            i, err = next(iter(sorted(bad.items())))
            raise RuntimeError(f"sim env {i}: its Ray worker did not start: {_short(err)}")
        self.spec_dict, self.max_episode_steps, _ = hellos[0]
        self.pids = [hellos[i][2] for i in range(num_envs)]

    # ---------------------------------------------------------------- calls
    def _gather(self, refs: dict[Any, int], timeout_s: float) -> dict[int, Any]:
        """``{robot: result or the exception}``; robots whose call is still running at the deadline get
        :class:`TimeoutError`."""
        import ray

        out: dict[int, Any] = {}
        pending = dict(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=max(left, 0.0))
            for ref in ready:
                i = pending.pop(ref)
                try:
                    out[i] = ray.get(ref)
                except Exception as e:  # RayActorError (died), RayTaskError (the env raised), ...
                    out[i] = e
            if not ready and left <= 0:
                for i in pending.values():
                    out[i] = TimeoutError(f"no answer in {timeout_s:g} s")
                break
        return out

    def call(self, cmd: str, robots: list[int], args: list[Any]) -> list[Any]:
        """``cmd(arg)`` on each robot's actor, in parallel; results in ``robots`` order. A dead or hung actor
        is replaced, its episode re-run, and the call repeated (see the module docstring)."""
        import ray

        refs = {getattr(self.actors[i], cmd).remote(a): i for i, a in zip(robots, args, strict=True)}
        got = self._gather(refs, self.options.step_timeout_s)
        arg_of = dict(zip(robots, args, strict=True))
        for i in robots:
            r = got[i]
            if isinstance(
                r, ray.exceptions.RayTaskError
            ):  # the simulator itself raised: not a fault to retry
                raise RuntimeError(f"sim env {i} failed:\n{r}")
            if isinstance(r, BaseException):
                got[i] = self._recover(i, cmd, arg_of[i], r)
        for i in robots:
            if cmd == "reset":
                self._episode[i] = (arg_of[i], [])
            elif cmd == "step":
                self._episode[i][1].append(np.array(arg_of[i], copy=True))
        return [_writable(got[i]) for i in robots]

    def _recover(self, i: int, cmd: str, arg: Any, error: BaseException) -> Any:
        """Robot ``i``'s actor failed ``cmd``: replace it, re-run its episode, repeat ``cmd``."""
        import ray

        seed, actions = self._episode[i]
        log.warning(
            "sim worker lost: replacing it and re-running its episode",
            extra={
                "env": i,
                "call": cmd,
                "error": _short(error),
                "episode_seed": seed,
                "steps": len(actions),
            },
        )
        if self.replaced[i] >= self.options.max_restarts:
            raise RuntimeError(
                f"sim env {i}: its Ray worker failed again after {self.replaced[i]} replacements "
                f"(max_restarts {self.options.max_restarts}): {_short(error)}"
            )
        if isinstance(error, TimeoutError):  # hung, not dead: make it dead; Ray restarts it
            ray.kill(self.actors[i], no_restart=False)
        last: BaseException = error
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            try:
                if cmd != "reset" and seed is not None:
                    ray.get(self.actors[i].replay.remote(seed, actions), timeout=self.options.start_timeout_s)
                result = ray.get(
                    getattr(self.actors[i], cmd).remote(arg), timeout=self.options.step_timeout_s
                )
                pid = ray.get(self.actors[i].pid.remote(), timeout=self.options.step_timeout_s)
            except ray.exceptions.RayTaskError as e:
                raise RuntimeError(f"sim env {i} failed:\n{e}") from None
            except ray.exceptions.GetTimeoutError as e:  # the replacement hangs too
                last = e
                break
            except ray.exceptions.RayActorError as e:  # calls made while Ray restarts it
                last = e
                time.sleep(0.5)
                continue
            self.replaced[i] += 1
            self.pids[i] = pid
            log.warning("sim worker replaced", extra={"env": i, "pid": pid, "replayed_steps": len(actions)})
            return result
        raise RuntimeError(
            f"sim env {i}: its Ray worker could not be replaced within {self.options.start_timeout_s:g} s: "
            f"{_short(last)}"
        )

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in self.actors:
            ray.kill(a, no_restart=True)  # the env's resources go with the process
        self.actors = []


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------- fleet robots (vla-rl fleet sim)
class DeskActor:
    """The operator desk of a fleet whose robots are Ray actors: seats held per robot, so the seats of a
    robot that died are given back when it is replaced (see :class:`sim.operator.OperatorDesk`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[str, int] = {}
        self.busy_waits = 0

    def try_acquire(self, robot: str) -> bool:
        if sum(self.held.values()) < self.capacity:
            self.held[robot] = self.held.get(robot, 0) + 1
            return True
        self.busy_waits += 1
        return False

    def release(self, robot: str) -> None:
        if self.held.get(robot, 0) > 0:
            self.held[robot] -= 1

    def release_all(self, robot: str) -> None:
        self.held.pop(robot, None)

    def waits(self) -> int:
        return self.busy_waits


class RayDesk:
    """One robot's handle on a :class:`DeskActor`, with :class:`sim.operator.OperatorDesk`'s interface."""

    def __init__(self, actor: Any, robot: str) -> None:
        self.actor, self.robot = actor, robot

    def try_acquire(self) -> bool:
        import ray

        return bool(ray.get(self.actor.try_acquire.remote(self.robot)))

    def release(self) -> None:
        import ray

        ray.get(self.actor.release.remote(self.robot))

    @property
    def busy_waits(self) -> int:
        import ray

        return int(ray.get(self.actor.waits.remote()))


def wait_alive(actor: Any, timeout_s: float) -> int:
    """Wait until ``actor`` (being restarted by Ray) answers; its pid. Calls made while Ray restarts an
    actor can fail rather than wait, so this asks again until ``timeout_s`` (then RuntimeError)."""
    import ray

    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return int(ray.get(actor.pid.remote(), timeout=max(deadline - time.monotonic(), 0.1)))
        except ray.exceptions.RayActorError as e:
            last = e
            time.sleep(0.5)
        except ray.exceptions.GetTimeoutError as e:
            last = e
    raise RuntimeError(
        f"the Ray actor did not come back within {timeout_s:g} s: {_short(last or TimeoutError())}"
    )


def remote_class(cls: type, **options: Any) -> Any:
    """``cls`` as a Ray actor class with ``options`` (Ray imported here, not at module import)."""
    import ray

    return ray.remote(cls).options(**options)

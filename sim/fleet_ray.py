"""The Ray path of ``vla-rl fleet sim --ray``: each robot of the fleet runs in a Ray actor
(:class:`RobotActor`), the operator desk in another, the reports through a Ray queue; :class:`RayFleet`
replaces a robot whose actor died, from the episode it was in."""

from __future__ import annotations

import logging
import os
from typing import Any

from sim.fleet_robot import SimRobotConfig, sim_robot_main

log = logging.getLogger("vla_rl.fleet")


class RobotActor:
    """A simulated fleet robot in a Ray actor: runs :func:`sim_robot_main` when asked."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg: SimRobotConfig, desk: Any, reports: Any) -> None:
        sim_robot_main(cfg, desk, reports)


class RayFleet:
    """The robots of ``vla-rl fleet sim --ray``: one Ray actor each (restarted by Ray up to
    ``max_restarts`` times), a desk actor, and a Ray queue for the reports. ``address`` is where Ray runs
    (:func:`sim.ray_workers.connect`); ``operators`` the robots the operator desk can drive at once.
    ``help_desk``: the requests mode's help queue desk (:class:`sim.help_queue_desk.QueueDesk`), handed to
    every robot as it is (it reaches the queue through the collector, from any node) instead of the desk
    actor's seats."""

    def __init__(
        self,
        address: str,
        robots: list[SimRobotConfig],
        operators: int,
        max_restarts: int,
        help_desk: Any = None,
    ) -> None:
        from ray.util.queue import Queue

        from sim.ray_workers import DeskActor, RayDesk, connect, remote_class

        connect(address, min_cpus=len(robots))
        self.max_restarts, self.robots = max_restarts, {rc.robot_id: rc for rc in robots}
        self.reports = Queue(actor_options={"num_cpus": 0})
        self.desk = remote_class(DeskActor, num_cpus=0).remote(operators)
        self._desk_view = RayDesk
        self.help_desk = help_desk
        robot_cls = remote_class(RobotActor, num_cpus=1, max_restarts=max_restarts, max_task_retries=0)
        self.actors = {rid: robot_cls.remote() for rid in self.robots}
        self.replaced: dict[str, int] = {}
        self.runs: dict[Any, str] = {}
        for rid in self.robots:
            self._run(rid)

    def _run(self, rid: str) -> None:
        desk = self.help_desk if self.help_desk is not None else self._desk_view(self.desk, rid)
        ref = self.actors[rid].run.remote(self.robots[rid], desk, self.reports)
        self.runs[ref] = rid

    @property
    def busy_waits(self) -> int:
        import ray

        return int(ray.get(self.desk.waits.remote()))

    def check(self, done_episodes: dict[str, int]) -> list[tuple[str, str]]:
        """Replace the robots whose actor died (those still ``running``, with the episodes they finished);
        returns ``(robot, error)`` for those that cannot be replaced any more."""
        import ray

        from sim.ray_workers import wait_alive

        failed: list[tuple[str, str]] = []
        ready, _ = ray.wait(list(self.runs), num_returns=len(self.runs), timeout=0)
        for ref in ready:
            rid = self.runs.pop(ref)
            try:
                ray.get(ref)
                continue  # finished: its "done" report is in the queue
            except ray.exceptions.RayActorError as e:
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if rid not in done_episodes:
                continue
            n = self.replaced.get(rid, 0)
            if n >= self.max_restarts:
                failed.append((rid, f"robot actor died {n + 1} times (ray_max_restarts {n}): {error}"))
                continue
            self.replaced[rid] = n + 1
            try:
                wait_alive(self.actors[rid], 300.0)
            except RuntimeError as e:
                failed.append((rid, f"robot actor died and was not replaced: {e}"))
                continue
            self.desk.release_all.remote(rid)  # the seat it may have held
            self.robots[rid].first_episode = done_episodes[rid]
            log.warning(
                "robot actor died: replaced; re-running its episode",
                extra={"robot": rid, "episode_index": done_episodes[rid], "error": error},
            )
            self._run(rid)
        return failed

    def close(self) -> None:
        import ray

        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        ray.kill(self.desk, no_restart=True)
        self.reports.shutdown()

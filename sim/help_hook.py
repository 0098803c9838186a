"""A simulated robot asks a human for help when its alarm fires (``vla-rl fleet sim --help-requests``).

The simulated operator decides takeovers in the simulation; this hook additionally opens a help request
in the fleet's help queue (collector ``RequestHelp``, :mod:`vla_rl_client.help_client`) the first time in
an episode that an alarm fires: the server's learned failure predictor (``ActResult.failure_alarm``;
urgency = its failure score) or the uncertainty CUSUM (urgency = the chunk's standardised score,
``(x - mean) / std``). So the dashboard's help queue has real requests to show. At the end of the episode
a request nobody claimed is withdrawn. A failed call is logged and skipped: asking for help never stops a
robot.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vla_rl_client.help_client import MAX_REASON_CHARS, HelpClient, HelpError

log = logging.getLogger("vla_rl.fleet")


def alarm(res: Any, operator: Any) -> tuple[str, float] | None:
    """``(reason, urgency)`` when an alarm fired on this chunk (``res``: an ``ActResult``; ``operator``: the
    robot's :class:`~sim.operator.SimulatedOperator` after it saw the chunk), else None."""
    if getattr(res, "failure_alarm", False) and math.isfinite(res.failure):
        return f"failure predictor: {res.failure:.2f} on this chunk", float(res.failure)
    r = operator.rules
    if r.uncertainty_alarm and operator.cusum > r.uncertainty_h and math.isfinite(res.uncertainty):
        z = (float(res.uncertainty) - r.uncertainty_mean) / r.uncertainty_std
        return f"uncertainty: CUSUM {operator.cusum:.2f} > {r.uncertainty_h:.2f}", z
    return None


class HelpAsker:
    """One robot's help requests: at most one per episode (see the module docstring)."""

    def __init__(self, collector: str, robot_id: str, token: str | None) -> None:
        self.client = HelpClient(collector, robot_id, token=token, timeout_s=2.0)
        self.request_id: int | None = None
        self.asked = 0

    def on_chunk(self, episode_id: str, res: Any, operator: Any) -> None:
        """After the operator saw a new chunk: ask, if an alarm fired and this episode has not asked yet."""
        if self.request_id is not None:
            return
        fired = alarm(res, operator)
        if fired is None:
            return
        reason, urgency = fired
        try:
            self.request_id = self.client.ask(episode_id, reason[:MAX_REASON_CHARS], urgency).request_id
            self.asked += 1
        except (HelpError, ValueError) as e:
            log.warning("help request failed", extra={"episode_id": episode_id, "error": str(e)})

    def end_episode(self) -> None:
        """Withdraw this episode's request if nobody claimed it (the robot no longer needs help)."""
        rid, self.request_id = self.request_id, None
        if rid is None:
            return
        try:
            if self.client.status(rid).status == "open":
                self.client.withdraw(rid)
        except HelpError as e:
            log.warning("help request not withdrawn", extra={"request": rid, "error": str(e)})

    def close(self) -> None:
        self.client.close()

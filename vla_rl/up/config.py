"""``vla-rl up``'s flags: :class:`UpConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

RTCMode = Literal["auto", "on", "off"]  # vla_rl_client.action_queue.RTC_MODES (kept light: no grpc here)
CONTINUOUS_MIN_CORES = 4
"""``--continuous`` is the default on a machine with at least this many cores: below it the trainer and the
fleet fight over too few cores for either to keep its pace."""
MAX_NICE = 19


def continuous_default() -> bool:
    """Whether this machine runs ``up`` continuously by default (:data:`CONTINUOUS_MIN_CORES`)."""
    return (os.cpu_count() or 1) >= CONTINUOUS_MIN_CORES


IMAGE_MULTIPLE = 32
"""A LeRobot policy's ``image_size`` is a multiple of this: 16 px patches, then SmolVLM's 2 x 2 pixel shuffle."""


@dataclass
class UpConfig:
    """The whole improvement loop on this machine: registry, policy server following prod, collector,
    round worker and a simulated fleet with its operator; rounds train on what the fleet does, and the
    server swaps to each promoted checkpoint live. Stop it with Ctrl-C; run it again to resume."""

    task: str = "maniskill/PickCube-v1"
    """Simulated task the fleet works on."""
    policy: str = "flowvla"
    """The policy the loop improves: ``flowvla`` (our FlowVLA, from the task's state) or a LeRobot flow VLA,
    ``smolvla`` / ``pi0`` / ``pi05``: a small configuration of the published architecture built here
    (:func:`vla_rl.up.lerobot.up_sizes`), acting from the task's camera at ``image_size`` px."""
    image_size: int = 64
    """Camera resolution (square, px) of a LeRobot policy's loop: the demos, the fleet and the small VLM's
    vision tower all use it (unused by flowvla, which acts from the state)."""
    robots: int = 4
    """Simulated robots (one process each)."""
    operators: int = 1
    """Robots the simulated operator can drive at once (--operator-mode requests: simulated operators
    working the help queue, one robot each)."""
    operator_mode: Literal["omniscient", "requests"] = "omniscient"
    """The simulated operator (`vla-rl fleet sim --mode`): omniscient = takes over when a robot stalls or
    drifts (it reads the simulator's state); requests = sees no simulator state: robots ask in the help
    queue when the served failure predictor alarms (a checkpoint that carries one) or at random
    (--spot-check-prob), and --operators simulated operators (sim-operator-0, ...) claim the most urgent
    request, drive the robot and resolve it there, as a person does on the dashboard's help queue page."""
    reaction_s: float = 0.5
    """--operator-mode requests: seconds from a simulated operator claiming a request to taking over."""
    spot_check_prob: float = 0.0
    """--operator-mode requests: chance per robot step of asking for a look at random."""
    rtc: RTCMode = "auto"
    """The fleet's real-time chunking (`vla-rl fleet sim --rtc`): auto = off for simulated robots (they wait
    for each chunk: no inference delay to hide); on = each chunk guided toward the rest of the previous."""
    help_requests: bool = True
    """The fleet's robots open a help request in the dashboard's help queue when an alarm fires (`vla-rl
    fleet sim --help-requests`: the server's failure predictor, when the checkpoint carries one)."""
    rounds: int = 3
    """Post-training rounds to run (counting rounds of earlier runs in this workdir); then it exits."""
    episodes: int = 10
    """Episodes per robot between rounds (the trigger): 40 fleet episodes a round with 4 robots. Why 10 and
    not 5: docs/benchmarks.md, "The improvement loop". With --continuous: the round triggers once the fleet
    closed robots x this many episodes since the previous round's snapshot."""
    continuous: bool = field(default_factory=continuous_default)
    """Keep the fleet working under prod while a round trains (instead of stopping it): each round trains
    on a snapshot, the episodes closed when it was queued, and the server's swap reaches each robot at its
    next action chunk. The default on a machine with 4 or more cores; batch (--no-continuous) below."""
    trainer_nice: int = 5
    """With --continuous: niceness added to each round's process, so that the robots, the policy server and
    the collector keep their pace while it trains (0..19; 0 = as the fleet)."""
    algo: str = "awr"
    """Round algorithm (see `vla-rl round start --help`), unless --preset names a recipe."""
    preset: str | None = None
    """Named round recipe (vla_rl/train/presets.py); overrides --algo."""
    data: str | None = None
    """What each round trains on, as selection text (e.g. `success=true`; see `vla-rl round start
    --help`); None = every episode of the task (the base's demos and everything the fleet did)."""
    round_steps: int | None = None
    """Training steps of each round (over the algorithm's or the preset's); None = theirs."""
    base_preset: str | None = None
    """Named SFT recipe for the weak base; None = the defaults below."""
    base_demos: int = 25
    """Scripted demonstrations the base is trained on (the default makes the weak base a loop should start
    from; its measured success: docs/benchmarks.md, "The improvement loop")."""
    base_noise: float = 0.5
    """Expert sloppiness of those demonstrations."""
    base_steps: int | None = 1000
    """SFT steps of the base (over the preset's); None = the preset's (or SFT's default)."""
    eval_episodes: int = 50
    """Held-out episodes a round evaluates candidate and base on (the same seeds every round)."""
    margin: float = 0.0
    """Promote only if the candidate beats the base by more than this (a fraction)."""
    gate_alpha: float = 0.05
    """...and only if the gate's paired test on the shared seeds says so at this false-promotion rate
    (1 = no test; see `vla-rl round start --help`)."""
    failure_predictor: bool = False
    """Each round also fits the learned failure predictor on the fleet's episodes (takeovers and failed
    endings) and ships it in the candidate (`vla-rl round start --failure-predictor`); the server then
    returns its score with every chunk, and help requests use its alarm."""
    report_episodes: int = 20
    """Episodes a promoted candidate is scored on again, on seeds the gate did not see: the success the
    table shows (0 = off: "not measured")."""
    workdir: Path = Path("runs/up")
    """Everything lives here; running again in the same workdir resumes."""
    seed: int = 0
    """Seeds the demos, the base, the fleet's episodes and the rounds."""
    repo: str = "up/policy"
    """Registry repo the checkpoints go to."""
    progress: bool = True
    """Progress bars for the base's training."""
    round_timeout_s: float = 3600.0
    """Give up waiting for one round after this long (the loop stops with an error)."""
    dashboard: bool = True
    """Start `vla-rl dashboard` as one of the children, where this install has that command."""
    db: str | None = None
    """Metadata DB URL (e.g. postgresql://host/vla_rl) that the collector, worker, rounds and dashboard
    share; None = the SQLite file in <workdir>/store. A resumed run must name the same DB."""

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        for name in (
            "robots",
            "operators",
            "rounds",
            "episodes",
            "base_demos",
            "eval_episodes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        self._check_operator()
        if self.rtc not in get_args(RTCMode):
            raise ValueError(f"rtc: expected one of {list(get_args(RTCMode))}, got {self.rtc!r}")
        if not 0.0 < self.gate_alpha <= 1.0:
            raise ValueError(f"gate_alpha: expected a false-promotion rate in (0, 1], got {self.gate_alpha}")
        if self.report_episodes < 0:
            raise ValueError(
                f"report_episodes: expected 0 (off) or more episodes, got {self.report_episodes}"
            )
        self._check_policy()
        if self.round_steps is not None and self.round_steps < 1:
            raise ValueError(f"round_steps: expected a positive integer or None, got {self.round_steps}")
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s: expected > 0 seconds, got {self.round_timeout_s}")
        if not 0 <= self.trainer_nice <= MAX_NICE:
            raise ValueError(f"trainer_nice: expected a niceness in 0..{MAX_NICE}, got {self.trainer_nice}")
        self._check_snapshot_keys()
        if self.db is not None and not self.db.strip():
            raise ValueError("db: expected a metadata DB URL (e.g. postgresql://host/vla_rl), got ''")

    def _check_operator(self) -> None:
        """The operator's mode and its requests-mode knobs, checked as the fleet's rules check them."""
        if self.operator_mode not in ("omniscient", "requests"):
            raise ValueError(
                f"operator_mode: expected 'omniscient' or 'requests', got {self.operator_mode!r}"
            )
        self.operator_rules()  # ValueError naming reaction_s or spot_check_prob

    def operator_rules(self) -> Any:
        """The fleet's :class:`sim.operator.OperatorRules`: the omniscient default, or the requests mode on
        the failure predictor's alarm and spot checks."""
        from sim.operator import OperatorRules

        if self.operator_mode == "omniscient":
            return OperatorRules()
        return OperatorRules(
            mode="requests",
            failure_alarm=True,
            reaction_s=self.reaction_s,
            spot_check_prob=self.spot_check_prob,
        )

    def _check_snapshot_keys(self) -> None:
        """With --continuous each round's data is narrowed to its snapshot (``closed_until``): ``data``
        must leave that key to the loop."""
        if not self.continuous or self.data is None:
            return
        from fleet.selection import Selection

        if Selection.parse(self.data).closed_until is not None:
            raise ValueError(
                f"data: with continuous each round selects the episodes closed before it was queued; "
                f"leave closed_until out of the selection, got {self.data!r}"
            )

    @property
    def lerobot(self) -> bool:
        """Whether the loop runs a LeRobot VLA (from the camera) rather than our FlowVLA (from the state)."""
        return self.policy != "flowvla"

    def _check_policy(self) -> None:
        """``policy`` is flowvla or a LeRobot flow VLA; a LeRobot VLA's ``image_size`` fits its vision tower."""
        if not self.lerobot:
            return
        from policies.lerobot_flow import FLOW_TYPES

        if self.policy not in FLOW_TYPES:
            raise ValueError(
                f"policy: up needs a flow-matching policy; {self.policy} is not one "
                f"(expected flowvla, {', '.join(FLOW_TYPES[:-1])} or {FLOW_TYPES[-1]})"
            )
        if self.image_size < 1 or self.image_size % IMAGE_MULTIPLE:
            raise ValueError(
                f"image_size: expected a positive multiple of {IMAGE_MULTIPLE} (the small VLM's 16 px patches, "
                f"2 x 2 pixel shuffle), got {self.image_size}"
            )

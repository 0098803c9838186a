"""``vla-rl failure fit``: the learned failure / takeover predictor (vla_rl/train/failure.py), a sibling
artefact of the checkpoint that the policy server serves next to ``accel``."""

from __future__ import annotations

from typing import Any

from vla_rl.cli.common import Command, user_errors


def _fit_args() -> type:
    from vla_rl.train.failure import FailureFitConfig

    return FailureFitConfig


def failure_fit(cfg: Any) -> int:
    """Fit the predictor on the store's episodes, calibrate its alarm, and save it (default BASE/failure)."""
    from vla_rl.hub.checkpoint import CheckpointError
    from vla_rl.train.failure import train_failure

    with user_errors(FileNotFoundError, ValueError, CheckpointError):
        s = train_failure(cfg)
    print(
        f"failure predictor on {s['rows']} rows ({s['positive_rows']} positive) of {s['train_episodes']} "
        f"episodes; threshold {s['threshold']:.3f} at alpha {cfg.alpha} from {s['calibration_successes']} "
        f"held-out successes; held-out failing episodes flagged >= {cfg.lead_s:g} s early: "
        f"{s['heldout_flagged']}/{s['heldout_failing_episodes']}; {s['seconds']:.0f} s: {s['out']}"
    )
    return 0


COMMANDS = [
    Command(
        ("failure", "fit"),
        "fit the learned failure / takeover predictor the policy server serves next to accel",
        _fit_args,
        failure_fit,
    ),
]

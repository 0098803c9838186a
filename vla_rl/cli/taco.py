"""``vla-rl taco fit``: TACO's coin-flipping network for test-time chunk selection (``vla-rl eval --taco``)."""

from __future__ import annotations

from typing import Any

from vla_rl.cli.common import Command, user_errors


def _fit_args() -> type:
    from vla_rl.train.taco import TACOConfig

    return TACOConfig


def taco_fit(cfg: Any) -> int:
    """Fit the CFN on the base's SFT data (vla_rl/train/taco.py) and save it in --out."""
    from vla_rl.hub.checkpoint import CheckpointError
    from vla_rl.train.taco import train_taco

    with user_errors(FileNotFoundError, ValueError, CheckpointError):
        summary = train_taco(cfg)
    print(
        f"TACO coin-flipping network on {summary['rows']} frames of {summary['episodes']} episodes "
        f"(n_exec {summary['n_exec']}, final loss {summary['final_loss']:.3f}) in {summary['seconds']:.0f} s: "
        f"{cfg.out}; use it with: vla-rl eval --checkpoint {cfg.base} --taco {cfg.out} --num-samples {cfg.num_samples}"
    )
    return 0


COMMANDS = [
    Command(
        ("taco", "fit"), "fit TACO's pseudo-count network for best-of-N chunk selection", _fit_args, taco_fit
    ),
]

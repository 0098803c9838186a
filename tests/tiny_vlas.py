"""What the tests of LeRobot's flow VLAs (tiny SmolVLA / π0 / π0.5 folders, policies/lerobot_tiny.py) share:
the toy robot they are built for and non-trivial normalisation statistics, so the folders' processors are
really exercised (identity statistics would hide a missing normalisation step)."""

from __future__ import annotations

from vla_rl_client.spec import CameraSpec, RobotSpec

SPEC = RobotSpec(
    name="toy/Push-v0",
    state_dim=3,
    action_dim=2,
    control_hz=10.0,
    instruction="push the red cube",
    cameras=(CameraSpec("top", 48, 48),),
)
STATS = {
    "observation.state": {
        "mean": [0.5, -1.0, 2.0],
        "std": [2.0, 0.5, 1.0],
        "q01": [-3.0] * 3,
        "q99": [3.0] * 3,
    },
    "observation.images.top": {"mean": [[[0.0]]] * 3, "std": [[[1.0]]] * 3},
    "action": {
        "mean": [1.0, -2.0],
        "std": [0.5, 3.0],
        "min": [-1.0, -8.0],
        "max": [3.0, 4.0],
        "q01": [-1.0, -8.0],
        "q99": [3.0, 4.0],
    },
}

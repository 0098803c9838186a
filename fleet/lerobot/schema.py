"""The LeRobot feature keys both directions use, and where our sidecar lives in a dataset."""

from __future__ import annotations

STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGES_PREFIX = "observation.images."
SINGLE_IMAGE_KEY = "observation.image"
REWARD_KEY = "next.reward"
DONE_KEY = "next.done"
TRUNCATED_KEY = "next.truncated"
SUCCESS_KEY = "next.success"
OUTCOME_KNOWN_KEY = "outcome_known"
CONTROLLER_KEY = "controller"
INTERVENTION_KEY = "intervention"
HIL_INTERVENTION_KEY = "complementary_info.is_intervention"  # what LeRobot's HIL-SERL buffer writes
SEGMENT_KEY = "segment"
SIDECAR_PATH = "meta/vla_rl.json"
SIDECAR_FORMAT = "vla-rl-lerobot-export"
SIDECAR_VERSION = 1

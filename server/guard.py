"""What a request may be: its size (derived from the robot spec) and the bounds on its fields."""

from __future__ import annotations

import logging

from vla_rl_client.spec import RobotSpec

from server.config import MESSAGE_SLACK_BYTES

log = logging.getLogger("vla_rl.server")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # only an upper bound now: the default is derived from the spec
MIN_DERIVED_MESSAGE_BYTES = 1024 * 1024  # headroom for a later checkpoint with a slightly larger spec
MAX_INSTRUCTION_CHARS = 2000
MAX_REQUEST_ID_CHARS = 200


def request_bytes_for(spec: RobotSpec, noise_shape: tuple[int, int] | None) -> int:
    """The largest ActRequest a robot with ``spec`` needs to send: every camera raw (or encoded, up to 2x
    raw for incompressible JPEG/PNG), the state, explicit noise, plus
    :data:`~server.config.MESSAGE_SLACK_BYTES` (ids, instruction, framing)."""
    pixels = sum(c.height * c.width * 3 for c in spec.cameras)
    noise = 4 * noise_shape[0] * noise_shape[1] if noise_shape else 0
    return 2 * pixels + 4 * spec.state_dim + noise + MESSAGE_SLACK_BYTES

"""One recorded time step of a robot: :class:`Frame`, the fields a robot client sends and an episode writer
stores, defined once.

    frame = Frame(cameras=obs["cameras"], state=obs["state"], action=executed, proposed_action=proposed,
                  reward=r, revision=result.commit, uncertainty=result.uncertainty,
                  failure=result.failure)
    client.add(frame)            # or client.add_frame(cameras=..., state=..., action=..., ...)
    frame.digest()               # a content hash, equal to the digest of the frame the store holds

Validation against a robot spec happens where a frame is taken (``RobotClient.add``,
``EpisodeWriter.add``): a bad field raises :class:`~vla_rl_client.spec.SpecError` naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vla_rl_client.meta import Controller

__all__ = ["FRAME_FIELDS", "Frame"]


@dataclass(frozen=True, eq=False)
class Frame:
    """One frame: what the robot saw, what it did, what the policy proposed, and who was in control.

    Arrays are not copied here; whoever takes the frame copies what it keeps, so a caller may reuse its
    buffers once ``add`` returned.
    """

    cameras: Mapping[str, np.ndarray]
    """Camera name -> uint8 [H, W, 3] image, one per camera of the robot spec."""
    state: np.ndarray
    """float32 [S]: proprioceptive state."""
    action: np.ndarray
    """float32 [A]: the action actually executed (normalised to [-1, 1])."""
    proposed_action: np.ndarray | None = None
    """float32 [A]: what the policy proposed; None or an all-NaN row: no proposal (e.g. a human drove)."""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    controller: Controller | str | int | None = None
    """Who was in control (policy, human, scripted); None: the current segment's controller."""
    revision: str = ""
    """The checkpoint revision (commit) that produced the action; "" for none."""
    timestamp: float | None = None
    """Unix seconds; None: now. Times of an episode may not go backwards."""
    uncertainty: float | None = None
    """The policy server's score of the chunk the action came from (``ActResult.uncertainty``); None or
    NaN: none (e.g. a human's frame)."""
    failure: float | None = None
    """The learned failure predictor's score of the chunk the action came from (``ActResult.failure``, a
    probability in [0, 1]); None or NaN: none (a human's frame, a checkpoint without a predictor)."""

    def fields(self) -> dict[str, Any]:
        """Field name -> value, shallow (the arrays themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def digest(self) -> str:
        """A content hash of the frame, computed the same way from what a robot sent and what a store
        holds (cameras, state, action, proposal, reward, flags, controller, time; not the revision or the
        scores). Needs a known ``controller`` and ``timestamp``, which the store fills in otherwise."""
        if self.controller is None or self.timestamp is None:
            missing = "controller" if self.controller is None else "timestamp"
            raise ValueError(f"{missing}: a frame's digest needs it (the store fills it in when it is None)")
        h = hashlib.sha256()
        for name in sorted(self.cameras):
            h.update(name.encode())
            h.update(np.ascontiguousarray(self.cameras[name], np.uint8).tobytes())
        action = np.asarray(self.action, np.float32)
        if self.proposed_action is None:
            prop = np.full(action.shape, np.nan, np.float32)
        else:
            prop = np.asarray(self.proposed_action, np.float32)
        prop = np.where(np.isnan(prop), np.float32(np.nan), prop)  # one NaN bit pattern
        for arr in (self.state, action, prop):
            h.update(np.ascontiguousarray(arr, np.float32).tobytes())
        h.update(np.array([self.reward], np.float32).tobytes())
        h.update(np.array([self.terminated, self.truncated], np.bool_).tobytes())
        h.update(np.array([int(Controller.parse(self.controller))], np.uint8).tobytes())
        h.update(np.array([self.timestamp], np.float64).tobytes())
        return h.hexdigest()


FRAME_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Frame))
"""The names of a frame's fields (also the keys of a batch of frames, see ``EpisodeWriter.add_frames``)."""

"""How long a flow model's forward spent encoding the observation (``encode_prefix``: the VLM / trunk pass)
and how long denoising, so every reply can split its ``inference_us`` into prefix and denoise.

A policy's ``sample`` calls ``encode_prefix`` itself (twice under classifier-free guidance), so the only
way to time it without a second code path is to time those calls: :func:`timed_prefix` shadows the
policy instance's ``encode_prefix`` with a timed wrapper while one batch runs, and restores it after.
The batcher is the only thread that runs a served policy, so nothing else sees the wrapper.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class PrefixClock:
    """Nanoseconds spent in ``encode_prefix`` calls while :func:`timed_prefix` was entered."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self.last: tuple[Any, Any] | None = None
        """(observation, prefix) of the last ``encode_prefix`` call."""

    def sole_prefix(self) -> Any | None:
        """The batch's prefix when the forward encoded it exactly once from the observation as the robots
        sent it (no advantage conditioning), so a reader of ``features(prefix)`` (the failure predictor)
        can reuse it instead of a second pass; None otherwise (classifier-free guidance encodes twice)."""
        if self.calls != 1 or self.last is None:
            return None
        obs, prefix = self.last
        return None if not isinstance(obs, Mapping) or "advantage" in obs else prefix

    def split_us(self, inference_us: int) -> tuple[int, int]:
        """(prefix_us, denoise_us) of a forward that took ``inference_us``: the prefix's share, capped at the
        whole, and the rest; (0, 0) when ``encode_prefix`` was never called (nothing to split)."""
        if not self.calls:
            return 0, 0
        prefix = min(self.ns // 1000, inference_us)
        return prefix, inference_us - prefix


def flow_policy_of(model: Any) -> Any | None:
    """The flow policy behind a served ``model`` (one with an ``encode_prefix``), or None: our checkpoints'
    ``model.loaded.policy``, or a ``model.policy`` (LeRobot VLAs on the flow-policy contract)."""
    loaded = getattr(model, "loaded", None)
    for policy in (getattr(loaded, "policy", None), getattr(model, "policy", None)):
        if policy is not None and callable(getattr(policy, "encode_prefix", None)):
            return policy
    return None


@contextlib.contextmanager
def timed_prefix(model: Any) -> Iterator[PrefixClock]:
    """Time the ``encode_prefix`` calls of ``model``'s flow policy while inside (a clock that stays at zero
    calls when the model has none)."""
    clock = PrefixClock()
    policy = flow_policy_of(model)
    if policy is None:
        yield clock
        return
    own = vars(policy).get("encode_prefix")  # an instance attribute of its own, restored after
    inner: Callable[..., Any] = policy.encode_prefix

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            prefix = inner(*args, **kwargs)
            clock.last = (args[0] if args else kwargs.get("obs"), prefix)
            return prefix
        finally:
            clock.ns += time.perf_counter_ns() - t0
            clock.calls += 1

    object.__setattr__(policy, "encode_prefix", timed)
    try:
        yield clock
    finally:
        if own is None:
            object.__delattr__(policy, "encode_prefix")
        else:
            object.__setattr__(policy, "encode_prefix", own)

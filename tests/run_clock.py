"""Check that a resumed trainer reports the whole run's wall time (vla_rl.train.common.RunClock).

The preempted part of a tiny test run takes well under a second, too little to tell "earlier plus this
process" from "this process alone". So the preempted run's train state is rewritten as if its processes
had already spent ``EARLIER`` seconds; the resumed run must then report more than that, and no more than
that plus its own call's wall time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from vla_rl.train.base import TrainResult
from vla_rl.train.common import load_train_state, save_train_state

EARLIER = 1000.0


def resume_after_earlier_seconds[R: TrainResult](state_path: Path, resume: Callable[[], R]) -> R:
    """Pretend the run at ``state_path`` already took ``EARLIER`` seconds, call ``resume`` and check the
    seconds it reports and saves carry them on."""
    st = load_train_state(state_path)
    assert float(st["seconds"]) > 0, "the preempted run saved its own wall time"
    st["seconds"] = EARLIER
    save_train_state(state_path, **st)
    t = time.perf_counter()
    result = resume()
    call = time.perf_counter() - t
    reported = result.seconds
    assert EARLIER < reported <= EARLIER + call, (reported, call)
    assert EARLIER < float(load_train_state(state_path)["seconds"]) <= reported
    return result

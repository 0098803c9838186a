"""bench/common.py: the pieces every bench shares (the load sampler)."""

from __future__ import annotations

import time

import pytest

from bench.common import LoadSampler


def test_the_load_sampler_takes_samples_while_a_run_goes_on() -> None:
    with LoadSampler(every_s=0.01) as load:
        deadline = time.monotonic() + 5
        while len(load.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    s = load.summary()
    assert s["samples"] >= 4 and 0 <= s["min"] <= s["mean"] <= s["max"]  # 3 in the loop, 1 at the end
    assert LoadSampler().summary() == {"min": None, "mean": None, "max": None, "samples": 0}
    with pytest.raises(ValueError, match="every_s"):
        LoadSampler(every_s=0)

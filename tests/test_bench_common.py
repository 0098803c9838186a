"""bench/common.py: the pieces every bench shares (the load sampler)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from bench.common import LoadSampler, loadavg

BENCH = Path(__file__).resolve().parents[1] / "bench"
SAMPLED = [
    "collect",
    "collect_stages",
    "compile",
    "dashboard",
    "loop",
    "replicas",
    "store_speed",
    "train_ddp",
]
"""The benches that record their run's load (bench/serve.py keeps its own ``loadavg`` for now)."""


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


def test_loadavg_is_the_rounded_1_5_15_minute_triple() -> None:
    load = loadavg()
    assert len(load) == 3 and all(x >= 0 and round(x, 2) == x for x in load)


def test_every_bench_reads_the_load_through_bench_common() -> None:
    """One way to read the machine's load: no bench calls os.getloadavg itself (bench/common.py
    aside), and each bench that records it writes the sampler's summary as ``load``."""
    ad_hoc = [p.name for p in BENCH.glob("*.py") if p.name != "common.py" and "getloadavg" in p.read_text()]
    assert ad_hoc == []
    for name in SAMPLED:
        src = (BENCH / f"{name}.py").read_text()
        assert "LoadSampler()" in src and re.search(r'"load"(: |\] = )load\b', src), name

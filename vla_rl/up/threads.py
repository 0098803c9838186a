"""How many torch threads ``vla-rl up`` gives the base's and the rounds' training: the cores idle now."""

from __future__ import annotations

import os
import time


def training_threads(sample_s: float = 0.5) -> int:
    """Torch threads for the base's or a round's training: the cores idle right now (sampled over
    ``sample_s``), at least 1, at most 4. In the batch loop the fleet is idle while a round trains (it collects
    its batch before the round is queued), so on a machine of its own training takes every core; with
    --continuous the sample sees the fleet's share taken; on a busy machine
    more threads than free cores is far slower than one (each op waits for a descheduled sibling thread;
    docs/benchmarks.md has both measured), hence the sample. The cap keeps a small policy from spreading
    over a big machine's cores."""
    cores = os.cpu_count() or 1
    try:
        first = _cpu_times()
        time.sleep(sample_s)
        second = _cpu_times()
    except OSError:  # no /proc/stat (not Linux): the safe choice
        return 1
    return threads_for(first, second, cores)


def threads_for(first: tuple[int, int], second: tuple[int, int], cores: int, cap: int = 4) -> int:
    """Threads for the cores that were idle between two (all, idle) CPU-time samples: ``idle / all *
    cores`` rounded down (a core 75% free counts), at least 1, at most ``min(cap, cores)``."""
    total, idle = second[0] - first[0], second[1] - first[1]
    free = idle / total * cores if total > 0 else 0.0
    return max(1, min(cap, cores, int(free + 0.25)))


def _cpu_times() -> tuple[int, int]:
    """(all, idle + iowait) jiffies over every core since boot, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]  # user nice system idle iowait irq softirq steal

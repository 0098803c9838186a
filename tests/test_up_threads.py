"""How many torch threads `up` gives the base's and the rounds' training: the cores idle right now."""

from __future__ import annotations

import os

from vla_rl.up.threads import threads_for, training_threads


def test_threads_follow_the_idle_cores_between_two_samples() -> None:
    # (all, idle) jiffies: 2 cores, 1000 jiffies of wall over both between the samples
    assert threads_for((0, 0), (1000, 1000), cores=2) == 2  # both idle
    assert threads_for((0, 0), (1000, 400), cores=2) == 1  # 0.8 of a core free: one thread
    assert threads_for((0, 0), (1000, 0), cores=2) == 1  # all busy: still one
    assert threads_for((0, 0), (1000, 380), cores=2) == 1
    assert threads_for((0, 0), (1600, 1600), cores=16) == 4  # capped: a small policy on a big box
    assert threads_for((5, 5), (5, 5), cores=2) == 1  # no time passed: the safe choice


def test_the_sample_on_this_machine_is_within_bounds() -> None:
    n = training_threads(sample_s=0.05)
    assert 1 <= n <= min(4, os.cpu_count() or 1)

"""Episode-seed ranges: every use of a simulator draws its initial states from its own range, so no
training episode ever starts from a state that an evaluation scores.

A simulator episode is fixed by its seed (cube pose, goal, ...). An online trainer that collects
episode ``s`` and an evaluation that later scores episode ``s`` would test the policy on an initial
state it trained on: a small policy fine-tuned for thousands of updates on a few hundred episodes can
memorise them. The ranges:

==============================  ==============================  =========================================
use                             first seed                      where
==============================  ==============================  =========================================
scripted demonstrations         0 (benchmarks: 10,000 a seed)   ``vla-rl demo``, ``bench/*``
base rollouts (fleet data)      50,000 (+10,000 a seed)         ``bench/rl.py``, ``bench/divl_fql.py``
evaluation                      :data:`EVAL` = 100,000          ``vla-rl eval``, rounds' promotion gate
held-out benchmark finals       200,000                         ``bench/* --eval-seed 200000``: no setting
                                                                is ever chosen on these
probes, calibration             300,000                         settings are chosen on these
SFT base selection              400,000                         ``bench/rl.py --base-band`` picks the base
                                                                checkpoint on these (:data:`BASE_SELECTION`)
rounds' reported success        :data:`REPORT` = 500,000        a promoted round's checkpoint, scored on
                                                                seeds its promotion gate never saw
online training                 :data:`ONLINE` = 1,000,000 up   awr-pi, QAM online, PPO, ``vla-rl up``'s
                                                                simulated fleet
==============================  ==============================  =========================================

Trainers that collect online say which seeds they may use (``collection_seeds()``), and the
benchmarks check them against their evaluation with :func:`check_disjoint`.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BASE_SELECTION", "EVAL", "ONLINE", "REPORT", "SeedOverlapError", "check_disjoint"]

EVAL = 100_000
"""First seed of evaluations (and of the rounds' promotion gate)."""
ONLINE = 1_000_000
"""First seed of online training collection; every evaluation range must stay below it."""
BASE_SELECTION = 400_000
"""First seed of the episodes a benchmark scores SFT checkpoints on to pick a base inside a success band."""
REPORT = 500_000
"""First seed of the success a promoted round reports (never the gate's seeds, which chose it)."""


class SeedOverlapError(ValueError):
    """An evaluation would score episodes a training run collected from."""


def check_disjoint(evaluation: range, training: Mapping[str, range]) -> None:
    """Raise :class:`SeedOverlapError` when the evaluation's seeds meet any training run's collection
    seeds (the message names the run and both ranges, and says how to fix it)."""
    for name, seeds in training.items():
        lo, hi = max(evaluation.start, seeds.start), min(evaluation.stop, seeds.stop)
        if lo < hi:
            raise SeedOverlapError(
                f"eval seeds {evaluation.start}..{evaluation.stop - 1} overlap the training episodes of {name} "
                f"(seeds {seeds.start}..{seeds.stop - 1}): the evaluation would score initial states the "
                f"policy trained on; pick evaluation seeds outside that range (held-out finals use 200000, "
                f"probes 300000; online training starts at {ONLINE})"
            )

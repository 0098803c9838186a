"""``vla-rl up``: the whole improvement loop on one machine, supervised.

It starts, on loopback, the embedded Hub registry, a policy server following ``prod``, the fleet collector,
a round worker and, where this install has ``vla-rl dashboard``, the dashboard (each its own ``vla-rl``
process, restarted if it dies; the loop goes on without the dashboard if it cannot run), seeds a
deliberately weak base policy (SFT on a few noisy demos; cached), publishes it as ``prod``, and loops:

    the simulated fleet (robots + a simulated operator) collects under prod
      -> a round is queued (the trigger: every ``episodes`` episodes per robot)
      -> the worker trains on the fleet's data, evaluates candidate vs base on fixed held-out seeds,
         pushes round-N and moves prod if it is better
      -> the server swaps live; the fleet carries on under the new commit

and prints one row per round, then the fleet's activity per round and overall (successful episodes per
wall-clock hour, robot utilisation, interventions per robot-hour: :mod:`vla_rl.up.activity`).

That is the batch loop (``--no-continuous``): the fleet is idle while a round trains. With ``--continuous``
(the default on a machine with 4 or more cores) the fleet never stops: it keeps working under ``prod``
while a round trains on a snapshot of the episodes closed when it was queued, the next round triggers on
the episodes closed after that snapshot, rounds never overlap, and a promotion reaches each robot at its
next action chunk (:mod:`vla_rl.up.continuous`); each round's process runs at ``--trainer-nice``.

Running it again in the same workdir resumes (same store, DB, registry,
next round number). Ctrl-C (or SIGTERM) stops every process within seconds, in order (the fleet and the
worker, then the policy server and the collector, the registry last); nothing acknowledged is lost (the
collector's write-ahead log holds it). Should ``up`` itself be killed outright, its children stop by
themselves (:mod:`vla_rl.core.lifeline`).

Layout of ``workdir``: ``hub/`` (registry data), ``store/`` (episodes + metadata DB), ``base/`` (demos'
SFT run), ``rounds/round-N/`` (training runs), ``logs/*.log`` (one per process), ``up.json`` (ports,
repo, seed), ``secrets/`` (tokens, mode 0600; handed to children through the environment; ``dashboard``
is the dashboard's operator token).

A round that fails (its training raises, its data selection is empty, ...) is recorded in the DB as
failed with the error, ``prod`` stays where it was, its row says so, and the loop goes on with the next
round; ``vla-rl up`` then exits 1.

The package splits it by job: ``config`` (:class:`UpConfig`, the flags), ``loop`` (:func:`run_up`),
``children`` (each service child's config, command line and stop order), ``workdir`` (ports, tokens, the
metadata DB's URL), ``base`` (seeding the weak base), ``threads`` (training's thread count), ``report``
(the fleet's summary per round, the table), ``continuous`` (the snapshot and the trigger of
``--continuous``), ``activity`` (the fleet's activity per window). The processes are run by the generic
:class:`vla_rl.core.supervisor.Supervisor`. Import from here: ``from vla_rl.up import UpConfig, run_up``.
"""

from vla_rl.up.config import UpConfig
from vla_rl.up.loop import run_up

__all__ = ["UpConfig", "run_up"]

"""``vla-rl up --continuous``: the fleet never stops. It runs as one long-lived supervised service under
``prod`` (restarted if it dies) instead of a batch per round, and the loop only decides when a round starts
and what it trains on:

* **the trigger**: a round is queued once the fleet closed ``robots x episodes`` episodes after the previous
  round's snapshot (:func:`new_episodes`, :func:`wait_for_trigger`); rounds never overlap (the loop waits
  for each before it counts for the next), so episodes closed while a round trained count for the next;
* **the snapshot**: the round's data selection is narrowed to the episodes closed at the moment it was
  queued (``closed_until``, :func:`snapshot_data`): an episode still running then, or started later, is in
  no way part of it, however long the worker takes to select;
* **the swap**: a promoted round moves ``prod``; the policy server, following it, swaps between two
  batches (every reply names the commit that produced it) and a robot executes a chunk to its end before
  asking again, so the new commit reaches each robot at its next chunk, mid-episode, and every frame
  records the commit that produced its action.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.db import MetadataDB, RoundRecord

FOREVER_EPISODES = 99_999
"""Episodes per robot of the continuous fleet (it is stopped long before): robot i's j-th episode seed is
``seed + i * 100000 + j``, so no two robots share a seed."""


def snapshot_data(data: str | None, at: float) -> str:
    """A round's data selection text: ``data`` (``--data``; None = every episode of the task) narrowed to
    the episodes closed at or before ``at`` (unix seconds)."""
    return ",".join(filter(None, [data, f"closed_until={at!r}"]))


def snapshot_of(rec: RoundRecord) -> float:
    """Round ``rec``'s snapshot: the ``closed_until`` of its data selection, or (a batch round, queued
    once its fleet batch closed) the time it was queued."""
    from fleet.selection import Selection

    data = (rec.config.get("train") or {}).get("data")
    try:
        closed_until = Selection.parse(data).closed_until
    except ValueError:  # a round queued by an older version with another grammar
        closed_until = None
    return rec.created_at if closed_until is None else closed_until


def last_snapshot(db: MetadataDB) -> float:
    """The snapshot of the workdir's last round (0: none yet, every fleet episode is new)."""
    rounds = db.rounds()
    return max((snapshot_of(r) for r in rounds), default=0.0)


def after(t: float) -> float:
    """The first time after ``t``: ``closed_since`` is inclusive, and an episode closed at a snapshot's
    exact time belongs to that snapshot."""
    return math.nextafter(t, math.inf)


def new_episodes(db: MetadataDB, since: float, robot_prefix: str) -> int:
    """Closed episodes of robots ``robot_prefix-*`` closed after ``since`` (a snapshot)."""
    from fleet.selection import Selection

    return len(db.select_ids(Selection(robots=(f"{robot_prefix}-*",), closed_since=after(since))))


def wait_for_trigger(
    db: MetadataDB,
    since: float,
    needed: int,
    robot_prefix: str,
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
    poll_s: float = 1.0,
) -> float:
    """Wait until robots ``robot_prefix-*`` closed ``needed`` episodes after the snapshot ``since``; the
    time it happened (the next round's snapshot). ``check`` runs every poll (the supervisor's: a fleet
    that keeps dying raises from it); RuntimeError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        check()
        now = time.time()
        have = new_episodes(db, since, robot_prefix)
        if have >= needed:
            return now
        if time.monotonic() >= end:
            raise RuntimeError(
                f"the fleet closed {have} of the {needed} new episodes a round needs in {timeout_s:.0f} s; "
                "see the fleet's log"
            )
        time.sleep(poll_s)

"""A canary: a share of the live fleet runs the candidate (the ``canary`` ref) while the rest runs ``prod``,
and the fleet's own outcomes decide whether the candidate is promoted or rolled back.

The pieces: the policy server serves both refs as two model ids, each following its ref (``vla-rl serve
--canary REF``); a share of the robots asks for the ``canary`` model (``sim fleet_runner``'s
``canary_share``); every episode records which checkpoint revision acted in it (metadata DB); and
:func:`check_canary` counts the closed episodes each revision acted in alone since the canary started,
decides (:func:`decide_canary`) and moves the refs.

The decision. The two arms meet different episodes, so the outcomes are unpaired: Fisher's exact
one-sided test (:func:`vla_rl.gate_stats.fisher_one_sided`) on *autonomous* successes (a success with no
operator takeover: the operator helps both arms, and a helped success says little about the policy).
It is a fixed-sample design, so ``alpha`` is the false-promotion rate: nothing is promoted before both arms
have ``episodes`` closed episodes, and then once, promote iff ``p(canary better) <= alpha``, else roll
back. Looking earlier only for harm is safe (a rollback never promotes noise): as soon as the canary is
worse than ``prod`` at ``alpha`` it is rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from vla_rl_client.meta import EpisodeRecord, SegmentKind

from fleet.db import MetadataDB
from fleet.selection import Selection
from vla_rl.gate_stats import fisher_one_sided
from vla_rl.hub.registry import move_ref, resolve

__all__ = ["ArmCounts", "CanaryDecision", "arm_counts", "canary_since", "check_canary", "decide_canary"]


@dataclass(frozen=True)
class ArmCounts:
    """One arm of the canary: closed episodes its revision acted in alone, and how many succeeded with no
    operator takeover."""

    revision: str
    episodes: int
    successes: int

    @property
    def rate(self) -> float | None:
        return self.successes / self.episodes if self.episodes else None


@dataclass(frozen=True)
class CanaryDecision:
    """``promote`` (move prod to the canary's commit), ``rollback`` (move canary back to prod's) or
    ``wait`` (not enough episodes yet), with both arms, both one-sided p-values and why."""

    action: Literal["promote", "rollback", "wait"]
    canary: ArmCounts
    prod: ArmCounts
    p_better: float
    """One-sided Fisher p-value of "the canary is no better than prod"."""
    p_worse: float
    """One-sided Fisher p-value of "the canary is no worse than prod"."""
    alpha: float
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arm_counts(records: Iterable[EpisodeRecord], revision: str) -> ArmCounts:
    """Closed episodes in which ``revision`` and no other checkpoint acted (a live swap mid-episode mixes
    two arms: left out; the empty revision of the operator's frames does not count), and their autonomous
    successes."""
    n = wins = 0
    for r in records:
        if set(r.revisions) - {""} != {revision} or r.success is None:
            continue
        n += 1
        wins += bool(r.success) and not any(s.kind == SegmentKind.INTERVENTION for s in r.segments)
    return ArmCounts(revision, n, wins)


def _check_knobs(alpha: float, episodes: int) -> None:
    """The decision's knobs, each refused naming itself."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha: expected a false-promotion rate in (0, 1], got {alpha}")
    if episodes < 1:
        raise ValueError(f"episodes: expected at least 1 episode an arm before deciding, got {episodes}")


def decide_canary(
    canary: ArmCounts, prod: ArmCounts, *, alpha: float = 0.05, episodes: int = 100
) -> CanaryDecision:
    """The canary's verdict (module docstring): roll back as soon as the canary is worse at ``alpha``;
    otherwise wait until both arms have ``episodes`` episodes, then promote iff it is better at ``alpha``,
    else roll back."""
    _check_knobs(alpha, episodes)
    p_better = fisher_one_sided(canary.successes, canary.episodes, prod.successes, prod.episodes)
    p_worse = fisher_one_sided(prod.successes, prod.episodes, canary.successes, canary.episodes)
    score = (
        f"canary {canary.successes}/{canary.episodes} vs prod {prod.successes}/{prod.episodes} autonomous "
        f"successes (one-sided Fisher p {p_better:.3g} better, {p_worse:.3g} worse; alpha {alpha:g})"
    )
    action: Literal["promote", "rollback", "wait"]
    if p_worse <= alpha:
        action, why = "rollback", f"worse than prod: {score}"
    elif min(canary.episodes, prod.episodes) < episodes:
        action, why = "wait", f"{episodes} episodes an arm needed: {score}"
    elif p_better <= alpha:
        action, why = "promote", f"better than prod: {score}"
    else:
        action, why = "rollback", f"not shown better in {episodes} episodes an arm: {score}"
    return CanaryDecision(action, canary, prod, p_better, p_worse, alpha, why)


def canary_since(db: MetadataDB, revision: str) -> float | None:
    """When the canary started: the end of the latest round that pushed ``revision`` (a round run with
    ``--promote-ref canary`` moves the canary there when its gate passes); None if no round did."""
    ends = [r.finished_at for r in db.rounds() if r.checkpoint_revision == revision and r.finished_at]
    return max(ends) if ends else None


def check_canary(
    db: MetadataDB,
    repo: str,
    *,
    since: float | None = None,
    task: str | None = None,
    alpha: float = 0.05,
    episodes: int = 100,
    canary_ref: str = "canary",
    prod_ref: str = "prod",
) -> CanaryDecision:
    """Decide on the canary of ``repo`` from the fleet's closed episodes since ``since`` and act on it:
    promote moves ``prod_ref`` to the canary's commit, rollback moves ``canary_ref`` back to prod's (robots
    following it return to prod's checkpoint), wait moves nothing. ``since`` defaults to
    :func:`canary_since`. A canary already at prod's commit is nothing to decide (ValueError). The knobs are
    checked before the Hub is asked anything."""
    _check_knobs(alpha, episodes)
    canary_rev, prod_rev = resolve(f"hub://{repo}@{canary_ref}"), resolve(f"hub://{repo}@{prod_ref}")
    if canary_rev == prod_rev:
        raise ValueError(f"{canary_ref}: at {prod_ref}'s commit {prod_rev[:12]}: no candidate on the canary")
    since = since if since is not None else canary_since(db, canary_rev)
    if since is None:
        raise ValueError(
            f"since: no round pushed {canary_ref}'s commit {canary_rev[:12]}; say when it started"
        )
    records = db.select_records(Selection(task=task, revisions=(canary_rev, prod_rev), since=since))
    decision = decide_canary(
        arm_counts(records, canary_rev), arm_counts(records, prod_rev), alpha=alpha, episodes=episodes
    )
    if decision.action == "promote":
        move_ref(repo, prod_ref, canary_rev)
    elif decision.action == "rollback":
        move_ref(repo, canary_ref, prod_rev)
    return decision

"""Post-training rounds: select data -> train -> evaluate against the base -> push -> promote if better.

One round is one call of :func:`start_round` (the CLI's ``vla-rl round start`` and, later, the dashboard
call the same function). Every round is a row in the metadata DB's ``rounds`` table from the moment it
starts: its config, the data it trained on, its metrics, the checkpoint it pushed and whether it was
promoted, or the error that stopped it.

Promotion gate: the new checkpoint and the base are evaluated in simulation on the *same* seeds; the
served ref (``promote_ref``, e.g. ``prod``) moves to the new commit only if its success rate beats
the base's by more than ``margin``. Servers following that ref pick the new checkpoint up by
themselves (see ``vla-rl serve --follow``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from fleet.db import MetadataDB, RoundRecord, default_url
from vla_rl.checkpoint import load_checkpoint, save_checkpoint
from vla_rl.evaluation import evaluate
from vla_rl.hub.registry import is_hub_ref, move_ref, parse_ref, push_folder
from vla_rl.policy_loading import load_policy
from vla_rl.train.algorithms import train
from vla_rl.train.base import TrainerConfig
from vla_rl.train.transitions import DataSelection

log = logging.getLogger(__name__)

__all__ = ["RoundConfig", "RoundError", "RoundOptions", "start_round"]


class RoundError(RuntimeError):
    """A round could not run (bad config, missing data); the DB row says why."""


@dataclass(kw_only=True)
class RoundOptions:
    """What a round does around training: where it pushes, and the gate that decides promotion."""

    repo: str | None = None
    """Hub repo to push to; default: the base ref's repo (a local base needs one, or --no-push)."""
    push: bool = True
    """Push the candidate as ``round-N`` (and move ``promote_ref`` when the gate passes)."""
    promote_ref: str = "prod"
    """The ref servers follow; moved to the new commit when the gate passes."""
    margin: float = 0.0
    """Promote only if new success rate - base success rate > margin (a fraction, 0.05 = 5 points)."""
    eval_episodes: int = 50
    """Held-out simulated episodes for the candidate and the base (the same seeds)."""
    eval_seed: int = 100_000
    """First episode seed of the evaluation."""
    eval_envs: int = 2
    """Simulator processes for the evaluation."""


@dataclass(kw_only=True)
class RoundConfig(RoundOptions):
    """One post-training round: an algorithm's config plus what the round does around it.

    The base checkpoint, the store, the data selection, the seed and every algorithm knob live in
    ``train`` (any :class:`~vla_rl.train.base.TrainerConfig`, e.g. from ``make_config`` or
    ``preset_config``). Round N trains in ``<train.out>/round-N``.
    """

    train: TrainerConfig
    """What to train: e.g. ``make_config("awr", base="hub://org/arm@prod", store=..., out=...)``."""
    preset: str | None = None
    """The named preset the train config came from, recorded with the round (informational)."""

    def __post_init__(self) -> None:
        t = self.train
        if not t.base:
            raise ValueError("base: a round improves and is compared against a base checkpoint (--base REF)")
        if t.store is None:
            raise ValueError("store: a round records itself in the store's metadata DB (--store PATH)")
        if self.eval_episodes < 1 or self.eval_envs < 1:
            raise ValueError("eval_episodes and eval_envs: expected positive integers")
        if not -1.0 < self.margin < 1.0:
            raise ValueError(f"margin: expected a fraction in (-1, 1), got {self.margin}")
        if self.push and self.repo is None and not is_hub_ref(t.base):
            raise ValueError(
                "repo: the base is a local folder, so say where to push (--repo org/name) or use --no-push"
            )

    @property
    def algo(self) -> str:
        return self.train.algorithm


def _known_base_score(db: MetadataDB, base: Any, task: str, cfg: RoundConfig) -> dict[str, Any] | None:
    """The base's success on exactly these eval seeds, if already measured: by the round that produced
    it (recorded in its config.json) or by an earlier round that compared against the same commit.
    Evaluation is deterministic given the seeds, so re-running it would only cost time."""
    m = base.info.metrics
    if (
        m.get("eval_seed") == cfg.eval_seed
        and m.get("eval_episodes") == cfg.eval_episodes
        and "success_rate" in m
    ):
        return {"success": m["success_rate"], "ci95": m.get("success_ci95"), "source": "checkpoint"}
    for r in reversed(db.rounds(task=task)):
        rm = r.metrics
        if (
            r.status == "succeeded"
            and r.base_revision == base.commit
            and rm.get("eval_seed") == cfg.eval_seed
            and rm.get("eval_episodes") == cfg.eval_episodes
        ):
            return {"success": rm["base_success"], "ci95": rm.get("base_ci95"), "source": f"round {r.id}"}
    return None


# ---------------------------------------------------------------------------- the round
def start_round(cfg: RoundConfig, db: MetadataDB | None = None) -> RoundRecord:
    """Run one round end to end; returns its final DB record (status succeeded, or raises after
    recording status failed with the error)."""
    t = cfg.train
    assert t.base is not None and t.store is not None  # checked by RoundConfig
    db = db or MetadataDB(t.db_url or default_url(t.store))
    config_json = json.loads(json.dumps({"algo": cfg.algo, **asdict(cfg)}, default=str))
    round_id = db.create_round(algo=cfg.algo, task=t.task or "", base_ref=t.base, config=config_json)
    log.info("round start", extra={"round": round_id, "algo": cfg.algo, "base": t.base})
    try:
        base = load_policy(t.base)
        task = t.task or base.info.robot_spec.name
        if task != base.info.robot_spec.name:
            raise RoundError(f"task: the base checkpoint is for {base.info.robot_spec.name!r}, not {task!r}")
        db.update_round(round_id, base_revision=base.commit, task=task)
        DataSelection.parse(task, t.data)  # a bad selection fails before any training
        run = dataclasses.replace(t, out=t.out / f"round-{round_id}", task=task, round_index=round_id)
        trained = train(run)
        db.update_round(round_id, data=json.loads(json.dumps(trained.data, default=str)))

        # evaluate base and candidate on the same seeds
        new = load_policy(trained.checkpoint)
        ev_kw = dict(
            episodes=cfg.eval_episodes, num_envs=cfg.eval_envs, seed=cfg.eval_seed, progress=t.progress
        )
        base_score = _known_base_score(db, base, task, cfg)
        if base_score is None:
            ev = evaluate(base, task, **ev_kw)  # type: ignore[arg-type]
            base_score = {"success": ev.success_rate, "ci95": list(ev.ci95), "source": "evaluated"}
        new_eval = evaluate(new, task, **ev_kw)  # type: ignore[arg-type]
        delta = new_eval.success_rate - base_score["success"]
        metrics = {
            "base_success": base_score["success"],
            "base_ci95": base_score["ci95"],
            "base_eval_source": base_score["source"],
            "success": new_eval.success_rate,
            "ci95": list(new_eval.ci95),
            "delta": delta,
            "eval_episodes": cfg.eval_episodes,
            "eval_seed": cfg.eval_seed,
            "train_seconds": round(trained.seconds, 1),
            "train": trained.metrics,
            "curve": trained.curve,
        }
        # record the evaluation in the checkpoint itself (config.json metrics + model card)
        info, weights = load_checkpoint(trained.checkpoint)
        eval_metrics = {
            "success_rate": new_eval.success_rate,
            "success_ci95": list(new_eval.ci95),
            "eval_episodes": cfg.eval_episodes,
            "eval_seed": cfg.eval_seed,
            "base_success_rate": base_score["success"],
            "round": round_id,
        }
        lineage = dataclasses.replace(info.lineage, round=round_id)
        save_checkpoint(
            trained.checkpoint,
            weights,
            dataclasses.replace(info, lineage=lineage, metrics={**info.metrics, **eval_metrics}),
        )

        checkpoint_ref, revision, promoted = str(trained.checkpoint), None, False
        gate = delta > cfg.margin
        if cfg.push:
            repo = cfg.repo or parse_ref(t.base).repo_id
            tag = f"round-{round_id}"
            revision = push_folder(
                trained.checkpoint, repo, message=f"round {round_id}: {cfg.algo} on {task}", tag=tag
            )
            checkpoint_ref = f"hub://{repo}@{tag}"
            if gate:
                move_ref(repo, cfg.promote_ref, revision)
                promoted = True
        metrics["gate"] = {
            "margin": cfg.margin,
            "passed": gate,
            "reason": (
                f"success {new_eval.success_rate:.0%} vs base {base_score['success']:.0%} "
                f"(delta {delta:+.0%}, needs > {cfg.margin:+.0%})"
            ),
        }
        record = db.update_round(
            round_id,
            status="succeeded",
            metrics=json.loads(json.dumps(metrics, default=float)),
            checkpoint_ref=checkpoint_ref,
            checkpoint_revision=revision,
            promoted=promoted,
            finished_at=time.time(),
        )
        log.info(
            "round done",
            extra={
                "round": round_id,
                "success": new_eval.success_rate,
                "base_success": base_score["success"],
                "promoted": promoted,
                "checkpoint": checkpoint_ref,
            },
        )
        return record
    except BaseException as e:
        db.update_round(
            round_id,
            status="failed",
            error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}",
            finished_at=time.time(),
        )
        log.error("round failed", extra={"round": round_id, "error": str(e)})
        raise

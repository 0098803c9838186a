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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fleet.db import MetadataDB, RoundRecord, default_url
from fleet.store import EpisodeStore
from vla_rl.checkpoint import load_checkpoint, save_checkpoint
from vla_rl.evaluation import evaluate
from vla_rl.hub.registry import is_hub_ref, move_ref, parse_ref, push_folder
from vla_rl.policy_loading import load_policy
from vla_rl.train.transitions import DataSelection, select_episode_ids

log = logging.getLogger(__name__)

ALGOS = ("sft", "awr", "recap", "qam", "flow-noise", "flow-sde")

__all__ = ["ALGOS", "RoundConfig", "RoundError", "TrainOutput", "parse_overrides", "start_round"]


class RoundError(RuntimeError):
    """A round could not run (bad config, missing data); the DB row says why."""


@dataclass
class RoundConfig:
    """One post-training round. ``overrides`` go to the algorithm's own config dataclass."""

    algo: str
    """One of ALGOS."""
    base: str
    """Checkpoint to improve and to compare against (hub://org/name@rev or a local folder)."""
    store: Path
    """Episode store the data comes from (and where online algorithms find the task's demos)."""
    data: str | None = None
    """Data selection text (see DataSelection): e.g. "robot=arm-1|arm-2,since=2026-11-01,label.ok=true"."""
    task: str | None = None
    """Task id; default: the base checkpoint's."""
    db_url: str | None = None
    """Metadata DB; default: the SQLite file next to the store."""
    out: Path = Path("runs/rounds")
    """Work folder; round N writes to <out>/round-N/."""
    repo: str | None = None
    """Hub repo to push to; default: the base ref's repo (a local base needs one, or push=False)."""
    push: bool = True
    promote_ref: str = "prod"
    """The ref servers follow; moved to the new commit when the gate passes."""
    margin: float = 0.0
    """Promote only if new success rate - base success rate > margin (a fraction, 0.05 = 5 points)."""
    eval_episodes: int = 50
    eval_seed: int = 100_000
    eval_envs: int = 2
    overrides: dict[str, Any] = field(default_factory=dict)
    """Algorithm hyper-parameters, e.g. {"steps": 500, "beta": 0.5}."""
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        self.store, self.out = Path(self.store), Path(self.out)
        if self.algo not in ALGOS:
            raise ValueError(f"algo: expected one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.eval_episodes < 1 or self.eval_envs < 1:
            raise ValueError("eval_episodes and eval_envs: expected positive integers")
        if not -1.0 < self.margin < 1.0:
            raise ValueError(f"margin: expected a fraction in (-1, 1), got {self.margin}")
        if self.push and self.repo is None and not is_hub_ref(self.base):
            raise ValueError(
                "repo: the base is a local folder, so say where to push (--repo org/name) or use --no-push"
            )


@dataclass
class TrainOutput:
    """What every algorithm hands back to the round."""

    checkpoint: Path
    seconds: float
    metrics: dict[str, Any]
    data: dict[str, Any]
    curve: list[dict[str, Any]]


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["steps=500", "beta=0.5", "value=expectile"]`` -> typed dict (JSON values, else strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set: expected key=value, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _build(config_cls: type, overrides: Mapping[str, Any], **required: Any) -> Any:
    names = {f.name for f in fields(config_cls)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(
            f"--set: unknown {config_cls.__name__} fields {sorted(unknown)}; expected some of {sorted(names)}"
        )
    clash = set(overrides) & set(required)
    if clash:
        raise ValueError(f"--set: {sorted(clash)} are set by the round itself")
    return config_cls(**required, **overrides)


# ---------------------------------------------------------------------------- algorithms
def _run_sft(cfg: RoundConfig, sel: DataSelection, out: Path, round_id: int) -> TrainOutput:
    """SFT from scratch on the selected episodes (e.g. successes only: ``--data success=true``)."""
    from vla_rl.train.sft import SFTConfig, train_sft

    store = cfg.store
    db = MetadataDB(cfg.db_url or default_url(store))
    ids = select_episode_ids(EpisodeStore(store), sel, db=db, round_revisions=db.round_revisions())
    c = _build(
        SFTConfig,
        cfg.overrides,
        task=sel.task,
        store=store,
        out=out,
        episode_ids=ids,
        seed=cfg.seed,
        progress=cfg.progress,
    )
    r = train_sft(c)
    return TrainOutput(
        r.checkpoint, r.seconds, {"final_loss": r.final_loss}, {"selection": sel.to_dict(), **r.dataset}, []
    )


def _run_awr(cfg: RoundConfig, sel: DataSelection, out: Path, round_id: int) -> TrainOutput:
    from vla_rl.train.awr import AWRConfig, train_awr

    c = _build(
        AWRConfig,
        cfg.overrides,
        base=cfg.base,
        store=cfg.store,
        out=out,
        selection=sel,
        db_url=cfg.db_url,
        variant=cfg.algo,
        seed=cfg.seed,
        progress=cfg.progress,
        round_index=round_id,
    )
    r = train_awr(c)
    return TrainOutput(r.checkpoint, r.seconds, r.metrics, r.data, r.curve)


def _run_qam(cfg: RoundConfig, sel: DataSelection, out: Path, round_id: int) -> TrainOutput:
    """QAM offline (``--set env_steps=0``, the default) or offline-to-online (``--set env_steps=N``)."""
    from vla_rl.train.qam import QAMConfig, train_qam

    c = _build(
        QAMConfig,
        cfg.overrides,
        base=cfg.base,
        store=cfg.store,
        out=out,
        task=sel.task,
        data=cfg.data,
        seed=cfg.seed,
        progress=cfg.progress,
    )
    r = train_qam(c)
    return TrainOutput(
        r.checkpoint, r.seconds, r.metrics, {"selection": sel.to_dict(), "env_steps": r.env_steps}, r.curve
    )


def _run_ppo(cfg: RoundConfig, sel: DataSelection, out: Path, round_id: int) -> TrainOutput:
    """Flow-Noise / Flow-SDE PPO: online in simulation (the store's data is not used)."""
    from vla_rl.train.ppo import PPOConfig, train_ppo

    c = _build(
        PPOConfig,
        cfg.overrides,
        base=cfg.base,
        out=out,
        task=sel.task,
        method="noise" if cfg.algo == "flow-noise" else "sde",
        seed=cfg.seed,
        progress=cfg.progress,
        round_index=round_id,
    )
    r = train_ppo(c)
    return TrainOutput(
        r.checkpoint, r.seconds, r.metrics, {"env_steps": r.env_steps, "episodes": r.episodes}, r.curve
    )


_TRAINERS: dict[str, Callable[[RoundConfig, DataSelection, Path, int], TrainOutput]] = {
    "sft": _run_sft,
    "awr": _run_awr,
    "recap": _run_awr,
    "qam": _run_qam,
    "flow-noise": _run_ppo,
    "flow-sde": _run_ppo,
}


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
    db = db or MetadataDB(cfg.db_url or default_url(cfg.store))
    config_json = json.loads(json.dumps(asdict(cfg), default=str))
    round_id = db.create_round(algo=cfg.algo, task=cfg.task or "", base_ref=cfg.base, config=config_json)
    out = cfg.out / f"round-{round_id}"
    log.info("round start", extra={"round": round_id, "algo": cfg.algo, "base": cfg.base})
    try:
        base = load_policy(cfg.base)
        task = cfg.task or base.info.robot_spec.name
        if task != base.info.robot_spec.name:
            raise RoundError(f"task: the base checkpoint is for {base.info.robot_spec.name!r}, not {task!r}")
        db.update_round(round_id, base_revision=base.commit, task=task)
        sel = DataSelection.parse(task, cfg.data)
        trainer = _TRAINERS.get(cfg.algo)
        if trainer is None:
            raise RoundError(f"algo: {cfg.algo!r} is not available in this build")
        trained = trainer(cfg, sel, out, round_id)
        db.update_round(round_id, data=json.loads(json.dumps(trained.data, default=str)))

        # evaluate base and candidate on the same seeds
        new = load_policy(trained.checkpoint)
        ev_kw = dict(
            episodes=cfg.eval_episodes, num_envs=cfg.eval_envs, seed=cfg.eval_seed, progress=cfg.progress
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
            repo = cfg.repo or parse_ref(cfg.base).repo_id
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

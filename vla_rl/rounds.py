"""Post-training rounds: select data -> train -> evaluate against the base -> push -> promote if better.

One round is one call of :func:`start_round` (the CLI's ``vla-rl round start`` and, later, the dashboard
call the same function). Every round is a row in the metadata DB's ``rounds`` table from the moment it
starts: its config, the data it trained on, its metrics, the checkpoint it pushed and whether it was
promoted, or the error that stopped it.

With ``failure_predictor`` the round also fits the learned failure predictor for its candidate on its
own data and pushes it inside the candidate's folder (:func:`fit_round_predictor`).

Promotion gate: the new checkpoint and the base are evaluated in simulation on the *same* seeds; the
served ref (``promote_ref``, e.g. ``prod``) moves to the new commit only if its success rate beats
the base's by more than ``margin``. Servers following that ref pick the new checkpoint up by
themselves (see ``vla-rl serve --follow``).

A task that is not a simulator task (real robot data, e.g. a LeRobot import) has no success rate: both
are then evaluated offline (:func:`vla_rl.evaluation_offline.evaluate_offline`) on the same held-out
episodes (:func:`round_data`). Where the store holds outcomes, the gate is on a success estimate learned
from them (:mod:`vla_rl.gate_success`: ``new - base > margin``); otherwise on the normalised action MSE
(:class:`GateResult`): ``base_mse - new_mse > margin * base_mse`` (``offline_gate`` picks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.db import MetadataDB, RoundLost, RoundRecord, default_url, worker_id
from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.lerobot_adapter import is_lerobot_folder
from policies.lerobot_sidecar import record_evaluation
from policies.loading import load_chunk_policy
from vla_rl.core.configs import check_values
from vla_rl.core.secrets import url_without_password
from vla_rl.core.seeds import EVAL, REPORT
from vla_rl.core.text import check_json_text
from vla_rl.evaluation import evaluate
from vla_rl.evaluation_offline import evaluate_offline, held_out_episodes, is_sim_task
from vla_rl.gate import (
    GateResult,
    OfflineGate,
    SimGate,
    check_report_seeds,
    decode_outcomes,
    encode_outcomes,
    gate_sentence,
    known_outcomes,
    report_success,
)
from vla_rl.gate_stats import paired_outcomes, sign_test
from vla_rl.gate_success import OFFLINE_GATES, fit_round_estimator, success_gate
from vla_rl.hub.checkpoint import load_checkpoint, save_checkpoint
from vla_rl.hub.naming import check_round_target
from vla_rl.hub.registry import is_hub_ref, move_ref, parse_ref, push_folder, resolve
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.base import TrainerConfig, reporting_progress
from vla_rl.train.failure import FailureFitConfig
from vla_rl.train.transitions import select_episode_ids

log = logging.getLogger(__name__)

__all__ = [
    "GateResult",
    "OfflineGate",
    "RoundConfig",
    "RoundData",
    "RoundError",
    "RoundOptions",
    "SimGate",
    "queue_round",
    "round_data",
    "run_round",
    "start_round",
]


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
    gate_alpha: float = 0.05
    """False-promotion rate of the gate's paired one-sided test (McNemar on the shared seeds; offline a
    sign test on the held-out episodes): promote only if, on top of the margin, the p-value of "the
    candidate is no better than the base" is <= this (1 = no test: the margin alone)."""
    eval_episodes: int = 50
    """Held-out simulated episodes for the candidate and the base (the same seeds)."""
    eval_seed: int = EVAL
    """First episode seed of the evaluation (below every online trainer's and the simulated fleet's
    episodes, :mod:`vla_rl.core.seeds`)."""
    eval_envs: int = 2
    """Simulator processes for the evaluation."""
    report_episodes: int = 20
    """Simulated episodes a promoted candidate is evaluated on again, on seeds the gate did not see: the
    success the round reports (0 = not measured)."""
    report_seed: int = REPORT
    """First seed of that report (its own range, :mod:`vla_rl.core.seeds`; never the gate's seeds)."""
    offline_gate: str = "auto"
    """Gate of a task with no simulator: ``success`` (a success estimate learned from the store's
    outcomes, :mod:`vla_rl.gate_success`; refused without outcome labels), ``action_mse``, or ``auto``
    (success where the training episodes hold successes and failures, else action MSE)."""
    failure_predictor: bool = False
    """Also fit the learned failure predictor (:mod:`vla_rl.train.failure`) for the candidate, on the
    round's own data (windows before takeovers and failed endings positive, successful autonomous stretches
    negative, the dashboard's labels folded in), and ship it inside the pushed folder (``failure/``, with
    its lineage): a server following the Hub serves its score from the swap on. A fleet whose data cannot
    calibrate one (too few held-out successes) gets the round without it; its metrics say why."""
    failure_hidden: tuple[int, ...] = FailureFitConfig.hidden
    """The predictor head's MLP widths (``vla-rl failure fit``'s default: a wide head saturates under the
    per-decision alarm)."""
    failure_steps: int = FailureFitConfig.steps
    """The predictor head's AdamW updates (``vla-rl failure fit``'s default)."""
    failure_alpha: float = 0.05
    """The predictor's target false-alarm rate on successful episodes (its conformal level)."""

    def __post_init__(self) -> None:
        self.failure_hidden = tuple(self.failure_hidden)
        check_values(self, _round_bounds)
        if self.offline_gate not in OFFLINE_GATES:
            raise ValueError(
                f"offline_gate: expected one of {list(OFFLINE_GATES)}, got {self.offline_gate!r}"
            )
        if not 0.0 < self.gate_alpha <= 1.0:
            raise ValueError(f"gate_alpha: expected a false-promotion rate in (0, 1], got {self.gate_alpha}")
        check_report_seeds(self.eval_seed, self.eval_episodes, self.report_seed, self.report_episodes)
        check_round_target(self.repo, self.promote_ref)


def _round_bounds(name: str) -> tuple[float, float] | None:
    return {
        "eval_episodes": (1, 100_000),
        "eval_envs": (1, 256),
        "eval_seed": (0, 2**31 - 1),
        "report_episodes": (0, 100_000),
        "report_seed": (0, 2**31 - 1),
        "failure_hidden": (1, 4096),
        "failure_steps": (1, 1_000_000),
        "failure_alpha": (1e-6, 1 - 1e-6),
    }.get(name)


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
        super().__post_init__()
        t = self.train
        if not t.base:
            raise ValueError("base: a round improves and is compared against a base checkpoint (--base REF)")
        if t.store is None:
            raise ValueError("store: a round records itself in the store's metadata DB (--store PATH)")
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
    """The base's success and per-seed outcomes on exactly these eval seeds, if already measured: by the
    round that produced it (recorded in its config.json) or by an earlier round that compared against the
    same commit. Evaluation is deterministic given the seeds, so re-running it would only cost time (a
    record without per-seed outcomes, from before the paired gate, is measured again)."""
    m, n = base.metrics, cfg.eval_episodes
    outcomes = known_outcomes(m, "eval_outcomes", n)
    if (
        m.get("eval_seed") == cfg.eval_seed
        and m.get("eval_episodes") == n
        and "success_rate" in m
        and outcomes
    ):
        return dict(
            success=m["success_rate"], ci95=m.get("success_ci95"), source="checkpoint", outcomes=outcomes
        )
    for r in reversed(db.rounds(task=task)):
        rm = r.metrics
        outcomes = known_outcomes(rm, "base_outcomes", n)
        if (
            r.status == "succeeded"
            and r.base_revision == base.commit
            and rm.get("eval_seed") == cfg.eval_seed
            and rm.get("eval_episodes") == n
            and outcomes
        ):
            found = dict(success=rm["base_success"], ci95=rm.get("base_ci95"), outcomes=outcomes)
            return {**found, "source": f"round {r.id}"}
    return None


@dataclass(frozen=True)
class RoundData:
    """What a round trains and evaluates on, computed once: one parse of its selection, one store open,
    one select (:func:`round_data`)."""

    selection: Selection
    store: EpisodeStore
    episode_ids: list[str]
    """The closed episodes the selection selects, oldest first."""
    held_out: list[str]
    """An offline round's evaluation episodes (the newest of the selection); empty in simulation."""

    @property
    def excludes_held_out(self) -> bool:
        """The held-out episodes are left out of training (unless they are all the selection holds)."""
        return bool(self.held_out) and len(self.held_out) < len(self.episode_ids)

    @property
    def training_ids(self) -> list[str]:
        """The episodes the round trains on: the selection less the held-out ones (unless that is all)."""
        held = set(self.held_out) if self.excludes_held_out else set()
        return [e for e in self.episode_ids if e not in held]

    def training_data(self, given: str | None) -> str | None:
        """The trainer's selection text: ``given``, with the held-out episodes added to its ``exclude``."""
        return self.selection.with_excluded(self.held_out).to_text() if self.excludes_held_out else given


def round_data(cfg: RoundConfig, db: MetadataDB, task: str) -> RoundData:
    """The round's data selection for ``task``, selected once; a bad or empty selection raises
    ValueError before anything trains. An offline round (no simulator for ``task``) holds out the most
    recent ``eval_episodes`` of it, but at most a fifth (at least one), so most of the selection remains
    what the round is mainly about."""
    assert cfg.train.store is not None
    selection = Selection.parse(cfg.train.data, task=task)
    store = EpisodeStore(cfg.train.store)
    ids = select_episode_ids(store, selection, db)
    held = [] if is_sim_task(task) else held_out_episodes(ids, min(cfg.eval_episodes, max(1, len(ids) // 5)))
    return RoundData(selection, store, ids, held)


def _sim_gate(
    cfg: RoundConfig, db: MetadataDB, base: Any, new: Any, task: str, progress: ProgressWriter | None = None
) -> SimGate:
    """Simulation: success rate of candidate and base on the same seeds; gate ``delta > margin``."""
    ev_kw = dict(
        episodes=cfg.eval_episodes, num_envs=cfg.eval_envs, seed=cfg.eval_seed, progress=cfg.train.progress
    )

    def evaluating(which: str) -> None:
        if progress is not None:
            progress.phase(
                "evaluating",
                evaluating=which,
                episodes_done=0,
                episodes_total=cfg.eval_episodes,
                eval_eta_s=None,
            )

    n, seed = cfg.eval_episodes, cfg.eval_seed
    base_score = _known_base_score(db, base, task, cfg)
    if base_score is None:
        evaluating("base")
        ev = evaluate(base, task, **ev_kw)  # type: ignore[arg-type]
        outcomes = encode_outcomes(ev.per_episode, seed, n)
        base_score = {
            "success": ev.success_rate,
            "ci95": list(ev.ci95),
            "source": "evaluated",
            "outcomes": outcomes,
        }
    evaluating("candidate")
    new_eval = evaluate(new, task, **ev_kw)  # type: ignore[arg-type]
    new_outcomes = encode_outcomes(new_eval.per_episode, seed, n)
    test = paired_outcomes(decode_outcomes(new_outcomes, seed), decode_outcomes(base_score["outcomes"], seed))
    delta = new_eval.success_rate - base_score["success"]
    why = (
        f"success {new_eval.success_rate:.0%} vs base {base_score['success']:.0%} "
        f"(delta {delta:+.0%}, needs > {cfg.margin:+.0%}); {gate_sentence(test, cfg.gate_alpha, 'seeds')}"
    )
    return SimGate(
        metric="success",
        candidate=new_eval.success_rate,
        base=base_score["success"],
        margin=cfg.margin,
        promote=delta > cfg.margin and test.passes(cfg.gate_alpha),
        why=why,
        alpha=cfg.gate_alpha,
        test=test,
        candidate_outcomes=new_outcomes,
        base_outcomes=base_score["outcomes"],
        candidate_ci95=new_eval.ci95,
        base_ci95=base_score["ci95"],
        base_source=base_score["source"],
        eval_episodes=cfg.eval_episodes,
        eval_seed=cfg.eval_seed,
    )


def _offline_gate(cfg: RoundConfig, db: MetadataDB, base: Any, new: Any, data: RoundData) -> OfflineGate:
    """No simulator for the task: action MSE (normalised, :func:`evaluate_offline`) of candidate and base
    on the same held-out episodes and frames; gate ``base_mse - new_mse > margin * base_mse`` and a
    one-sided sign test on the per-episode errors at ``gate_alpha``."""
    ids = data.held_out
    kw: dict[str, Any] = dict(seed=cfg.eval_seed, labels=db.current_labels(ids))
    base_ev = evaluate_offline(base, data.store, ids, **kw)
    new_ev = evaluate_offline(new, data.store, ids, **kw)
    b, n = base_ev.action_mse, new_ev.action_mse
    improvement = (b - n) / b if b > 0 else 0.0
    test = sign_test(new_ev.per_episode, base_ev.per_episode)
    why = (
        f"offline action MSE {n:.4f} vs base {b:.4f} on {len(ids)} held-out episodes "
        f"(relative improvement {improvement:+.1%}, needs > {cfg.margin:+.1%}; "
        f"no simulator for {data.selection.task}); {gate_sentence(test, cfg.gate_alpha, 'episodes')}"
    )
    return OfflineGate(
        metric="action_mse",
        candidate=n,
        base=b,
        margin=cfg.margin,
        promote=b - n > cfg.margin * b and test.passes(cfg.gate_alpha),
        why=why,
        alpha=cfg.gate_alpha,
        test=test,
        candidate_eval=new_ev,
        base_eval=base_ev,
        relative_improvement=improvement,
        eval_seed=cfg.eval_seed,
    )


def _no_sim_gate(cfg: RoundConfig, db: MetadataDB, base: Any, new: Any, data: RoundData) -> GateResult:
    """The gate of a task with no simulator, as ``offline_gate`` picks (:mod:`vla_rl.gate_success`)."""
    note = ""
    if cfg.offline_gate != "action_mse":
        try:
            estimator = fit_round_estimator(base, data.store, data.training_ids, db, seed=cfg.train.seed)
        except ValueError as e:
            if cfg.offline_gate == "success":
                raise RoundError(f"offline_gate success: {e}") from None
            note = f"; not on estimated success: {str(e).split(';')[0]}"
        else:
            kw = dict(margin=cfg.margin, alpha=cfg.gate_alpha, seed=cfg.eval_seed, task=data.selection.task)
            return success_gate(
                base, new, estimator=estimator, store=data.store, held_out=data.held_out, db=db, **kw
            )
    gate = _offline_gate(cfg, db, base, new, data)
    return dataclasses.replace(gate, why=gate.why + note) if note else gate


def _report(
    cfg: RoundConfig, new: Any, task: str, gate: GateResult, progress: ProgressWriter
) -> dict[str, Any]:
    """The success the round reports (:mod:`vla_rl.gate`): a candidate the gate promotes is evaluated
    again on ``report_episodes`` seeds from ``report_seed``, which the gate never saw; otherwise (or with
    ``report_episodes`` 0) ``reported_success`` is None: not measured."""
    if not (gate.promote and cfg.report_episodes):
        return {"reported_success": None, "report_episodes": 0}
    n = cfg.report_episodes
    progress.phase("evaluating", evaluating="report", episodes_done=0, episodes_total=n, eval_eta_s=None)
    kw = dict(episodes=n, seed=cfg.report_seed, num_envs=cfg.eval_envs, progress=cfg.train.progress)
    return report_success(new, task, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the round
def round_db(cfg: RoundConfig) -> MetadataDB:
    """The metadata DB a round is recorded in: the train config's ``db_url``, else the store's SQLite."""
    assert cfg.train.store is not None  # checked by RoundConfig
    return MetadataDB(cfg.train.db_url or default_url(cfg.train.store))


MAX_CONFIG_TEXT = 4096
"""Longest text one field of a round's stored config may hold (a selection text's bound; paths fit)."""


def config_to_json(cfg: RoundConfig) -> dict[str, Any]:
    """The round's row config: everything needed to run it again elsewhere (:func:`config_from_json`), and
    no secret: the metadata DB's URL is kept without its password (the worker runs the round against the DB
    it claimed it from, with its own credentials: :func:`training_db_url`). Every text in it is checked
    (:func:`vla_rl.core.text.check_json_text`: ValueError naming the field, e.g. ``config.train.data``)."""
    data = json.loads(json.dumps({"algo": cfg.algo, **asdict(cfg)}, default=str))
    if data["train"].get("db_url"):
        data["train"]["db_url"] = url_without_password(data["train"]["db_url"])
    return check_json_text(data, "config", max_chars=MAX_CONFIG_TEXT)


def training_db_url(stored: str | None, db: MetadataDB) -> str:
    """The metadata DB URL a round's trainer opens: the URL of ``db``, the DB the round runs in (with the
    credentials its worker opened it with), when the config names no DB or names that one without its
    password (as :func:`config_to_json` stores it); else the config's own."""
    if stored is None or url_without_password(stored) == url_without_password(db.url):
        return db.url
    return stored


def config_from_json(data: dict[str, Any]) -> RoundConfig:
    d = dict(data)
    algo, train_values = d.pop("algo"), d.pop("train")
    return RoundConfig(train=make_config(algo, **train_values), **d)


def queue_round(cfg: RoundConfig, db: MetadataDB | None = None) -> int:
    """Queue a round for a worker (``vla-rl round worker``); returns its number. The one call the CLI,
    the dashboard and ``vla-rl up`` use to ask for a round."""
    t = cfg.train
    assert t.base is not None
    db = db or round_db(cfg)
    round_id = db.create_round(algo=cfg.algo, task=t.task or "", base_ref=t.base, config=config_to_json(cfg))
    log.info("round queued", extra={"round": round_id, "algo": cfg.algo, "base": t.base})
    return round_id


def start_round(cfg: RoundConfig, db: MetadataDB | None = None, heartbeat_s: float = 5.0) -> RoundRecord:
    """Queue one round and run it here, now (``vla-rl round start``): returns its final DB record
    (succeeded), or raises after recording it as failed with the error. ``vla-rl round cancel N`` stops
    it at its next progress report after the next heartbeat (every ``heartbeat_s``): it raises
    :class:`RoundCancelled` with the round recorded as cancelled (never once it is pushing)."""
    db = db or round_db(cfg)
    round_id = queue_round(cfg, db)
    worker = worker_id()
    if db.claim_round(worker, round_id) is None:
        raise RoundError(f"round {round_id} was claimed by another worker before this process could run it")
    with Heartbeat(db, round_id, worker, interval_s=heartbeat_s) as beat:
        return run_round(cfg, round_id, db, worker, cancel_requested=beat.cancel_requested.is_set)


class RoundCancelled(Exception):
    """Someone cancelled the round while it ran in this process (``vla-rl round cancel``)."""


class Heartbeat:
    """Keeps a claimed round's heartbeat fresh from a background thread while the round runs here, and
    sets :attr:`cancel_requested` when a heartbeat finds the round's cancel flag raised."""

    def __init__(self, db: MetadataDB, round_id: int, worker: str, interval_s: float = 5.0) -> None:
        self.db, self.round_id, self.worker, self.interval_s = db, round_id, worker, interval_s
        self.cancel_requested = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"round-{round_id}-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.db.heartbeat_round(self.round_id, self.worker):
                    self.cancel_requested.set()
            except RoundLost:
                return
            except Exception as e:  # a DB hiccup must not kill the round; the next beat retries
                log.warning("heartbeat failed", extra={"round": self.round_id, "error": str(e)})

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_PROGRESS_KEYS = (
    "phase", "since", "stage", "step", "total_steps", "eta_s", "evaluating", "episodes_done", "episodes_total",
    "eval_eta_s", "updated_at",
)  # fmt: skip


class ProgressWriter:
    """A running round's progress in its ``round_jobs.progress`` (what the dashboard streams):

    * :meth:`phase` (``loading base`` / ``training`` / ``evaluating`` / ``pushing``) is written at once;
    * the step reports of the trainer's and the evaluation's :class:`~vla_rl.train.base.StepProgress`
      (``__call__``, the ``on_progress`` of :func:`vla_rl.train.algorithms.train`) become ``stage``,
      ``step``, ``total_steps`` and ``eta_s = elapsed_in_stage / steps_in_stage * (total - step)`` (an
      evaluation's: ``episodes_done``, ``episodes_total``, ``eval_eta_s``); they are written at most once
      every ``interval_s``, except the first report of a new stage and its last step (written at once;
      a held-back one is written by :meth:`flush`), so a fast trainer costs ~1 DB write a second.

    Without a ``worker`` (a round run outside the queue) nothing is written. A write that fails is
    logged and skipped (progress is best effort), except :class:`RoundLost`: the round is not ours.
    Every report and phase first asks ``cancel_requested`` (when given) and raises
    :class:`RoundCancelled` if it says so: a round run in-process stops at its next step."""

    def __init__(
        self,
        db: MetadataDB,
        round_id: int,
        worker: str | None,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        cancel_requested: Callable[[], bool] | None = None,
    ) -> None:
        self.db, self.round_id, self.worker = db, round_id, worker
        self.cancel_requested = cancel_requested
        self.interval_s, self.clock = interval_s, clock
        self.state: dict[str, Any] = dict.fromkeys(_PROGRESS_KEYS)
        self.writes = 0
        self._last_write = -float("inf")
        self._pending = False
        self._stage: str | None = None  # of the latest report
        self._stages: dict[str, tuple[float, int, int]] = {}  # stage -> (start time, start step, last step)

    def _write(self) -> None:
        if self.worker is None:
            return
        self.state["updated_at"] = time.time()
        self.db.heartbeat_round(self.round_id, self.worker, progress=dict(self.state))
        self.writes += 1
        self._last_write, self._pending = self.clock(), False

    def check_cancel(self) -> None:
        """Raise RoundCancelled if ``cancel_requested`` says so (every report and phase asks first)."""
        if self.cancel_requested is not None and self.cancel_requested():
            raise RoundCancelled(f"round {self.round_id} was cancelled while running")

    def phase(self, phase: str, **extra: Any) -> None:
        """The round moved on to ``phase`` (raises RoundLost if the round is no longer this worker's,
        RoundCancelled if it was cancelled)."""
        self.check_cancel()
        self.state.update(phase=phase, since=time.time(), **extra)
        self._write()

    def __call__(self, report: Mapping[str, Any]) -> None:
        self.check_cancel()
        stage, step, total = str(report["stage"]), int(report["step"]), int(report["total_steps"])
        now = self.clock()
        t0, s0, last = self._stages.get(stage, (now, step, step))
        if step < last:  # the stage started over (e.g. another evaluation, the next cross-fitting fold)
            t0, s0 = now, step
        self._stages[stage] = (t0, s0, step)
        eta = (now - t0) / (step - s0) * max(0, total - step) if step > s0 else None
        eta = round(eta, 1) if eta is not None else None
        if stage == "eval":
            self.state.update(episodes_done=step, episodes_total=total, eval_eta_s=eta)
        else:
            self.state.update(stage=stage, step=step, total_steps=total, eta_s=eta)
        self._pending = True
        new_stage, self._stage = stage != self._stage, stage
        if new_stage or step >= total or now - self._last_write >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Write a held-back report now."""
        if not self._pending:
            return
        try:
            self._write()
        except RoundLost:
            raise
        except Exception as e:  # a DB hiccup must not stop training; the next report retries
            self._pending = False
            log.warning("progress write failed", extra={"round": self.round_id, "error": str(e)})


def _record_evaluation(folder: Path, metrics: Mapping[str, Any], round_id: int) -> None:
    """Record the round's evaluation in the checkpoint itself, with the round in its lineage and a model
    card from them: our checkpoint's ``config.json`` metrics, or a LeRobot folder's sidecar
    (:mod:`policies.lerobot_sidecar`; LeRobot's own files stay as the trainer saved them)."""
    if is_lerobot_folder(folder):
        record_evaluation(folder, metrics, round_id)
        return
    info, weights = load_checkpoint(folder)
    lineage = dataclasses.replace(info.lineage, round=round_id)
    save_checkpoint(
        folder, weights, dataclasses.replace(info, lineage=lineage, metrics={**info.metrics, **metrics})
    )


def fit_round_predictor(cfg: RoundConfig, run: TrainerConfig, checkpoint: Path) -> dict[str, Any]:
    """Fit the failure predictor for the round's candidate ``checkpoint`` on the data ``run`` trained on
    (its store, selection, task and DB) into ``checkpoint/failure``
    (:func:`vla_rl.train.failure.train_failure`, as ``vla-rl failure fit`` does); returns its summary with
    ``fitted``, or ``fitted: False`` and the reason when the data cannot fit or calibrate one (the round
    goes on without it)."""
    import torch

    from policies.failure import FAILURE_DIR
    from vla_rl.train.failure import train_failure

    assert run.store is not None
    fit = FailureFitConfig(
        base=str(checkpoint),
        store=run.store,
        out=checkpoint / FAILURE_DIR,
        data=run.data,
        task=run.task,
        db_url=run.db_url,
        hidden=cfg.failure_hidden,
        steps=cfg.failure_steps,
        alpha=cfg.failure_alpha,
        seed=run.seed,
        threads=torch.get_num_threads(),  # the round's own setting, left as it is
    )
    try:
        summary = train_failure(fit)
    except ValueError as e:
        log.warning("failure predictor not fitted", extra={"checkpoint": str(checkpoint), "error": str(e)})
        return {"fitted": False, "error": str(e)}
    return {"fitted": True, **{k: v for k, v in summary.items() if k != "out"}}


def _tag_exists(repo: str, tag: str) -> bool:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        resolve(f"hub://{repo}@{tag}")
    except (RevisionNotFoundError, RepositoryNotFoundError):
        return False
    return True


def _round_tag(cfg: RoundConfig, round_id: int) -> tuple[str, str]:
    """The repo and tag round ``round_id`` pushes to; raises :class:`RoundError` when the tag already exists
    (a round never tags twice). Checked before training, so a taken tag costs seconds, not a round's
    training, and again just before the push (another fleet may have pushed it meanwhile)."""
    assert cfg.train.base is not None
    repo = cfg.repo or parse_ref(cfg.train.base).repo_id
    tag = f"round-{round_id}"
    if _tag_exists(repo, tag):  # an earlier attempt of this round pushed it, then its worker died
        raise RoundError(
            f"{tag} already exists in {repo}: pushed by an earlier attempt of this round, or another "
            "fleet (another metadata DB, whose round ids restart at 1) pushes its rounds to this repo; "
            "a round never tags twice: give each fleet its own repo (round start --repo org/name)"
        )
    return repo, tag


def run_round(
    cfg: RoundConfig,
    round_id: int,
    db: MetadataDB,
    worker: str | None = None,
    cancel_requested: Callable[[], bool] | None = None,
) -> RoundRecord:
    """The round's work, for a round already claimed by ``worker`` (status running): train, evaluate
    candidate and base on the same seeds, push ``round-N`` (never twice), promote if the gate passes.
    Returns the final record, or raises after recording the failure. ``cancel_requested`` is asked at
    every progress report up to the push: when it says so, the round is recorded cancelled and
    :class:`RoundCancelled` raised."""
    t = cfg.train
    assert t.base is not None
    log.info("round start", extra={"round": round_id, "algo": cfg.algo, "base": t.base, "worker": worker})
    progress = ProgressWriter(db, round_id, worker, cancel_requested=cancel_requested)
    try:
        progress.phase("loading base")
        base = load_chunk_policy(t.base, algorithm=cfg.algo)  # ours, or a LeRobot flow VLA's folder
        try:
            task = base.task(t.task)
        except ValueError as e:
            raise RoundError(str(e)) from None
        db.update_round(round_id, base_revision=base.commit, task=task)
        # selected once (a bad or empty selection fails before any training); an offline round's
        # held-out episodes are not trained on (unless they are all there is)
        data = round_data(cfg, db, task)
        if cfg.push:
            _round_tag(cfg, round_id)  # a taken tag fails now, not after the training
        run = dataclasses.replace(
            t,
            out=t.out / f"round-{round_id}",
            task=task,
            round_index=round_id,
            data=data.training_data(t.data),
            db_url=training_db_url(t.db_url, db),
        )
        progress.phase("training")
        trained = train(run, on_progress=progress)
        progress.flush()
        db.update_round(round_id, data=json.loads(json.dumps(trained.data, default=str)))

        # evaluate base and candidate on the same seeds (simulation) or the same held-out episodes (offline)
        progress.phase("evaluating")
        new = load_chunk_policy(trained.checkpoint, algorithm=cfg.algo)
        gate: GateResult
        report: dict[str, Any] = {}
        if is_sim_task(task):
            with reporting_progress(progress):
                gate = _sim_gate(cfg, db, base, new, task, progress)
                report = _report(cfg, new, task, gate, progress)
            progress.flush()
        else:
            gate = _no_sim_gate(cfg, db, base, new, data)
        metrics = {**gate.round_metrics(), **report}
        metrics.update(train_seconds=round(trained.seconds, 1), train=trained.metrics, curve=trained.curve)
        if not is_sim_task(task):
            metrics["held_out_excluded_from_training"] = data.excludes_held_out
        eval_metrics = {**gate.checkpoint_metrics(), **report, "round": round_id}
        _record_evaluation(trained.checkpoint, eval_metrics, round_id)
        if cfg.failure_predictor:  # after the card: the predictor pins the weights it reads by their sha256
            progress.phase("fitting failure predictor")
            metrics["failure_predictor"] = fit_round_predictor(cfg, run, trained.checkpoint)

        checkpoint_ref, revision, promoted = str(trained.checkpoint), None, False
        progress.check_cancel()  # the last point a cancel stops the round
        if worker is not None and not db.begin_commit(round_id, worker):
            raise RoundCancelled(f"round {round_id} was cancelled while running")
        progress.cancel_requested = None  # committing: a cancel no longer applies, the round finishes
        if cfg.push:
            progress.phase("pushing")
            repo, tag = _round_tag(cfg, round_id)
            revision = push_folder(
                trained.checkpoint, repo, message=f"round {round_id}: {cfg.algo} on {task}", tag=tag
            )
            checkpoint_ref = f"hub://{repo}@{tag}"
            if gate.promote:
                move_ref(repo, cfg.promote_ref, revision)
                promoted = True
        metrics["gate"] = {
            "margin": cfg.margin,
            "passed": gate.promote,
            "reason": gate.why,
            **({"alpha": gate.alpha, "p_value": gate.test.p_value} if gate.test else {}),
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
                "success": metrics.get("success"),
                "base_success": metrics.get("base_success"),
                "action_mse": metrics.get("action_mse"),
                "promoted": promoted,
                "checkpoint": checkpoint_ref,
            },
        )
        return record
    except RoundLost:
        log.error("round lost", extra={"round": round_id, "worker": worker})
        raise  # re-queued or cancelled meanwhile: its row belongs to someone else now
    except RoundCancelled:
        db.cancel_running(round_id)  # never over a record of its own: only a running round is cancelled
        log.info("round cancelled", extra={"round": round_id})
        raise
    except BaseException as e:
        db.update_round(
            round_id,
            status="failed",
            error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}",
            finished_at=time.time(),
        )
        log.error("round failed", extra={"round": round_id, "error": str(e)})
        raise

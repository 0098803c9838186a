"""Online AWR policy iteration (Peng et al. 2019, "Advantage-Weighted Regression"): one algorithm, one file.

Offline AWR (:mod:`vla_rl.train.awr`) scores the fleet's experience once and re-trains the policy on it.
The original AWR is an online algorithm: it iterates

1. **collect** ``episodes_per_iteration`` episodes with the CURRENT policy in the vectorised simulator
   (``num_envs`` processes, :func:`sim.demos.record_policy_episodes`: controller ``policy``, the acting
   weights' revision on every frame) into the episode store ``<out>/online_store`` (the dashboard can
   review it), at episode seeds ``online_seed + k * (episodes_per_iteration + num_envs) + ...`` in
   iteration ``k`` (from 1,000,000: far from every evaluation range, :mod:`vla_rl.core.seeds`);
2. **fit the value** on the offline store's selected episodes (``data``: demos, fleet rollouts) plus the
   newest ``buffer_episodes`` online episodes: V(s) regressed on the credit-aware Monte-Carlo returns,
   cross-fitted by episode, and ``A_t = G_t - V(s_t)`` (the very functions of offline AWR:
   :func:`vla_rl.train.awr.value_advantages`); a fresh value each iteration, on the frozen base's
   features (the normalised state for state-only policies; with ``value_input = "privileged"`` the
   simulator's full state instead, replayed from each episode's seed: :mod:`vla_rl.train.privileged`),
   or with ``value_warm_start`` the previous
   iteration's fold heads fine-tuned on the grown buffer (folds then fixed per episode); with
   ``hindsight_weight`` each failed episode also gets a goal-relabelled copy that ends in success
   (:mod:`vla_rl.train.hindsight`), cloned with that weight and kept out of the value fit;
3. **regress the policy** for ``steps_per_iteration`` updates of weighted flow matching on the same
   buffer, ``w = min(exp(A / (beta * std A)), w_max)`` (:func:`vla_rl.train.awr.awr_weights`), continuing
   from the current weights with the optimiser's state kept across iterations (linear warm-up, then a
   constant learning rate); the EMA of the weights acts in the next collection and is shipped;

until ``env_steps`` simulator steps are spent (the last collection stops at the budget; episodes cut
there are closed ``aborted`` and not learned from).

Outputs::

    <out>/checkpoints/last/   the EMA policy (lineage algorithm "awr-pi"; plus iter_NNNN/ every
                              ``checkpoint_every`` iterations, for a held-out learning curve)
    <out>/online_store/       every online episode (Zarr episode store)
    <out>/train_state.pt      weights, EMA, optimiser, iteration, env steps, online episode ids and
                              the warm-started value heads (resume)
    <out>/curve.json          one row per iteration; <out>/tb/ TensorBoard

**Any flow policy.** The base is our FlowVLA or a LeRobot SmolVLA / π0 / π0.5 folder, through the
flow-policy contract (:mod:`vla_rl.train.contract`): the value reads the frozen base's features, a copy
trains (its ``trainable`` parts), and the checkpoint is saved in the base's own format.

**Resume.** The train state is written atomically after every iteration. Re-running into the same
``out`` continues from the last finished iteration exactly (collection seeds, batches and noise are
functions of the run seed and the iteration / update count); episodes an interrupted iteration had
already closed stay in the online store but are not learned from (the iteration records its own again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import Episode, EpisodeStore
from fleet.store_index import store_db
from policies.flow_policy import FlowPolicy
from policies.loading import FlowCheckpoint
from vla_rl.core.seeds import ONLINE
from vla_rl.train.awr import (
    AdvantageConfig,
    all_features,
    awr_weights,
    episode_folds,
    value_advantages,
    value_head,
)
from vla_rl.train.base import TrainResult, check_optional_positive
from vla_rl.train.common import EMA, RunClock, sample_indices, seed_step
from vla_rl.train.contract import (
    PolicyInputs,
    as_policy,
    load_base,
    save_trained,
    trainable_copy,
    trainable_parameters,
    trained_module,
    weighted_flow_loss,
)
from vla_rl.train.distributed import SINGLE
from vla_rl.train.hindsight import add_hindsight_copies, goal_layout
from vla_rl.train.loop import (
    IterationLoop,
    Optimiser,
    TrainLog,
    TrainState,
    UpdateLoop,
    gradient_step,
    warmup_cosine_schedule,
)
from vla_rl.train.privileged import ReplayedStates
from vla_rl.train.transitions import TransitionBuffer, select_episode_ids

if TYPE_CHECKING:
    from sim.latency import LatencyOptions

log = logging.getLogger(__name__)

__all__ = ["AWRPIConfig", "iteration_seed", "train_awr_pi", "weights_revision"]


@dataclass(kw_only=True)
class AWRPIConfig(AdvantageConfig):
    """Every knob of an online AWR policy-iteration run. The value, weighting and optimiser knobs are
    offline AWR's (:class:`vla_rl.train.awr.AdvantageConfig`); the optimiser and EMA continue across
    iterations, the learning rate is constant after its warm-up."""

    algorithm: ClassVar[str] = "awr-pi"

    # online collection
    env_steps: int = 20_000
    """Budget of simulator steps (all robots together); the run stops once it is spent."""
    episodes_per_iteration: int = 20
    """Episodes collected with the current policy before each value fit and policy update."""
    num_envs: int = 2
    """Simulator processes stepping together."""
    buffer_episodes: int = 0
    """Keep only the newest this many online episodes in the buffer (the offline data, from ``store``,
    always stays); 0 = every online episode."""
    max_episode_steps: int | None = None
    """Episode time limit; None = the task's."""
    online_seed: int = ONLINE
    """First episode seed of online collection; every evaluation range stays below it (:mod:`vla_rl.core.seeds`)."""
    n_exec: int | None = None
    """Actions executed per chunk; None = the policy's ``n_exec``."""
    latency: str | None = None
    """Collect with latency as a robot feels it (:mod:`sim.latency`): a per-episode network delay such as
    const:100ms, uniform:50ms-200ms, exp:100ms, or net=DELAY,obs=DELAY; the robot keeps executing its
    action queue while a request is in flight and the frames hold what it executed. None = receding horizon."""
    latency_merge: str = "weighted_average"
    """With ``latency``: how a new chunk joins the robot's queue (weighted_average, latest_only,
    temporal_ensemble, ...)."""
    value_steps: int = 1000
    """Gradient steps per value fit (one fit per fold, every iteration)."""
    value_warm_start: bool = False
    """Keep each fold's value head across iterations and fine-tune it (``value_steps`` updates) on the
    grown buffer instead of fitting a fresh one. Folds are then fixed per episode (a hash of its arrival
    index, :func:`vla_rl.train.awr.episode_folds`), so a head never scores an episode it trained on."""

    # policy extraction
    steps_per_iteration: int = 500
    """Weighted flow-matching updates after each value fit (0: collect and fit only, a control run)."""

    # bookkeeping
    checkpoint_every: int = 0
    """Also ship the EMA policy to out/checkpoints/iter_NNNN every this many iterations (as PPO does), so
    one run can be scored on held-out episodes along its budget; 0 = only the final one."""
    resume: bool = True
    """Continue from <out>/train_state.pt when it exists (from the last finished iteration)."""
    stop_at: int | None = None
    """Stop after this many iterations, as a preempted job would (tests, budgets in iterations)."""
    max_minutes: float | None = None
    """Wall-clock budget: no new iteration starts once this many minutes have passed since the start,
    and the policy as it is then is shipped (``metrics["env_steps"]`` says how far it got,
    ``stopped_by_time`` that the clock stopped it; a round on a deadline, or a benchmark on a borrowed
    machine). None = run until ``env_steps``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("env_steps", "episodes_per_iteration", "num_envs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        for name in ("steps_per_iteration", "buffer_episodes", "online_seed", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {getattr(self, name)}")
        for name in ("max_episode_steps", "n_exec", "stop_at"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer or None, got {getattr(self, name)}")
        check_optional_positive(self, "max_minutes", "a positive number of minutes")
        self.latency_options()  # a bad spec or merge fails here, naming the knob

    def latency_options(self) -> LatencyOptions | None:
        """The latency world collection runs in (None: the receding-horizon driver)."""
        if self.latency is None:
            return None
        from sim.latency import LatencyOptions, LatencySpec

        try:
            return LatencyOptions(LatencySpec.parse(self.latency), merge=self.latency_merge)
        except ValueError as e:
            raise ValueError(f"latency / latency_merge: {e}") from None

    def collection_seeds(self) -> range:
        """A superset of the episode seeds this run collects from: a full iteration takes at least
        ``episodes_per_iteration`` env steps, so at most ``ceil(env_steps / E) + 1`` iterations start, each
        on ``E + N`` seeds (:func:`iteration_seed`)."""
        iterations = math.ceil(self.env_steps / self.episodes_per_iteration) + 1
        stride = self.episodes_per_iteration + self.num_envs
        return range(self.online_seed, self.online_seed + iterations * stride)


# ---------------------------------------------------------------------------- pure pieces
def iteration_seed(cfg: AWRPIConfig, iteration: int) -> int:
    """First episode seed of iteration ``k``'s collection: ``online_seed + k * (E + N)``. An iteration
    starts at most E + N - 1 episodes (robot i's j-th at ``seed + i + j N``), so no two share a seed."""
    return cfg.online_seed + iteration * (cfg.episodes_per_iteration + cfg.num_envs)


def weights_revision(model: torch.nn.Module) -> str:
    """``awr-pi:<sha1 of the weights, 16 hex>``: the revision recorded on the frames a training policy
    acted in (the base's own commit while the weights are still the base's)."""
    h = hashlib.sha1(usedforsecurity=False)
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return "awr-pi:" + h.hexdigest()[:16]


def newest(ids: Sequence[str], keep: int) -> list[str]:
    """The last ``keep`` of ``ids`` (all of them for ``keep = 0``)."""
    return list(ids[-keep:]) if keep else list(ids)


@dataclass
class _Offline:
    """The offline episodes, read once, with their current labels and span labels."""

    episodes: list[Episode]
    labels: dict[str, Mapping[str, Any]]
    spans: dict[str, list[Any]]


def _load_offline(cfg: AWRPIConfig, task: str, cameras: bool) -> _Offline:
    store = EpisodeStore(cfg.store)
    selection = Selection.parse(cfg.data, task=task)
    db = store_db(store, MetadataDB(cfg.db_url) if cfg.db_url else None)
    ids = select_episode_ids(store, selection, db)
    return _Offline(
        episodes=[store.read_episode(e, cameras=cameras) for e in ids],
        labels=db.current_labels(ids) if db is not None else {},
        spans=db.current_spans(ids) if db is not None else {},
    )


def _buffer(
    cfg: AWRPIConfig, offline: _Offline, online: Sequence[Episode], max_steps: int, cameras: bool
) -> TransitionBuffer:
    """The iteration's buffer: every offline episode, then the given online ones (oldest first)."""
    buf = TransitionBuffer(
        offline.episodes[0].meta.spec,
        reward=cfg.reward,
        gamma=cfg.gamma,
        max_steps=max_steps,
        cameras=cameras,
    )
    for ep in offline.episodes:
        eid = ep.meta.episode_id
        buf.add_stored_episode(ep, offline.labels.get(eid, {}), offline.spans.get(eid, []))
    for ep in online:
        buf.add_stored_episode(ep)
    return buf


def _saved_heads(heads: Mapping[int, torch.nn.Module] | None, feature_dim: int) -> dict[str, Any]:
    """The warm-started fold heads as plain data for the train state: weights, input width, support."""
    out: dict[str, Any] = {}
    for k, head in (heads or {}).items():
        v_min, v_max = float(getattr(head, "v_min", -1.0)), float(getattr(head, "v_max", 1.0))
        out[str(k)] = {
            "weights": head.state_dict(),
            "feature_dim": feature_dim,
            "v_min": v_min,
            "v_max": v_max,
        }
    return out


def _load_heads(
    cfg: AWRPIConfig, saved: Mapping[str, Any], device: torch.device
) -> dict[int, torch.nn.Module]:
    """Inverse of :func:`_saved_heads`."""
    heads: dict[int, torch.nn.Module] = {}
    for k, h in saved.items():
        head = value_head(cfg, int(h["feature_dim"]), float(h["v_min"]), float(h["v_max"]))
        head.load_state_dict(h["weights"])
        heads[int(k)] = head.to(device).eval()
    return heads


# ---------------------------------------------------------------------------- training
def train_awr_pi(cfg: AWRPIConfig) -> TrainResult:
    """Iterate collection, value fit and AWR updates until ``env_steps`` are spent; returns the
    checkpoint (the EMA policy) with the per-iteration curve. Re-running into ``out`` resumes."""
    from policies.loading import pick_device
    from sim.vector import VectorSimEnv
    from vla_rl.evaluation_offline import is_sim_task

    clock = RunClock()
    torch.set_num_threads(SINGLE.threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    base = load_base(cfg, device)
    spec, task = base.spec, base.task(cfg.task)
    if not is_sim_task(task):
        raise ValueError(f"task: {task!r} is not a simulator task; awr-pi collects online (use awr offline)")
    cameras = bool(spec.cameras)
    offline = _load_offline(cfg, task, cameras)
    if offline.episodes[0].meta.spec.state_dim != spec.state_dim:
        raise ValueError(
            f"store episodes (spec {offline.episodes[0].meta.spec.name}) do not match the base's spec"
        )

    # the policy that trains (the base stays frozen: the value's features are the base's)
    policy = trainable_copy(base.policy)
    params = trainable_parameters(cfg, policy)
    model = trained_module(policy)
    ema = EMA(model, cfg.ema_decay)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    # linear warm-up, then a constant rate
    scheduler = warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.warmup_steps + 1, 1.0)
    opt = Optimiser(optimizer, {"policy": list(model.parameters())}, cfg.grad_clip, scheduler)
    cfg.out.mkdir(parents=True, exist_ok=True)
    online_store = EpisodeStore(cfg.out / "online_store", create=not (cfg.out / "online_store").exists())
    state = TrainState(
        cfg.out, clock, {"model": model, "ema": ema, "optimizer": optimizer, "scheduler": scheduler}
    )
    iteration, env_steps, updates = 0, 0, 0
    online_ids: list[str] = []
    # value_warm_start: the fold heads kept across iterations (None: a fresh value every iteration)
    heads: dict[int, torch.nn.Module] | None = {} if cfg.value_warm_start else None
    st = state.read(cfg.resume)
    curve: list[dict[str, Any]] | None = None
    if st is not None:
        state.restore(st)
        iteration, env_steps, updates = int(st["iteration"]), int(st["env_steps"]), int(st["updates"])
        online_ids, curve = list(json.loads(st["online_ids"])), json.loads(st["curve"])
        if heads is not None:
            heads.update(_load_heads(cfg, st.get("value_heads", {}), device))
        log.info(
            "awr-pi resumed",
            extra={"iteration": iteration, "env_steps": env_steps, "from": str(state.path)},
        )
    # the online episodes the next buffer can hold, in memory (older ones stay in the store only)
    online: dict[str, Episode] = {
        e: online_store.read_episode(e, cameras=cameras) for e in newest(online_ids, cfg.buffer_episodes)
    }
    tlog = TrainLog(
        cfg,
        SINGLE,
        purge_step=iteration,
        config_step=0 if iteration == 0 else None,
        finite_only=True,
        curve=curve,
    )
    env = VectorSimEnv(
        task,
        num_envs=cfg.num_envs,
        seed=cfg.online_seed,
        obs="rgb" if cameras else "state",
        image_size=spec.cameras[0].height if cameras else 128,
        max_episode_steps=cfg.max_episode_steps,
        # the online episodes are replayed for what a camera policy's state lacks (see below)
        replayable=cameras and bool(cfg.replay_uses(cameras)),
    )
    max_steps = max(env.max_episode_steps, *(ep.length for ep in offline.episodes))
    # each episode's full simulator state, replayed once: V's inputs with value_input "privileged", and a
    # camera policy's hindsight copies (its own state lacks the achieved position)
    offline_by_id = {ep.meta.episode_id: ep for ep in offline.episodes}
    replayed = ReplayedStates(
        task, lambda e: online[e] if e in online else offline_by_id[e], uses=cfg.replay_uses(cameras)
    )
    layout = goal_layout(task, cameras) if cfg.hindsight_weight else None
    tlog.progress(cfg.env_steps, initial=env_steps, stage="online", desc="awr-pi", unit="env step")
    feature_dim = 0  # the value's input width (saved with warm-started heads)

    def ship(ckpt: Path, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Save the EMA policy as a derived checkpoint at ``ckpt``; returns its data record. Weights and
        card are replaced atomically and the config (with their hashes) last: a kill leaves a checkpoint
        that either loads or fails its hash check, never a silently mixed one."""
        data = {
            "selection": Selection.parse(cfg.data, task=task).to_dict(),
            "offline_episodes": len(offline.episodes),
            "online_store": str(cfg.out / "online_store"),
            "online_episodes": len(online_ids),
            "env_steps": loop.env_steps,
        }
        save_trained(
            as_policy(ema.model, policy),
            ckpt,
            base,
            algorithm=cfg.algorithm,
            data=data,
            metrics={k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()},
            round_index=cfg.round_index,
        )
        return data

    def iterate() -> dict[str, Any]:
        """1. collect with the current (EMA) policy, 2. value and advantages on the offline and newest
        online episodes, 3. weighted flow matching from the current weights; returns the curve row."""
        nonlocal updates, feature_dim
        it0 = time.perf_counter()
        rep, revision = _collect(cfg, base, as_policy(ema.model, policy), online_store, env, loop, updates)
        loop.collected(rep.env_steps)
        for e in rep.episode_ids:
            online[e] = online_store.read_episode(e, cameras=cameras)
        online_ids.extend(rep.episode_ids)
        collect_s = time.perf_counter() - it0
        kept = newest(online_ids, cfg.buffer_episodes)
        for e in set(online) - set(kept):
            del online[e]
        buf = _buffer(cfg, offline, [online[e] for e in kept], max_steps, cameras)
        replayed.forget({*offline_by_id, *online})
        copies = (
            add_hindsight_copies(buf, layout, replayed.states if cameras else None)
            if layout is not None
            else []
        )
        inputs = PolicyInputs(policy, buf, device)
        bc = buf.array("bc").astype(bool)
        if cfg.value_input == "privileged":
            feats = torch.from_numpy(replayed.features(buf)).to(device)
        else:
            feats = all_features(base.policy, buf, inputs)
        feature_dim = int(feats.shape[1])
        seed_step(cfg.seed, -(loop.iteration + 1))  # value heads' init: a function of (seed, iteration)
        # warm start: folds by arrival index (offline first, then online in collection order)
        first = len(offline.episodes) + len(online_ids) - len(kept)
        arrival = [*range(len(offline.episodes)), *range(first, first + len(kept))]
        fold_of = episode_folds(arrival, cfg.value_folds, cfg.seed) if heads is not None else None
        adv, vm = value_advantages(cfg, feats, buf, bc, heads, fold_of)
        w = awr_weights(adv, bc, cfg.beta, cfg.w_max, cfg.human_weight)
        w[np.isin(buf.array("episode"), copies)] = cfg.hindsight_weight
        weights = torch.from_numpy(w)
        w_auto = w[~bc]
        updates, losses = _regress(cfg, policy, ema, opt, buf, weights, inputs, updates)
        if not rep.episodes:
            loop.stop()  # the budget ran out inside the first episodes of this collection
        return {
            "iteration": loop.iteration + 1,
            "env_steps": loop.env_steps,
            "episodes": rep.episodes,
            "rollout_success": rep.success_rate if rep.episodes else float("nan"),
            "revision": revision,
            "online_episodes": len(online_ids),
            "buffer_episodes": len(buf.episode_ids),
            "buffer_frames": len(buf),
            "hindsight_episodes": len(copies),
            **{k: float(v) for k, v in vm.items()},
            "weight_mean": float(w_auto.mean()) if len(w_auto) else float("nan"),
            "effective_sample_frac": float(w_auto.sum() ** 2 / (len(w_auto) * (w_auto**2).sum()))
            if len(w_auto)
            else float("nan"),
            "loss": float(np.mean(losses)) if losses else float("nan"),
            "updates": updates,
            "collect_seconds": collect_s,
        }

    def save_state(iteration: int) -> None:
        """After every iteration (after its snapshot: a kill between them re-runs the iteration and
        re-ships it)."""
        state.save(
            iteration=iteration,
            env_steps=loop.env_steps,
            updates=updates,
            online_ids=json.dumps(online_ids),
            curve=json.dumps(tlog.curve),
            value_heads=_saved_heads(heads, feature_dim),
        )

    loop = IterationLoop(
        "awr-pi",
        "awr_pi",
        tlog,
        clock,
        cfg.env_steps,
        env_steps=env_steps,
        iteration=iteration,
        max_minutes=cfg.max_minutes,
        stop_at=cfg.stop_at,
        tb_step="iteration",
        postfix=lambda row: {
            "it": row["iteration"],
            "success": f"{row['rollout_success']:.0%}",
            "corr": f"{row['value_return_corr']:.2f}",
        },
        checkpoint_every=cfg.checkpoint_every,
        on_checkpoint=lambda i: ship(
            cfg.out / "checkpoints" / f"iter_{i:04d}",
            {"iterations": i, "env_steps": loop.env_steps, "updates": updates},
        ),
        on_iteration=save_state,
    )
    try:
        loop.run(iterate)
    finally:
        tlog.close()
        env.close()
        replayed.close()

    curve = tlog.curve
    successes = [r["rollout_success"] for r in curve if math.isfinite(r["rollout_success"])]
    metrics: dict[str, Any] = {
        "iterations": loop.iteration,
        "env_steps": loop.env_steps,
        "updates": updates,
        "online_episodes": len(online_ids),
        "rollout_success_first": successes[0] if successes else float("nan"),
        "rollout_success_last": successes[-1] if successes else float("nan"),
        "stopped_by_time": loop.stopped_by_time,
        **(
            {k: curve[-1][k] for k in ("value_return_corr", "value_explained_var", "value_loss")}
            if curve
            else {}
        ),
    }
    ckpt = cfg.out / "checkpoints" / "last"
    data = ship(ckpt, metrics)
    (cfg.out / "curve.json").write_text(json.dumps(curve, indent=1))
    seconds = clock.seconds
    log.info("awr-pi done", extra={"checkpoint": str(ckpt), "seconds": round(seconds, 1), **metrics})
    return TrainResult(checkpoint=ckpt, seconds=seconds, metrics=metrics, curve=curve, data=data)


def _collect(
    cfg: AWRPIConfig,
    base: FlowCheckpoint,
    acting: FlowPolicy,
    store: EpisodeStore,
    env: Any,
    loop: IterationLoop,
    updates: int,
) -> tuple[Any, str]:
    """Step 1: this iteration's episodes of the ``acting`` policy (the EMA weights) into ``store``, at
    most the env steps left; returns the recording report and the revision written on its frames (the
    base's commit until the first update)."""
    from sim.demos import record_policy_episodes

    revision = base.commit if updates == 0 else weights_revision(trained_module(acting))
    chunk_policy = dataclasses.replace(base, policy=acting, commit=revision, ref="awr-pi")
    rep = record_policy_episodes(
        store,
        env,
        chunk_policy,
        cfg.episodes_per_iteration,
        seed=iteration_seed(cfg, loop.iteration),
        n_exec=cfg.n_exec or base.policy.n_exec,
        revision=revision,
        robot_prefix="awr-pi",
        progress=False,
        max_env_steps=cfg.env_steps - loop.env_steps,
        latency=cfg.latency_options(),
    )
    return rep, revision


def _regress(
    cfg: AWRPIConfig,
    policy: FlowPolicy,
    ema: EMA,
    opt: Optimiser,
    buf: TransitionBuffer,
    weights: torch.Tensor,
    inputs: PolicyInputs,
    updates: int,
) -> tuple[int, list[float]]:
    """Step 3: ``steps_per_iteration`` updates of weighted flow matching on ``buf`` from the current
    weights, counted on from ``updates`` (batches and noise are functions of the run seed and the update
    count); returns the new count and the updates' losses."""
    policy.train()
    model = trained_module(policy)
    losses: list[float] = []

    def update(step: int) -> dict[str, float]:
        idx = sample_indices(len(buf), cfg.batch_size, cfg.seed, step)
        batch = inputs(buf.batch(idx, horizon=policy.chunk_len, n_step=1))
        loss, _m = weighted_flow_loss(policy, batch, weights=weights[idx].to(policy.device))
        gradient_step(loss, [opt], SINGLE)
        ema.update(model)
        losses.append(float(loss.detach()))
        return {"loss": losses[-1]}

    loop = UpdateLoop(update, seed=cfg.seed, dist=SINGLE, step=updates)
    return loop.run(updates + cfg.steps_per_iteration), losses

"""QAM: Q-learning with Adjoint Matching (Li & Levine, arXiv 2601.14234), offline and offline-to-online.

This is the trainer; the knobs are :class:`~vla_rl.train.qam_config.QAMConfig`, the equations and the
learner :mod:`vla_rl.train.qam_math`, the online rollouts and replay :mod:`vla_rl.train.qam_online`.
Every equation follows ``ColinQiyangLi/qam`` ``agents/qam.py`` as transcribed
in docs/algorithms.md §2 (time convention: t = 0 noise, t = 1 data, as our
policies). Networks on a flow VLA (docs/algorithms.md §7):

* **base** v_β: the SFT checkpoint's velocity field. Frozen by default; with ``train_base`` it keeps
  training with the behaviour flow-matching loss L_BC and the adjoint uses its Polyak copy v̄_β (the
  reference's ``target_actor_slow``).
* **fine** v_θ: a trainable copy of the base, trained ONLY by adjoint matching; the deployed policy.
* **critic**: a chunked Q ensemble (:class:`policies.critics.ChunkQEnsemble`) on the *executed*
  sub-chunk a_{t:t+n} (n = ``n_exec`` of the H predicted actions, normalised and clipped), with a Polyak
  target Q̄, trained by n-step TD with a pessimistic ensemble target (mean − ρ·std) and γ^n.

The target policy is π*(a|s) ∝ π_β(a|s)·exp(λ·Q(s, a)), λ = ``inv_temp``. One update:

1. ``L_Q = mean_{m,B} valid·(Q_m(s, a) − y)²``, ``y = R_n + γ^n·bootstrap·(mean_m Q̄_m − ρ std_m Q̄_m)(s', a')``
   with a' ~ fine policy at s' = s_{t+n} (Euler ODE, clipped); with ``value="divl"`` instead
   ``y = R_n + γ^n·bootstrap·V_τ(s')``, V_τ the τ-quantile of a categorical value fitted to the target
   critic at the data's actions (LWD's DIVL, :mod:`vla_rl.train.divl`);
2. ``L_BC``: the base's flow-matching loss (only with ``train_base``);
3. adjoint matching: simulate the fine policy under the memoryless SDE (last step deterministic with
   the base), take the terminal adjoint ``ã_K = −λ ∇_a mean_m Q̄(s, clip(a))`` (zero on the actions
   that are not executed), integrate the *lean* adjoint backward through the base drift only
   (vector-Jacobian products, no backprop through the fine policy), and regress
   ``L_AM = mean_B Σ_i ||(2/σ_i)(v_θ − v̄_β)(x_i, t_i) + σ_i ã_i||²``, i.e.
   ``v_θ → v̄_β − (σ_i²/2)·ã_i``.

The base is our FlowVLA checkpoint or a LeRobot SmolVLA / π0 / π0.5 folder; on the latter the frozen
base's VLM is shared by the fine copy (:mod:`vla_rl.train.qam_lerobot`, which says what
``trainable`` does there) and ships a LeRobot folder.

Offline: updates on a :class:`~vla_rl.train.transitions.TransitionBuffer` built from the episode store.
Offline-to-online: the same replay seeded with the offline data; the fine policy acts in a
:class:`sim.vector.VectorSimEnv` (each chunk's first ``n_exec`` actions, like deployment, driven by
:class:`sim.rollout.ChunkRollout`) and every finished episode is appended; ``utd`` updates per env step
until an env-step budget is spent. With ``next_action_cache`` (a' looked up from a periodically
re-sampled table), ``actor_every`` (critic-only updates in between) and ``reanchor_every`` (the fine
policy becomes the prior) this is approximate policy iteration at UTD 1 that a CPU can afford (measured on
the kinematic benchmark: docs/benchmarks.md, QAM online as policy iteration).

Output folder::

    <out>/checkpoints/last/   the fine policy (lineage algorithm "qam"; loads with policies.loading; a
                              LeRobot folder from a LeRobot base)
    <out>/train_state.pt      models, optimisers, step, env steps, online episodes (resume)
    <out>/tb/                 TensorBoard (losses, Q statistics, rollout / eval success)
    <out>/curve.json          the learning curve (also returned in QAMResult)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from typing import Any

import numpy as np
import torch

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import polyak_update
from policies.flow_vla import FlowVLAPolicy
from policies.lerobot_flow import LeRobotFlowPolicy
from policies.loading import FlowCheckpoint, LoadedPolicy, load_chunk_policy
from vla_rl.train.common import (
    TRAIN_STATE,
    RunClock,
    batch_to_policy_inputs,
    instruction_table,
    load_train_state,
    save_derived_checkpoint,
)
from vla_rl.train.contract import PolicyInputs, save_trained
from vla_rl.train.distributed import (
    Dist,
    Shard,
    broadcast_module,
    broadcast_object,
    distributed,
    mean_scalars,
)
from vla_rl.train.divl import DIVLConfig, divl_support
from vla_rl.train.loop import (
    Beat,
    Optimiser,
    TrainLog,
    TrainState,
    UpdateLoop,
    gradient_step,
    publish_last,
    time_budget,
)
from vla_rl.train.qam_config import QAMConfig, QAMResult
from vla_rl.train.qam_lerobot import LeRobotQAMLearner, check_lerobot_qam
from vla_rl.train.qam_math import QAMLearner
from vla_rl.train.qam_online import FineEvalView, NextActionCache, OnlineRollouts, add_episode, replay_indices
from vla_rl.train.transitions import load_transitions, next_observation

log = logging.getLogger(__name__)
Tensor = torch.Tensor

__all__ = ["QAMConfig", "QAMLearner", "QAMResult", "train_qam"]


def _load_base(cfg: QAMConfig, device: torch.device) -> LoadedPolicy | FlowCheckpoint:
    """Our FlowVLA checkpoint (a :class:`LoadedPolicy`) or a LeRobot SmolVLA / π0 / π0.5 folder (a
    :class:`FlowCheckpoint`, any other LeRobot type refused naming QAM), as FQL loads its base; the
    ``trainable`` knob is checked against it (FlowVLA's fine policy trains whole)."""
    loaded = load_chunk_policy(cfg.base, device=str(device), algorithm="qam")
    if isinstance(loaded, LoadedPolicy):
        if cfg.trainable not in (None, "full"):
            raise ValueError(
                f"trainable: QAM trains the whole fine copy of a flow_vla base; expected unset or 'full', "
                f"got {cfg.trainable!r} (expert / lora apply to a LeRobot base)"
            )
        return loaded
    loaded.policy.train(False)
    check_lerobot_qam(cfg)
    return loaded


def _adapt_init_state(
    st: dict[str, Any], learner: QAMLearner, opt_base: torch.optim.Optimizer | None, *, reset_actor: bool
) -> None:
    """Fit another run's train state to this learner, in place: with ``reset_actor`` the fine policy and
    the prior restart from this run's base (fresh actor optimiser); a prior's Polyak copy and optimiser
    the source did not train (``train_base`` off there, on here) start from its prior."""
    weights, base = st["learner"], learner.base.state_dict()
    if reset_actor:
        for k, v in base.items():
            weights["base." + k] = v.detach().clone()
            weights["fine." + k] = v.detach().clone()
        st["opt_actor"] = {"state": {}, "param_groups": st["opt_actor"]["param_groups"]}
    if learner.base_target is not None:
        for k in base:
            if reset_actor or "base_target." + k not in weights:
                weights["base_target." + k] = weights["base." + k].clone()
    else:
        for k in [k for k in weights if k.startswith("base_target.")]:
            del weights[k]
    if opt_base is not None and (reset_actor or not st.get("opt_base")):
        st["opt_base"] = opt_base.state_dict()


# ============================================================================ training
def _check_sim_needs(cfg: QAMConfig, task: str) -> None:
    """Online steps and success evaluations need a simulator: on a task without one (real robot data,
    e.g. a LeRobot import) QAM trains offline only, and says which knob asked for more."""
    from vla_rl.evaluation_offline import is_sim_task

    if is_sim_task(task):
        return
    for name in ("env_steps", "eval_every", "final_eval_episodes"):
        if getattr(cfg, name):
            raise ValueError(
                f"{name}: {task!r} is not a simulator task, so QAM trains offline only; expected 0, got "
                f"{getattr(cfg, name)} (a round evaluates real data offline: vla-rl eval --store)"
            )


class _QAMRun:
    """One QAM run: the offline data, the learner and its optimisers, the counters and the logs.

    Built (and restored from a train state) by the constructor; :meth:`offline_phase`,
    :meth:`online_phase` and :meth:`finish` are the run, :meth:`_update` one gradient step (which the
    :class:`~vla_rl.train.loop.UpdateLoop` :attr:`loop` runs with its log and checkpoint beats),
    :meth:`save` a checkpoint plus the train state.
    """

    def __init__(self, cfg: QAMConfig, dist: Dist, device: torch.device) -> None:
        self.dist = dist
        dist.check_batch(cfg.batch_size)
        self.shard = Shard(dist, cfg.batch_size)
        if not dist.is_main:
            cfg = dataclasses.replace(cfg, progress=False)  # one set of progress bars: rank 0's
        self.cfg = cfg
        self.clock = RunClock()  # the whole run's wall time, across resumes
        self.device = device
        torch.set_num_threads(dist.threads(cfg.threads))
        self.loaded = loaded = _load_base(cfg, device)
        self.lerobot = isinstance(loaded, FlowCheckpoint)
        """A LeRobot flow VLA base (:mod:`vla_rl.train.qam_lerobot`)."""
        base = loaded.policy
        if self.lerobot:
            self.task = task = loaded.task(cfg.task)  # a folder from elsewhere takes cfg.task as its own
        else:
            self.task = task = cfg.task or loaded.spec.name
            if task != loaded.spec.name:
                raise ValueError(f"task: the base checkpoint is for {loaded.spec.name!r}, got {task!r}")
        self.spec = loaded.spec
        _check_sim_needs(cfg, task)
        self._load_data()
        self.learner = learner = self._build_learner(base)
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.state = TrainState(
            cfg.out,
            self.clock,
            {
                "learner": learner,
                "opt_critic": self.opt_critic,
                "opt_actor": self.opt_actor,
                "opt_base": self.opt_base,
            },
        )
        self.loop = UpdateLoop(
            self._update,
            seed=cfg.seed,
            dist=dist,
            # a curve row every log_every updates, an evaluation every eval_every
            log=lambda step: Beat(cfg.log_every)(step) or Beat(cfg.eval_every)(step),
            on_log=self._log,
            checkpoint=Beat(cfg.checkpoint_every),
            on_checkpoint=lambda step: self.save(),
        )
        self.env_steps = 0
        self.online_episodes: list[dict[str, np.ndarray]] = []
        curve = self._restore()
        broadcast_module(learner, dist)  # every rank starts from rank 0's weights
        self.synced_episodes = len(self.online_episodes)

        self.tlog = TrainLog(cfg, dist, purge_step=self.step, config_step=self.step, curve=curve)
        log.info(
            "qam start",
            extra={
                "task": task,
                "base": cfg.base,
                "episodes": len(self.episode_ids),
                "frames": self.offline_frames,
                "feature_mode": learner.feature_mode,
                "device": str(device),
                "offline_steps": cfg.offline_steps,
                "env_steps": cfg.env_steps,
                "processes": dist.world,
            },
        )
        self.next_cache = (
            NextActionCache(learner, self.buffer, cfg, self.instructions, device)
            if cfg.next_action_cache
            else None
        )
        self.stop_at = cfg.stop_at if cfg.stop_at is not None else math.inf
        self.in_time = time_budget(self.clock, cfg.max_seconds, dist)
        """Within ``max_seconds``? Rank 0's clock decides for every rank."""
        self.phase = "offline"
        self.rollouts: OnlineRollouts | None = None
        self.batch: dict[str, Any] = {}
        """The last update's batch (the log's Q-gain diagnostic reads it)."""

    @property
    def step(self) -> int:
        """Gradient updates done (offline and online)."""
        return self.loop.step

    @property
    def curve(self) -> list[dict[str, Any]]:
        return self.tlog.curve

    # ------------------------------------------------------------------ build
    def _load_data(self) -> None:
        """The offline replay: the store's episodes chosen by ``cfg.data``."""
        cfg = self.cfg
        self.store = store = EpisodeStore(cfg.store)
        self.selection = Selection.parse(cfg.data, task=self.task)
        # as AWR: the configured DB, else the store's own; its labels (outcome overrides, span labels) and
        # rounds table reach the replay through load_transitions
        from fleet.db import MetadataDB

        db = MetadataDB(cfg.db_url) if cfg.db_url else None
        self.buffer = load_transitions(
            store, self.selection, db=db, reward=cfg.reward, gamma=cfg.gamma, cameras=bool(self.spec.cameras)
        )
        self.episode_ids = list(self.buffer.episode_ids)
        self.offline_frames = len(self.buffer)

    def _build_learner(self, base: FlowVLAPolicy | LeRobotFlowPolicy) -> QAMLearner:
        """The learner (seeded), its optimisers and the embeddings of the replay's instructions."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        support = divl_support(torch.from_numpy(self.buffer.array("mc_return")), DIVLConfig().support_margin)
        if isinstance(base, LeRobotFlowPolicy):
            learner: QAMLearner = LeRobotQAMLearner(base, cfg, support).to(self.device)
        else:
            learner = QAMLearner(base, cfg, support, instructions=len(self.buffer.instructions)).to(
                self.device
            )
        learner.base.eval()  # no dropout / augmentation noise in the prior (train_base re-enables train mode)
        if cfg.train_base:
            learner.base.train()
        critic = {
            "critic": list(learner.critic.parameters()),
            "value": list(learner.value_head.parameters()) if learner.value_head is not None else [],
        }
        self.opt_critic = torch.optim.Adam(itertools.chain(*critic.values()), lr=cfg.critic_lr)
        self.opt_actor = torch.optim.Adam(learner.actor_parameters(), lr=cfg.actor_lr)
        self.opt_base = (
            torch.optim.Adam(learner.base.parameters(), lr=cfg.base_lr) if cfg.train_base else None
        )
        # each module's gradient is clipped on its own, so a large L_AM never shrinks the critic's step
        self.optimisers = [
            Optimiser(self.opt_critic, critic, cfg.grad_clip),
            Optimiser(self.opt_actor, {"actor": learner.actor_parameters()}, cfg.grad_clip),
        ]
        if self.opt_base is not None:
            self.optimisers.append(
                Optimiser(self.opt_base, {"base": list(learner.base.parameters())}, cfg.grad_clip)
            )
        # each replay frame is conditioned on its own instruction (its episode's, as SFT); online episodes
        # on the simulator's, the spec's: registered first so the table covers them too
        sim_code = self.buffer.instruction_code(self.spec.instruction)
        self.instructions: Tensor | None = None
        self.instruction_emb: Tensor | None = None
        # a LeRobot VLA tokenises each frame's own instruction text (the contract's inputs)
        self.texts = PolicyInputs(base, self.buffer, self.device) if self.lerobot else None
        if not self.lerobot and base.config.uses_instruction:
            self.instructions = instruction_table(self.buffer, self.device)
            self.instruction_emb = self.instructions[sim_code : sim_code + 1]
        return learner

    def _inputs(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Replay rows (LeRobot key names) -> the policy's inputs on the device."""
        if self.texts is not None:
            return self.texts(raw)
        return batch_to_policy_inputs(raw, self.device, self.instructions)

    def _restore(self) -> list[dict[str, Any]] | None:
        """Continue from ``out``'s train state (resume) or another run's (``init_from``), if any; returns
        the curve so far (None: a fresh run)."""
        cfg = self.cfg
        start_from = self.state.path if cfg.resume and self.state.path.exists() else None
        if start_from is None and cfg.init_from is not None:
            start_from = cfg.init_from / TRAIN_STATE
            if not start_from.is_file():
                raise FileNotFoundError(
                    f"init_from: no {TRAIN_STATE} in {cfg.init_from}; expected the out folder of a QAM run"
                )
        if start_from is None:
            return None
        st = load_train_state(start_from)
        fresh = start_from != self.state.path
        if fresh:
            _adapt_init_state(st, self.learner, self.opt_base, reset_actor=cfg.init_reset_actor)
        try:
            self.learner.load_state_dict(st["learner"])
        except RuntimeError as e:
            raise ValueError(
                f"init_from: {start_from} does not fit this configuration (members, critic_hidden, "
                f"feature_mode and the base's architecture must match the source run): {e}"
            ) from e
        self.opt_critic.load_state_dict(st["opt_critic"])
        self.opt_actor.load_state_dict(st["opt_actor"])
        if self.opt_base is not None:
            self.opt_base.load_state_dict(st["opt_base"])
        self.loop.step, self.env_steps = int(st["step"]), int(st["env_steps"])
        if not fresh:
            self.clock.resume(st)
        for ep in st["online_episodes"]:
            ep_np = {k: v.numpy() for k, v in ep.items()}
            add_episode(self.buffer, ep_np)
            self.online_episodes.append(ep_np)
        log.info(
            "initialised from another run" if fresh else "resumed",
            extra={"step": self.step, "env_steps": self.env_steps, "from": str(start_from)},
        )
        return json.loads(st["curve"])

    # ------------------------------------------------------------------ checkpoints and evaluation
    def save(self, final: bool = False) -> None:
        """``checkpoints/step_NNNNNN`` (copied to ``last``), the train state and curve.json (rank 0)."""
        if not self.dist.is_main:
            return
        cfg, step, env_steps = self.cfg, self.step, self.env_steps
        ckpt = cfg.out / "checkpoints" / f"step_{step:06d}"
        data = {
            "store": str(cfg.store),
            "task": self.task,
            "selection": self.selection.to_dict(),
            "offline_episodes": len(self.episode_ids),
            "offline_frames": self.offline_frames,
            "online_episodes": len(self.online_episodes),
            "env_steps": env_steps,
            "reward": cfg.reward,
        }
        metrics = {"train_steps": step, "env_steps": env_steps, "inv_temp": cfg.inv_temp}
        if isinstance(self.loaded, FlowCheckpoint):  # a LeRobot folder with our lineage, as FQL saves it
            save_trained(
                self.learner.fine,
                ckpt,
                self.loaded,
                algorithm="qam",
                data=data,
                metrics=metrics,
                round_index=cfg.round_index,
            )
        else:
            save_derived_checkpoint(
                ckpt,
                self.learner.fine,
                self.loaded.info,
                algorithm="qam",
                parent_revision=self.loaded.commit,
                round_index=cfg.round_index,
                data=data,
                metrics=metrics,
            )
        publish_last(ckpt)
        self.state.save(
            step=step,
            env_steps=env_steps,
            curve=json.dumps(self.curve),
            online_episodes=[
                {k: torch.from_numpy(np.asarray(v)) for k, v in ep.items()} for ep in self.online_episodes
            ],
        )
        (cfg.out / "curve.json").write_text(json.dumps(self.curve, indent=1))
        if final:
            log.info("checkpoint", extra={"step": step, "env_steps": env_steps, "path": str(ckpt)})

    def evaluate_fine(self, episodes: int) -> float:
        """Success rate of the fine policy on ``episodes`` held-out episodes."""
        from vla_rl.evaluation import evaluate

        view: Any = (
            dataclasses.replace(self.loaded, policy=self.learner.fine, commit="training")
            if isinstance(self.loaded, FlowCheckpoint)
            else FineEvalView(self.learner, self.loaded)
        )
        res = evaluate(
            view,
            self.task,
            episodes=episodes,
            num_envs=self.cfg.num_envs,
            progress=False,
            ray=self.cfg.ray,
        )
        return res.success_rate

    # ------------------------------------------------------------------ one update
    def _batch(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This step's replay batch: the raw rows and the policy inputs (with the TD extras)."""
        cfg, lr = self.cfg, self.learner
        rows = self.shard.take(replay_indices(len(self.buffer), self.offline_frames, cfg, self.step))
        raw = self.buffer.batch(rows, horizon=lr.horizon, n_step=lr.n_exec)
        batch = self._inputs(raw)
        for key in ("reward_n", "bootstrap", "valid", "mc_return"):
            batch[key] = raw[key].to(self.device)
        return raw, batch

    def _losses(
        self, raw: dict[str, Any], batch: dict[str, Any], mc: bool, train_actor: bool
    ) -> dict[str, Tensor]:
        if mc:
            return self.learner.mc_losses(batch)
        # the TD target needs the observation n steps on; the MC warm start does not
        nxt = self._inputs(
            {**next_observation(raw), "action": raw["action"], "action_is_pad": raw["action_is_pad"]}
        )
        a_next = self.next_cache.lookup(raw["next_index"], self.step) if self.next_cache is not None else None
        return self.learner.losses(batch, nxt, train_actor, a_next, self.shard)

    def _update(self, step: int) -> dict[str, Any]:
        """One gradient update (MC warm start, critic-only or full): the losses, one backward pass and
        the optimiser steps (gradients clipped per module), then the Polyak targets; returns the losses
        and the gradient norms."""
        cfg, lr = self.cfg, self.learner
        raw, self.batch = self._batch()
        mc = step < cfg.critic_mc_steps
        warmup = max(cfg.critic_warmup, cfg.critic_mc_steps)
        train_actor = step >= warmup and (step - warmup) % cfg.actor_every == 0
        online = self.phase == "online"
        if online and cfg.reanchor_every and (step - cfg.offline_steps) % cfg.reanchor_every == 0:
            lr.reanchor()
            log.info("re-anchored: the fine policy is the prior now", extra={"step": step})
        out = self._losses(raw, self.batch, mc, train_actor)
        total = out["loss_q"] + out.get("loss_v", 0.0) + out.get("loss_bc", 0.0) + out.get("loss_am", 0.0)
        stepping = [True, train_actor] + [True] * (len(self.optimisers) - 2)
        norms = gradient_step(total, self.optimisers, self.dist, stepping)
        if lr.base_target is not None:
            polyak_update(lr.base_target, lr.base, cfg.tau)
        polyak_update(lr.critic_target, lr.critic, 1.0 if mc else cfg.tau)
        return {**out, **{f"grad_norm_{name}": norm for name, norm in norms.items()}}

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """Every ``log_every`` updates a curve row (and TensorBoard); evaluations every ``eval_every``."""
        cfg = self.cfg
        if step % cfg.log_every == 0:
            if step > max(cfg.critic_warmup, cfg.critic_mc_steps):
                q_gain = float(self.learner.q_gain(self.batch, self.shard))
                metrics["q_gain"] = mean_scalars({"q_gain": q_gain}, self.dist)["q_gain"]
            row: dict[str, Any] = {"step": step, "env_steps": self.env_steps, "phase": self.phase, **metrics}
            if self.rollouts is not None and self.rollouts.successes:
                row["rollout_success"] = float(np.mean(self.rollouts.successes))
            if cfg.eval_every and step % cfg.eval_every == 0 and self.dist.is_main:
                row["eval_success"] = self.evaluate_fine(cfg.eval_every_episodes)
            self.tlog.row(self.phase, row, step)
            assert self.tlog.bar is not None
            self.tlog.bar.set_postfix(
                q=f"{metrics['loss_q']:.3g}",
                am=f"{metrics.get('loss_am', float('nan')):.3g}",
                **({"succ": f"{row['rollout_success']:.0%}"} if "rollout_success" in row else {}),
            )
        elif cfg.eval_every and step % cfg.eval_every == 0 and self.dist.is_main:
            self.curve.append(
                {
                    "step": step,
                    "env_steps": self.env_steps,
                    "phase": self.phase,
                    "eval_success": self.evaluate_fine(cfg.eval_every_episodes),
                }
            )

    # ------------------------------------------------------------------ processes
    def sync_episodes(self) -> None:
        """Under torchrun: the online episodes rank 0 finished since the last call join every other
        rank's replay, in the same order (so all ranks sample the same replay)."""
        if not self.dist.enabled:
            return
        new = broadcast_object(
            self.online_episodes[self.synced_episodes :] if self.dist.is_main else None, self.dist
        )
        if not self.dist.is_main:
            for ep in new:
                add_episode(self.buffer, ep)
                self.online_episodes.append(ep)
        self.synced_episodes = len(self.online_episodes)

    # ------------------------------------------------------------------ phases
    def offline_phase(self) -> bool:
        """Updates on the replay up to ``offline_steps`` (or the stop / time limit); True when stopped
        at ``stop_at`` (preempted: the caller saves and returns)."""
        cfg = self.cfg
        bar = self.tlog.progress(
            cfg.offline_steps, initial=min(self.step, cfg.offline_steps), stage="offline", desc="qam offline"
        )
        self.learner.fine.train()
        self.loop.run(min(cfg.offline_steps, self.stop_at), bar, self.in_time)
        bar.close()
        return self.step >= self.stop_at

    def online_phase(self) -> None:
        """Fine-policy rollouts until ``env_steps``, with ``utd`` updates per env step (after
        ``start_online_after``); saves the offline result first when it is fresh."""
        cfg = self.cfg
        if not (cfg.env_steps > self.env_steps and self.in_time()):
            return
        if cfg.offline_steps and self.step == cfg.offline_steps and self.env_steps == 0:
            self.save()  # the offline result survives a failure online (the final save covers the other cases)
        # under torchrun rank 0 collects and every rank learns: its finished episodes reach the others'
        # replay after each vector step (sync_episodes), before any update samples the replay
        self.phase = "online"
        self.rollouts = rollouts = (
            OnlineRollouts(
                self.learner, self.spec, cfg, self.instruction_emb, self.buffer, self.online_episodes
            )
            if self.dist.is_main
            else None
        )
        bar = self.tlog.progress(
            cfg.env_steps, initial=self.env_steps, stage="online", desc="qam online", unit="env step"
        )
        due = 0.0
        try:
            while self.env_steps < cfg.env_steps and self.step < self.stop_at and self.in_time():
                if rollouts is not None:
                    rollouts.step()
                self.sync_episodes()
                self.env_steps += cfg.num_envs
                bar.update(cfg.num_envs)
                if self.env_steps > cfg.start_online_after:
                    due += cfg.utd * cfg.num_envs
                    while due >= 1.0:
                        self.loop.one()
                        due -= 1.0
        finally:
            if rollouts is not None:
                rollouts.close()
            bar.close()

    def finish(self) -> QAMResult:
        """The final save, metrics (and final evaluation) and the result."""
        cfg, step, env_steps = self.cfg, self.step, self.env_steps
        self.save(final=True)
        metrics: dict[str, Any] = dict(self.loop.metrics)
        metrics.update(
            updates=step,
            timed_out=(step < cfg.offline_steps or env_steps < cfg.env_steps) and step < self.stop_at,
            offline_frames=self.offline_frames,
            online_episodes=len(self.online_episodes),
            online_success=float(np.mean([bool(e["success"]) for e in self.online_episodes]))
            if self.online_episodes
            else None,
        )
        if cfg.final_eval_episodes and self.dist.is_main:
            metrics["eval_success"] = self.evaluate_fine(cfg.final_eval_episodes)
        self.tlog.close()
        seconds = self.clock.seconds
        if self.dist.is_main:
            (cfg.out / "curve.json").write_text(json.dumps(self.curve, indent=1))
        return QAMResult(
            checkpoint=cfg.out / "checkpoints" / "last",
            seconds=seconds,
            steps=step,
            env_steps=env_steps,
            curve=self.curve,
            metrics=metrics,
            data={"selection": self.selection.to_dict(), "env_steps": env_steps},
        )


def train_qam(cfg: QAMConfig) -> QAMResult:
    """Run (or resume) QAM: ``offline_steps`` updates on the store's data, then ``env_steps`` online.

    Under torchrun every process learns on its share of each global batch (see
    :mod:`vla_rl.train.distributed`); rank 0 collects the online episodes and writes checkpoints, the
    train state, the curve and the logs."""
    with distributed(cfg.device) as (dist, device):
        return _train_qam(cfg, dist, device)


def _train_qam(cfg: QAMConfig, dist: Dist, device: torch.device) -> QAMResult:
    run = _QAMRun(cfg, dist, device)
    if run.offline_phase():  # preempted: keep everything needed to resume
        run.save()
        return QAMResult(
            checkpoint=cfg.out / "checkpoints" / "last",
            seconds=run.clock.seconds,
            steps=run.step,
            env_steps=run.env_steps,
            curve=run.curve,
            data={"selection": run.selection.to_dict(), "env_steps": run.env_steps},
        )
    run.online_phase()
    return run.finish()

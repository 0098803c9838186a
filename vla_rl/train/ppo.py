"""PPO fine-tuning of a flow-matching VLA in simulation (π_RL Flow-Noise / Flow-SDE): the trainer.

Its knobs are :class:`~vla_rl.train.ppo_config.PPOConfig`, its equations :mod:`vla_rl.train.ppo_math` and
its sampling and rollouts :mod:`vla_rl.train.ppo_rollout`.

The flow policy is made stochastic by injecting noise into its denoising chain, which gives an exact,
differentiable log-likelihood of the executed action sub-chunk (docs/algorithms.md §3):

* ``method="noise"`` (Flow-Noise / ReinFlow): every one of the K Euler steps draws
  ``x_{k+1} ~ N(x_k + v dt, σ_φ²)`` with σ_φ from the policy's learnable, bounded noise head; the
  log-prob is the exact joint of the chain (initial normal included, a constant), and an entropy
  bonus on the Gaussian steps keeps σ_φ from collapsing.
* ``method="sde"`` (Flow-SDE): π-RL's marginal-preserving SDE ``σ = a sqrt(s / (1 - s))`` (openpi
  time, a = ``noise_level``) on ONE denoising step per policy call, drawn uniformly from the first
  K - 1 (RLinf's ``ignore_last``); every other step is the ODE. The log-prob is that one transition's.

The RL action is the executed sub-chunk (the policy's ``n_exec`` first actions, real dims only) and the
MDP step is one chunk: its reward is the sum of the env rewards over the steps executed. Each robot
keeps a queue of actions (:class:`sim.rollout.ChunkRollout`, as in evaluation); when an episode ends
inside a chunk the chunk is cut there and the robot asks for a fresh chunk for its new episode at once, so
chunks always start at episode step 0, 5, 10, ... and never straddle two episodes. Bootstrapping:
none after a termination (success), ``V(final_obs)`` after a truncation (time limit), ``V(next obs)``
otherwise. A chunk still running when an iteration ends carries over to the next one with its
recorded (behaviour) log-prob, so the PPO ratio stays an importance ratio.

PPO (RLinf's objective): ratio clip 0.2, dual clip 3.0 for negative advantages, clipped value loss,
GAE (γ, λ) = (0.99, 0.95) over chunks, advantages normalised over the batch, several epochs of
minibatches, AdamW with separate actor / critic learning rates and gradient clipping. The critic is a
separate small MLP (not saved in the policy checkpoint): on the normalised state (FlowVLA's default; what
learnt best for the state-only model) or on the policy's detached prefix features (π0.5-style, for camera
models; the default on a LeRobot VLA, RLinf's value head after the VLM prefix).

``advantage="grpo"`` replaces the critic by GRPO: each iteration replays the same initial states
``group_size`` times and every chunk gets its episode's success standardised within its group.

The base is our FlowVLA checkpoint or a LeRobot SmolVLA / π0 / π0.5 policy folder: both run behind
:class:`policies.flow_rl.StochasticFlowPolicy` (chains on the flow-policy contract's ``velocity``,
log-probs over the robot dims only; docs/training.md, RL on LeRobot VLAs).

What is shipped: a derived checkpoint (``save_derived_checkpoint``; lineage algorithm ``flow-noise`` or
``flow-sde``, parent = the base's commit) whose config's ``num_inference_steps`` is the K used in RL,
because the fine-tuned velocity field is tuned for that Euler grid; from a LeRobot base, a LeRobot folder
with that K in its own config, our lineage and the Flow-Noise head beside it. Deployment runs the
deterministic ODE as usual (the injected noise is for exploration only).

Output folder::

    <out>/checkpoints/last/   the fine-tuned policy (plus iter_NNNN/ every ``checkpoint_every`` iterations)
    <out>/critic.pt           the critic's weights (safe to load with weights_only)
    <out>/curve.json          one row per iteration: env steps, rollout success, losses, KL, ...
    <out>/tb/                 TensorBoard logs

Runs are reproducible under ``seed`` (sim seeds, sampling generator and minibatch order are all derived
from it) but not resumable: a stopped run starts over.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from vla_rl_client.spec import RobotSpec

from policies.flow_policy import FlowChunkPolicy, FlowVLAFlowPolicy
from policies.flow_rl import LeRobotStochastic, StochasticFlowPolicy, stochastic_policy
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy, SDESchedule
from policies.loading import LoadedPolicy, load_chunk_policy, pick_device
from vla_rl.hub.checkpoint import Lineage
from vla_rl.train.common import RunClock, save_derived_checkpoint
from vla_rl.train.contract import default_trainable
from vla_rl.train.distributed import SINGLE
from vla_rl.train.loop import IterationLoop, Optimiser, TrainLog, gradient_step
from vla_rl.train.ppo_config import PPOConfig, PPOResult
from vla_rl.train.ppo_math import (
    adapt_lr,
    chunk_discounts,
    gae,
    ppo_policy_loss,
    score_chain,
    stored_chain,
    value_loss,
)
from vla_rl.train.ppo_rollout import Chunk, Rollout, Sampler, ValueFn, collect_groups, stack_obs

log = logging.getLogger(__name__)
Tensor = torch.Tensor

__all__ = ["PPOConfig", "PPOResult", "train_ppo"]


# ============================================================================ training
def _prepare_policy(cfg: PPOConfig, base: LoadedPolicy, device: torch.device) -> FlowVLAPolicy:
    """A trainable copy of the base policy with the RL-time config (K, noise bounds)."""
    d = dict(base.info.model_config)
    d["num_inference_steps"] = cfg.num_steps
    if cfg.noise_std_range is not None:
        d["noise_std_min"], d["noise_std_max"] = cfg.noise_std_range
    d.pop("type", None)
    model_cfg = FlowVLAConfig.from_dict(d)
    if model_cfg.dropout:
        raise ValueError("base: PPO needs dropout = 0 (a chain's log-prob must be a function of the weights)")
    policy = FlowVLAPolicy(model_cfg).to(device)
    policy.load_state_dict(base.policy.state_dict())
    return policy.eval()  # no dropout or augmentation anywhere: rollouts and updates see the same function


@dataclass
class _Base:
    """Where a run starts: the noise-injecting policy, the commit lineage names as its parent, the robot
    spec and task, and (our checkpoint) the info a derived checkpoint copies; None for a LeRobot folder."""

    policy: StochasticFlowPolicy
    commit: str
    spec: RobotSpec
    task: str
    loaded: LoadedPolicy | None


def _load_base(cfg: PPOConfig, device: torch.device) -> _Base:
    """Our checkpoint (rebuilt with the RL-time K and noise bounds) or a LeRobot SmolVLA / π0 / π0.5 folder
    (K written into its config; a non-flow LeRobot type is refused naming it) in the task it names
    (``cfg.task`` must match it; :meth:`~policies.loading.FlowCheckpoint.task`), or ``cfg.task`` for a
    folder that names none."""
    from sim.registry import resolve_task

    base = load_chunk_policy(cfg.base, device=str(device), algorithm=cfg.algorithm)
    if isinstance(base, LoadedPolicy):
        flow = FlowVLAFlowPolicy(_prepare_policy(cfg, base, device), base.spec, base.info)
        rl = stochastic_policy(flow, base.spec.instruction)
        return _Base(rl, base.commit, base.spec, cfg.task or base.spec.name, base)
    task = resolve_task(base.task(resolve_task(cfg.task).name if cfg.task else None))
    lerobot = base.policy
    lerobot.set_num_inference_steps(cfg.num_steps)  # type: ignore[attr-defined]
    rl = stochastic_policy(lerobot, task.instruction, std_range=cfg.noise_std_range)
    return _Base(rl, base.commit, base.spec, task.name, None)


def _actor_params(policy: StochasticFlowPolicy, cfg: PPOConfig) -> list[nn.Parameter]:
    """What the actor's optimiser trains: the config's ``trainable`` parts (LoRA with its ``lora_*``
    settings), by default every trainer's (:func:`~vla_rl.train.contract.default_trainable`: all of our
    FlowVLA, a LeRobot VLA's expert on a CPU), plus the noise head."""
    return policy.actor_parameters(cfg.trainable or default_trainable(policy.policy), cfg.lora_settings())


def _flatten(done: list[list[Chunk]], cfg: PPOConfig) -> tuple[list[Chunk], np.ndarray, np.ndarray]:
    """All completed chunks, their GAE advantages and returns (per robot, in time order)."""
    chunks: list[Chunk] = []
    advs, rets = [], []
    for seq in done:
        if not seq:
            continue
        assert all(c.next_value is not None for c in seq)
        a, r = gae(
            np.array([c.reward for c in seq]),
            np.array([c.value for c in seq]),
            np.array([c.next_value for c in seq]),
            np.array([c.terminated for c in seq]),
            np.array([c.terminated or c.truncated for c in seq]),
            chunk_discounts(np.array([c.steps for c in seq]), cfg.gamma, cfg.discount),
            cfg.gae_lambda,
        )
        chunks += seq
        advs.append(a)
        rets.append(r)
    return chunks, np.concatenate(advs), np.concatenate(rets)


def train_ppo(cfg: PPOConfig) -> PPOResult:
    """Fine-tune ``cfg.base`` with PPO in simulation; see the module docstring.

    ``curve`` rows: ``iteration, env_steps`` (cumulative), ``episodes`` finished in the iteration and
    their ``rollout_success`` (noise-injected policy), ``chunks`` and their mean ``chunk_return``, the
    mean ``policy_loss, value_loss, entropy, approx_kl, clipfrac`` over minibatches, ``explained_var``
    of the rollout values, the Flow-Noise ``noise_std``, ``epochs_run`` and ``seconds``. Losses are NaN
    in critic warm-up iterations.
    """
    from sim.vector import VectorSimEnv

    clock = RunClock()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    base = _load_base(cfg, device)
    policy, task, spec = base.policy, base.task, base.spec
    value_fn = ValueFn(cfg, policy)
    actor_params = _actor_params(policy, cfg)
    critic_params = list(value_fn.net.parameters())
    betas = (0.9, 0.95)
    actor_opt = torch.optim.AdamW(actor_params, lr=cfg.actor_lr, betas=betas, weight_decay=cfg.weight_decay)
    critic_opt = torch.optim.AdamW(
        critic_params, lr=cfg.critic_lr, betas=betas, weight_decay=cfg.weight_decay
    )

    cfg.out.mkdir(parents=True, exist_ok=True)
    tlog = TrainLog(cfg, SINGLE, purge_step=None, config_step=0, finite_only=True)
    env = VectorSimEnv(
        task,
        num_envs=cfg.num_envs,
        seed=cfg.env_seed,
        obs="rgb" if spec.cameras else "state",
        image_size=spec.cameras[0].height if spec.cameras else 128,
        max_episode_steps=cfg.max_episode_steps,
        ray=cfg.ray,
    )
    if env.spec.state_dim != spec.state_dim or env.spec.camera_names != spec.camera_names:
        env.close()
        raise ValueError(
            f"task: {task} (state {env.spec.state_dim}, cameras {list(env.spec.camera_names)}) does not match "
            f"the base policy's spec {spec.name} (state {spec.state_dim}, cameras {list(spec.camera_names)})"
        )
    log.info(
        "ppo start",
        extra={
            "task": task,
            "base": cfg.base,
            "method": cfg.method,
            "K": cfg.num_steps,
            "num_envs": cfg.num_envs,
            "env_steps": cfg.env_steps,
            "params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        },
    )
    sampler = Sampler(cfg, policy, value_fn)
    rollout = Rollout(cfg, env, sampler) if cfg.advantage == "gae" else None
    episodes_total = 0

    def iterate() -> dict[str, Any]:
        """Collect (GAE: ``rollout_steps`` vector steps, chunks in flight carry over; GRPO: groups of
        replays from fresh initial states), then PPO epochs on what was collected; the curve row."""
        nonlocal episodes_total
        if cfg.advantage == "grpo":
            seed = cfg.env_seed + loop.iteration * cfg.num_envs  # fresh initial states every iteration
            chunks, adv, episodes, taken = collect_groups(cfg, env, sampler, seed)
            ret = np.zeros_like(adv)
        else:
            steps = min(cfg.rollout_steps, math.ceil((cfg.env_steps - loop.env_steps) / cfg.num_envs))
            assert rollout is not None
            taken = rollout.collect(steps)
            done, episodes = rollout.take()
            chunks, adv, ret = _flatten(done, cfg)
        loop.collected(taken)
        episodes_total += len(episodes)
        lr_used = actor_opt.param_groups[0]["lr"]
        stats = _update(cfg, policy, value_fn, chunks, adv, ret, actor_opt, critic_opt, loop.iteration)
        if cfg.adaptive_kl is not None:
            lr_next = adapt_lr(lr_used, stats["approx_kl"], cfg.adaptive_kl, cfg.adaptive_lr_bounds)
            for g in actor_opt.param_groups:
                g["lr"] = lr_next
        return {
            "iteration": loop.iteration,
            "env_steps": loop.env_steps,
            "actor_lr": lr_used,
            "episodes": len(episodes),
            "rollout_success": float(np.mean(episodes)) if episodes else float("nan"),
            "chunk_return": float(np.mean([c.reward for c in chunks])) if chunks else float("nan"),
            "chunks": len(chunks),
            **stats,
        }

    loop = IterationLoop(
        "ppo",
        "ppo",
        tlog,
        clock,
        cfg.env_steps,
        max_minutes=cfg.max_minutes,
        postfix=lambda row: {"succ": f"{row['rollout_success']:.0%}", "kl": f"{row['approx_kl']:.4f}"},
        checkpoint_every=cfg.checkpoint_every,
        on_checkpoint=lambda i: _save(
            cfg, base, cfg.out / "checkpoints" / f"iter_{i:04d}", loop.env_steps, tlog.curve, {}
        ),
    )
    tlog.progress(cfg.env_steps, stage="online", desc=f"ppo {cfg.algorithm}", unit="env step")
    try:
        loop.run(iterate)
    finally:
        tlog.close()
        env.close()

    env_steps, iteration, curve = loop.env_steps, loop.iteration, tlog.curve
    metrics: dict[str, Any] = {
        "env_steps": env_steps,
        "iterations": iteration,
        "episodes": episodes_total,
        "stopped_by_time": env_steps < cfg.env_steps,
        "actor_lr_final": actor_opt.param_groups[0]["lr"],
    }
    tail = [r["rollout_success"] for r in curve[-3:] if math.isfinite(r["rollout_success"])]
    metrics["rollout_success_last3"] = float(np.mean(tail)) if tail else float("nan")
    if cfg.final_eval_episodes:
        from vla_rl.evaluation import evaluate

        ev = evaluate(
            _eval_view(base, cfg),
            task,
            episodes=cfg.final_eval_episodes,
            num_envs=cfg.num_envs,
            seed=cfg.final_eval_seed,
            progress=cfg.progress,
            ray=cfg.ray,
        )
        metrics.update(eval_success=ev.success_rate, eval_episodes=ev.episodes, eval_seed=cfg.final_eval_seed)
    ckpt = _save(cfg, base, cfg.out / "checkpoints" / "last", env_steps, curve, metrics)
    torch.save(value_fn.net.state_dict(), cfg.out / "critic.pt")
    (cfg.out / "curve.json").write_text(json.dumps(curve, indent=1))
    seconds = clock.seconds
    metrics["seconds"] = seconds
    log.info(
        "ppo done", extra={"checkpoint": str(ckpt), **{k: v for k, v in metrics.items() if k != "seconds"}}
    )
    return PPOResult(
        checkpoint=ckpt,
        seconds=seconds,
        metrics=metrics,
        curve=curve,
        data={"env_steps": env_steps, "episodes": episodes_total},
        env_steps=env_steps,
        iterations=iteration,
        episodes=episodes_total,
    )


def _eval_view(base: _Base, cfg: PPOConfig) -> Any:
    """The fine-tuned policy as the evaluator runs it (our checkpoint's own loaded view, or a LeRobot VLA's)."""
    if base.loaded is not None:
        model = base.policy.policy.model  # type: ignore[attr-defined]
        return LoadedPolicy(
            policy=model, info=base.loaded.info, path=cfg.out, commit="unsaved", ref=str(cfg.out)
        )
    return FlowChunkPolicy(base.policy.policy, base.spec)


def _save(
    cfg: PPOConfig,
    base: _Base,
    path: Path,
    env_steps: int,
    curve: list[dict[str, float]],
    metrics: Mapping[str, Any],
) -> Path:
    """Our derived checkpoint, or a LeRobot policy folder (its ``config.json`` says the RL-time K) with our
    lineage beside it and the Flow-Noise head (:data:`policies.flow_rl.NOISE_HEAD_FILE`)."""
    if path.exists():
        shutil.rmtree(path)
    data = {
        "base_ref": cfg.base,
        "task": base.task,
        "env_steps": env_steps,
        "method": cfg.method,
        "num_steps": cfg.num_steps,
        "reward": cfg.reward,
        "num_envs": cfg.num_envs,
        "seed": cfg.seed,
    }
    metrics = {**metrics, "env_steps": env_steps, "iterations": len(curve)}
    rl = base.policy
    if base.loaded is None:
        assert isinstance(rl, LeRobotStochastic)
        lineage = Lineage(cfg.algorithm, parent_revision=base.commit, round=cfg.round_index, data=data)
        rl.policy.save(path, lineage=lineage, metrics=metrics)
        rl.save_noise_head(path)
        return path
    save_derived_checkpoint(
        path,
        rl.policy.model,  # type: ignore[attr-defined]
        base.loaded.info,
        algorithm=cfg.algorithm,
        parent_revision=base.commit,
        data=data,
        metrics=metrics,
        round_index=cfg.round_index,
    )
    return path


def _update(
    cfg: PPOConfig,
    policy: StochasticFlowPolicy,
    value_fn: ValueFn,
    chunks: list[Chunk],
    adv: np.ndarray,
    ret: np.ndarray,
    actor_opt: torch.optim.Optimizer,
    critic_opt: torch.optim.Optimizer,
    iteration: int,
) -> dict[str, float]:
    """PPO epochs over minibatches of this iteration's chunks; returns averaged diagnostics."""
    nan = float("nan")
    if not chunks:
        return dict.fromkeys(
            ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_var", "noise_std"),
            nan,
        )
    device = policy.device
    m = len(chunks)
    iterates = torch.as_tensor(np.stack([c.iterates for c in chunks]), device=device)
    stochastic = torch.as_tensor(np.stack([c.stochastic for c in chunks]), device=device)
    logp_old = torch.as_tensor([c.logp for c in chunks], device=device, dtype=torch.float32)
    v_old = torch.as_tensor([c.value for c in chunks], device=device, dtype=torch.float32)
    returns = torch.as_tensor(ret, device=device, dtype=torch.float32)
    advantages = torch.as_tensor(adv, device=device, dtype=torch.float32)
    grpo = cfg.advantage == "grpo"
    if m > 1 and not grpo:  # GRPO advantages are already standardised within their groups
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    norm = 1.0
    if cfg.logprob_reduction == "mean":
        norm = float(cfg.num_steps + 1) if cfg.method == "noise" else 1.0
    train_actor = grpo or iteration >= cfg.critic_warmup_iterations
    schedule = SDESchedule("flow_sde", cfg.noise_level) if cfg.method == "sde" else None
    rng = np.random.default_rng([cfg.seed, 2, iteration])
    optimisers = [
        Optimiser(actor_opt, {"actor": _params(actor_opt)}, cfg.grad_clip),
        Optimiser(critic_opt, {"critic": _params(critic_opt)}, cfg.grad_clip),
    ]
    sums: dict[str, float] = {}
    count = 0
    stop = False
    for _epoch in range(cfg.update_epochs):
        perm = rng.permutation(m)
        for start in range(0, m, cfg.minibatch_size):
            mb = perm[start : start + cfg.minibatch_size]
            mb_t = torch.as_tensor(mb, device=device)
            obs = stack_obs([chunks[i].obs for i in mb])
            stats: dict[str, Tensor] = {}
            prefix = None
            loss = torch.zeros((), device=device)
            if train_actor:
                prefix = policy.encode_prefix(obs)
                chain = stored_chain(iterates[mb_t], stochastic[mb_t], cfg.method, schedule, policy.n_exec)
                logp, entropy = score_chain(policy, prefix, chain)
                pl, stats = ppo_policy_loss(
                    logp[:, 0] / norm, logp_old[mb_t] / norm, advantages[mb_t], cfg.clip, cfg.dual_clip
                )
                loss = pl
                stats["policy_loss"] = pl.detach()
                if entropy is not None:
                    loss = loss - cfg.entropy_coef * entropy
                    stats["entropy"] = entropy.detach()
            if not grpo:  # GRPO has no critic
                if value_fn.kind == "prefix" and (prefix is None or not cfg.critic_detach):
                    prefix = policy.encode_prefix(obs)
                v = value_fn(obs, prefix)
                vl = value_loss(v, v_old[mb_t], returns[mb_t], cfg.value_clip)
                stats["value_loss"] = vl.detach()
                loss = loss + vl
            # one backward: actor and critic own disjoint parameters (a prefix critic with
            # critic_detach=False also trains the trunk, on purpose)
            gradient_step(loss, optimisers, SINGLE, [train_actor, not grpo])
            for k, val in stats.items():
                sums[k] = sums.get(k, 0.0) + float(val)
            count += 1
            if train_actor and cfg.target_kl is not None and float(stats["approx_kl"]) > cfg.target_kl:
                stop = True
                break
        if stop:
            break
    out = {
        k: sums.get(k, 0.0) / max(count, 1) if k in sums else nan
        for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac")
    }
    var = float(returns.var()) if m > 1 else nan
    out["explained_var"] = (
        1.0 - float((returns - v_old).var()) / var if m > 1 and var > 0 and not grpo else nan
    )
    out["noise_std"] = _mean_noise_std(policy, chunks[: cfg.minibatch_size]) if cfg.method == "noise" else nan
    out["epochs_run"] = float(_epoch + 1)
    return out


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@torch.no_grad()
def _mean_noise_std(policy: StochasticFlowPolicy, chunks: list[Chunk]) -> float:
    """Mean learned std over the executed actions' robot dims of a few stored chains (is exploration
    collapsing?)."""
    prefix = policy.encode_prefix(stack_obs([c.obs for c in chunks]))
    x = torch.as_tensor(np.stack([c.iterates[0] for c in chunks]), device=policy.device)
    _, std = policy.velocity_and_std(prefix, x, 0.0)
    return float(std[:, : policy.n_exec, : policy.action_dim].mean())

"""PPO for flow VLAs: hand-computed GAE / clipped objectives, exact chain re-scoring (first ratio = 1),
the chunk rollout bookkeeping (cut chunks, bootstraps, carry-over), and a short run in the real sim."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.spec import RobotSpec

from policies.flow_policy import FlowVLAFlowPolicy
from policies.flow_rl import FlowVLAStochastic
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy, SDESchedule
from policies.loading import load_policy
from sim.registry import resolve_task
from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, load_checkpoint, read_info, save_checkpoint
from vla_rl.train.ppo import PPOConfig, train_ppo
from vla_rl.train.ppo_math import (
    adapt_lr,
    chunk_discounts,
    gae,
    group_advantages,
    ppo_policy_loss,
    score_chain,
    stored_chain,
    value_loss,
)
from vla_rl.train.ppo_rollout import Rollout, Sampler, ValueFn, collect_groups

torch.set_num_threads(1)
TASK = "maniskill/PushCube-v1"


def tiny_policy(state_dim: int = 3, action_dim: int = 2, seed: int = 0, **kw: Any) -> FlowVLAPolicy:
    torch.manual_seed(seed)
    cfg = dict(
        state_dim=state_dim,
        action_dim=action_dim,
        chunk_len=4,
        n_exec=2,
        d_model=16,
        n_layers=1,
        expert_n_layers=1,
        n_heads=2,
        instruction_encoder="none",
        num_inference_steps=3,
    )
    cfg.update(kw)
    return FlowVLAPolicy(FlowVLAConfig(**cfg)).eval()


def as_rl(policy: FlowVLAPolicy) -> FlowVLAStochastic:
    """The policy as PPO holds it: behind the flow contract, with noise-injected chains."""
    c = policy.config
    return FlowVLAStochastic(
        FlowVLAFlowPolicy(policy, RobotSpec("toy", c.state_dim, c.action_dim, 10.0, "x")), "x"
    )


# ----------------------------------------------------------------------------- GAE
def test_gae_matches_hand_computation_across_termination_and_truncation() -> None:
    # One robot, 5 chunks: t2 ends in success (terminated), t3 is cut by the time limit (truncated,
    # bootstrapped from V(final_obs) = 0.4), t4 starts a new episode and is where the rollout stops.
    rewards = np.array([0.0, 0.0, 1.0, 0.5, 0.0])
    values = np.array([0.5, 0.6, 0.7, 0.2, 0.3])
    next_values = np.array([0.6, 0.7, 9.0, 0.4, 0.1])  # 9.0 after a termination must be ignored
    terminated = np.array([0, 0, 1, 0, 0], dtype=bool)
    ended = np.array([0, 0, 1, 1, 0], dtype=bool)
    adv, ret = gae(rewards, values, next_values, terminated, ended, gamma=0.9, lam=0.8)
    # δ = r + γ (1 - term) V_next - V
    d0, d1, d2, d3, d4 = 0.04, 0.03, 0.3, 0.5 + 0.9 * 0.4 - 0.2, 0.9 * 0.1 - 0.3
    a2 = d2  # terminal: nothing flows back from t3
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    expected = np.array([a0, a1, a2, d3, d4])  # t3 ends its episode: t4's advantage does not leak into it
    np.testing.assert_allclose(adv, expected, atol=1e-12)
    np.testing.assert_allclose(adv, [0.21712, 0.246, 0.3, 0.66, -0.21], atol=1e-12)
    np.testing.assert_allclose(ret, expected + values, atol=1e-12)

    # Batched [T, N] equals column by column; per-chunk discounts γ^steps.
    g = chunk_discounts(np.array([5, 5, 3, 5, 2]), 0.99, "step")
    np.testing.assert_allclose(g, 0.99 ** np.array([5, 5, 3, 5, 2]))
    np.testing.assert_allclose(chunk_discounts(np.array([5, 3]), 0.99, "chunk"), [0.99, 0.99])
    cols = [
        gae(rewards, values, next_values, terminated, ended, g, 0.95)[0],
        gae(rewards[::-1], values, next_values, ended, ended, g, 0.95)[0],
    ]
    batched, _ = gae(
        np.stack([rewards, rewards[::-1]], 1),
        np.stack([values] * 2, 1),
        np.stack([next_values] * 2, 1),
        np.stack([terminated, ended], 1),
        np.stack([ended] * 2, 1),
        np.stack([g] * 2, 1),
        0.95,
    )
    np.testing.assert_allclose(batched, np.stack(cols, 1), atol=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        gae(rewards, values[:3], next_values, terminated, ended, 0.9, 0.9)


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize(
    ("ratio", "adv", "expected", "grad_flows"),
    [
        (1.1, 1.0, -1.1, True),  # inside the clip: -A r
        (1.5, 1.0, -1.2, False),  # A > 0, ratio above 1 + ε: clipped, no gradient
        (0.5, 1.0, -0.5, True),  # A > 0, ratio below 1 - ε: the pessimistic unclipped term
        (0.5, -1.0, 0.8, False),  # A < 0, ratio below 1 - ε: clipped at 1 - ε
        (1.5, -1.0, 1.5, True),  # A < 0, above 1 + ε but under the dual clip: unclipped
        (5.0, -1.0, 3.0, False),  # A < 0, ratio beyond c = 3: dual clip caps the loss at -c A
        (5.0, -2.0, 6.0, False),
    ],
)
def test_ppo_policy_loss_hand_values(ratio: float, adv: float, expected: float, grad_flows: bool) -> None:
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, m = ppo_policy_loss(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv]), 0.2, 3.0)
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    loss.backward()
    assert logp.grad is not None
    if grad_flows:  # d(-A r)/d logp = -A r
        assert logp.grad.item() == pytest.approx(-adv * ratio, abs=1e-9)
    else:
        assert logp.grad.item() == 0.0
    assert m["ratio"].item() == pytest.approx(ratio)
    assert m["clipfrac"].item() == float(abs(ratio - 1) > 0.2)


def test_ppo_policy_loss_batch_mean_and_no_dual_clip() -> None:
    ratios = torch.tensor([1.1, 1.5, 5.0, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, 0.0])
    loss, m = ppo_policy_loss(ratios.log(), torch.zeros(4), adv, 0.2, 3.0)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 3.0 + 0.0) / 4, abs=1e-6)
    assert m["dual_clipfrac"].item() == pytest.approx(0.25)
    loss_off, _ = ppo_policy_loss(ratios.log(), torch.zeros(4), adv, 0.2, 0.0)
    assert loss_off.item() == pytest.approx((-1.1 - 1.2 + 5.0) / 4, abs=1e-6)
    same, m1 = ppo_policy_loss(torch.full((3,), -2.0), torch.full((3,), -2.0), torch.ones(3))
    assert m1["ratio"].item() == 1.0 and m1["approx_kl"].item() == 0.0 and same.item() == -1.0


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        (0.03, 1e-5 / 1.5),  # over twice the desired 0.01: smaller
        (0.004, 1e-5 * 1.5),  # under half of it: larger
        (0.01, 1e-5),  # in between: kept
        (0.019, 1e-5),
        (float("nan"), 1e-5),  # no actor update this iteration (critic warm-up): kept
    ],
)
def test_adapt_lr_hand_values(kl: float, expected: float) -> None:
    assert adapt_lr(1e-5, kl, 0.01, (1e-7, 1e-4)) == pytest.approx(expected)


def test_adapt_lr_stays_within_its_bounds() -> None:
    assert adapt_lr(9e-5, 0.0, 0.01, (1e-7, 1e-4)) == 1e-4
    assert adapt_lr(1.2e-7, 1.0, 0.01, (1e-7, 1e-4)) == 1e-7


def test_value_loss_clip_hand_values() -> None:
    v, v_old = torch.tensor([1.0]), torch.tensor([0.5])
    # target 0.8: unclipped error 0.04 > clipped (0.7 - 0.8)² = 0.01 -> 0.5 * 0.04
    assert value_loss(v, v_old, torch.tensor([0.8]), 0.2).item() == pytest.approx(0.02)
    # target 1.2: clipped prediction 0.7 is further away -> 0.5 * 0.25 (no credit for the big jump)
    assert value_loss(v, v_old, torch.tensor([1.2]), 0.2).item() == pytest.approx(0.125)
    assert value_loss(v, v_old, torch.tensor([1.2]), 0.0).item() == pytest.approx(0.5 * 0.04)
    vv = torch.tensor([1.0], requires_grad=True)
    value_loss(vv, v_old, torch.tensor([1.2]), 0.2).backward()
    assert vv.grad is not None and vv.grad.item() == 0.0  # the clipped branch is constant in v


def test_group_advantages() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), np.array([0, 0, 0, 0, 7, 7]))
    std = math.sqrt(0.1875)
    np.testing.assert_allclose(adv[:4], [0.25 / std, -0.75 / std, 0.25 / std, 0.25 / std], rtol=1e-5)
    np.testing.assert_allclose(adv[4:], [0.0, 0.0])  # all-equal group: no signal


# ----------------------------------------------------------------------------- chain log-probs
@pytest.mark.parametrize("method", ["noise", "sde", "sde-all"])
def test_stored_chain_rescores_to_the_recorded_log_prob(method: str) -> None:
    """What the sampler records, rebuilt as _update does, scores to the same log-prob: PPO's first ratio
    is exactly 1. A parameter change moves it (the score is a function of the weights)."""
    policy = tiny_policy(num_inference_steps=4)
    sde_steps = "all" if method == "sde-all" else "one"
    method = method.removesuffix("-all")
    cfg = PPOConfig(
        base="unused", out=Path("unused"), method=method, num_steps=4, seed=3, sde_steps=sde_steps
    )
    rl = as_rl(policy)
    sampler = Sampler(cfg, rl, ValueFn(cfg, rl))
    rng = np.random.default_rng(0)
    rows = [{"state": rng.normal(size=3).astype(np.float32), "cameras": {}} for _ in range(5)]
    chunks = []
    for _ in range(3):  # several calls: Flow-SDE draws a different stochastic step per call
        c, actions = sampler.act(rows)
        chunks += c
        assert actions.shape == (5, 2, 2)
    if method == "sde" and sde_steps == "all":
        assert all(c.stochastic.all() for c in chunks)  # the exact joint: every step draws noise
    elif method == "sde":
        steps = {int(np.flatnonzero(c.stochastic)[0]) for c in chunks}
        assert all(c.stochastic.sum() == 1 for c in chunks) and steps <= {0, 1, 2}  # never the last
    iterates = torch.as_tensor(np.stack([c.iterates for c in chunks]))
    stochastic = torch.as_tensor(np.stack([c.stochastic for c in chunks]))
    schedule = SDESchedule("flow_sde", 0.5) if method == "sde" else None
    chain = stored_chain(iterates, stochastic, method, schedule, policy.config.n_exec)
    prefix = policy.encode_prefix({"state": np.stack([r["state"] for _ in range(3) for r in rows])})
    logp, entropy = score_chain(rl, prefix, chain)
    recorded = torch.tensor([c.logp for c in chunks])
    torch.testing.assert_close(logp[:, 0], recorded, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)
    torch.testing.assert_close(policy.chain_log_prob(prefix, chain), logp.detach())
    _, m = ppo_policy_loss(logp[:, 0], recorded, torch.ones(len(chunks)))
    assert m["ratio"].item() == pytest.approx(1.0, abs=1e-4)
    if method == "noise":
        assert entropy is not None
        # std in [0.08, 0.16]: the per-element Gaussian entropy is between these bounds
        lo, hi = (0.5 * math.log(2 * math.pi * math.e * s * s) for s in (0.08, 0.16))
        assert lo <= entropy.item() <= hi
    else:
        assert entropy is None
    logp.sum().backward()
    grads = [p.grad for p in policy.expert.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        policy.expert.action_out.bias.add_(0.05)
    assert not torch.allclose(policy.chain_log_prob(prefix, chain)[:, 0], recorded, atol=1e-3)


@pytest.mark.parametrize("method", ["noise", "sde", "sde-all"])
def test_ppo_updates_climb_a_reward_on_the_executed_actions(method: str) -> None:
    """The whole policy-gradient path (sampler -> stored chain -> re-scored log-prob -> clipped loss ->
    AdamW) must move the *executed* actions towards what the advantage rewards: here the first executed
    action's dim 0 (a one-step bandit, no env, no critic). A sign slip, a chain/advantage misalignment or
    a log-prob that ignores the executed part would leave it flat or push it down."""
    policy = tiny_policy(num_inference_steps=4, seed=1)
    sde_steps = "all" if method == "sde-all" else "one"
    method = method.removesuffix("-all")
    cfg = PPOConfig(
        base="unused", out=Path("unused"), method=method, num_steps=4, seed=0, sde_steps=sde_steps
    )
    rl = as_rl(policy)
    sampler = Sampler(cfg, rl, ValueFn(cfg, rl))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, betas=(0.9, 0.95))
    schedule = SDESchedule("flow_sde", cfg.noise_level) if method == "sde" else None
    rng = np.random.default_rng(0)
    rows = [{"state": rng.normal(size=3).astype(np.float32), "cameras": {}} for _ in range(8)] * 8

    def first_action_dim0() -> float:
        return float(
            policy.predict_action_chunk({"state": np.stack([r["state"] for r in rows[:8]])})[:, 0, 0].mean()
        )

    before = first_action_dim0()
    for _ in range(12):
        chunks, actions = sampler.act(rows)
        r = actions[:, 0, 0]
        adv = torch.as_tensor((r - r.mean()) / (r.std() + 1e-8), dtype=torch.float32)
        chain = stored_chain(
            torch.as_tensor(np.stack([c.iterates for c in chunks])),
            torch.as_tensor(np.stack([c.stochastic for c in chunks])),
            method,
            schedule,
            policy.config.n_exec,
        )
        old = torch.tensor([c.logp for c in chunks])
        for _epoch in range(2):
            prefix = policy.encode_prefix({"state": np.stack([c.obs["state"] for c in chunks])})
            logp, _ = score_chain(rl, prefix, chain)
            loss, _ = ppo_policy_loss(logp[:, 0], old, adv)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    after = first_action_dim0()
    # deterministic (ODE) actions, env units in [-1, 1]: a clear climb, not noise
    assert after > before + 0.3, f"{method}/{sde_steps}: dim-0 action {before:.3f} -> {after:.3f}"


# ----------------------------------------------------------------------------- rollout bookkeeping
class ScriptedEnv:
    """Two scripted robots: robot 0 succeeds on the 3rd step of every episode (inside a 2-action chunk),
    robot 1 never does and is truncated at step 6. State = [robot, episode step, episode count]."""

    num_envs = 2
    max_episode_steps = 6

    def __init__(self, robot1_wins_after_reset: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.t = np.zeros(2, dtype=int)
        self.ep = np.zeros(2, dtype=int)
        self.actions: list[np.ndarray] = []
        self.resets: list[int | None] = []
        self.robot1_wins = robot1_wins_after_reset  # after the n-th reset() robot 1 succeeds at step 4

    def _obs(self) -> dict[str, Any]:
        state = np.stack([[i, self.t[i], self.ep[i]] for i in range(2)]).astype(np.float32)
        return {"state": state, "cameras": {}, "instruction": ["x", "x"]}

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        self.resets.append(seed)
        self.t[:] = 0
        return self._obs(), {}

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        assert actions.shape == (2, 2)
        self.actions.append(actions)
        self.t += 1
        success = np.array([self.t[0] == 3, self.t[1] == 4 and len(self.resets) - 1 in self.robot1_wins])
        truncated = np.array([False, self.t[1] >= 6 and not success[1]])
        final = {}
        for i in np.flatnonzero(success | truncated):
            final[int(i)] = {"state": self._obs()["state"][i], "cameras": {}, "instruction": "x"}
            self.t[i], self.ep[i] = 0, self.ep[i] + 1
        info = {
            "success": success,
            "sparse_reward": success.astype(np.float32),
            "dense_reward": np.full(2, 0.25, dtype=np.float32),
            "final_obs": final,
        }
        return self._obs(), success.astype(np.float32), success, truncated, info


@pytest.mark.parametrize("reward", ["sparse", "dense"])
def test_rollout_cuts_chunks_bootstraps_and_carries_over(reward: str) -> None:
    policy = tiny_policy()
    cfg = PPOConfig(base="unused", out=Path("unused"), reward=reward, seed=1)
    rl = as_rl(policy)
    value_fn = ValueFn(cfg, rl)
    torch.nn.init.normal_(value_fn.net.net[-1].weight)  # a non-trivial critic so values are distinguishable
    sampler = Sampler(cfg, rl, value_fn)
    env = ScriptedEnv()
    rollout = Rollout(cfg, env, sampler)
    assert rollout.collect(6) == 12
    done, episodes = rollout.take()
    assert episodes == [True, True, False]  # robot 0 twice (steps 3 and 6), then robot 1's time limit

    def approx(x: float) -> Any:  # values from batches of 1 vs 2: float32 kernels differ (tolerances.py)
        return pytest.approx(x, rel=RECOMPUTED_RTOL, abs=RECOMPUTED_ATOL)

    def v(state: list[float]) -> float:
        return float(sampler.values([{"state": np.array(state, dtype=np.float32), "cameras": {}}])[0])

    r0, r1 = done
    # Robot 0: chunk (steps 1-2), chunk cut after 1 step by success, then the same in episode 2.
    assert [c.steps for c in r0] == [2, 1, 2, 1]
    assert [c.terminated for c in r0] == [False, True, False, True]
    assert [float(c.obs["state"][1]) for c in r0] == [0, 2, 0, 2]  # the new episode starts a new chunk
    if reward == "sparse":
        assert [c.reward for c in r0] == [0.0, 1.0, 0.0, 1.0]
    else:  # success + γ Φ(s') - Φ(s) with Φ = the dense reward (0.25), 0 at reset and after success
        np.testing.assert_allclose([c.reward for c in r0], [0.99 * 0.25, 1 - 0.25, 0.99 * 0.25, 1 - 0.25])
    assert r0[0].next_value == approx(r0[1].value) and r0[1].next_value == 0.0
    assert r0[0].value == approx(v([0, 0, 0])) and r0[1].value == approx(v([0, 2, 0]))
    # Robot 1: three full chunks, the last truncated and bootstrapped from the final observation.
    assert [c.steps for c in r1] == [2, 2, 2] and [c.truncated for c in r1] == [False, False, True]
    shaped = [0.99 * 0.25, 0.99 * 0.25 - 0.25, 0.99 * 0.25 - 0.25]  # truncation keeps Φ(final obs)
    np.testing.assert_allclose([c.reward for c in r1], shaped if reward == "dense" else [0, 0, 0])
    assert r1[0].next_value == approx(r1[1].value)
    assert r1[2].next_value == approx(v([1, 6, 0])) and r1[2].next_value != approx(r1[2].value)
    # The executed actions are the first n_exec of each chunk (identity normalisation, clipped to [-1, 1]).
    first = np.clip(r0[0].iterates[-1, :2], -1, 1)
    np.testing.assert_allclose(np.stack([a[0] for a in env.actions[:2]]), first, atol=1e-6)

    # Odd step counts leave a chunk in flight; it completes in the next iteration with its old record.
    assert rollout.collect(1) == 2
    assert [len(s) for s in rollout.take()[0]] == [0, 0]
    pending = rollout.pending[0]
    rollout.collect(1)
    done2, _ = rollout.take()
    assert len(done2[0]) == 1 and done2[0][0] is pending and pending is not None and pending.steps == 2


def test_grpo_groups_replay_initial_states_and_standardise_success() -> None:
    policy = tiny_policy()
    cfg = PPOConfig(base="unused", out=Path("unused"), advantage="grpo", group_size=3, seed=2)
    rl = as_rl(policy)
    sampler = Sampler(cfg, rl, ValueFn(cfg, rl))
    env = ScriptedEnv(robot1_wins_after_reset={0, 2})  # robot 1 wins in rounds 0 and 2, loses round 1
    chunks, adv, episodes, steps = collect_groups(cfg, env, sampler, seed=77)
    assert env.resets == [77, 77, 77]  # every round starts from the same initial states
    assert episodes == [True, True, True, False, True, True]  # (round, robot) order
    # rounds 0 and 2: both robots done after 4 steps (robot 0 keeps acting in its next episode, untrained);
    # round 1: robot 1 runs to its time limit at 6
    assert steps == 2 * (4 + 6 + 4)
    robot = [int(c.obs["state"][0]) for c in chunks]
    assert robot == [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1]  # first episodes only: 2 + 2, 2 + 3, 2 + 2 chunks
    std = np.std([1.0, 0.0, 1.0])
    win, loss = (1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6)
    expected = [0, 0, win, win, 0, 0, loss, loss, loss, 0, 0, win, win]  # robot 0 always wins: no signal
    np.testing.assert_allclose(adv, expected, atol=1e-6)


# ----------------------------------------------------------------------------- config
def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="method"):
        PPOConfig(base="b", out=Path("o"), method="ddpm")
    with pytest.raises(ValueError, match="num_steps"):
        PPOConfig(base="b", out=Path("o"), method="sde", num_steps=1)
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(base="b", out=Path("o"), dual_clip=0.5)
    with pytest.raises(ValueError, match="noise_std_range"):
        PPOConfig(base="b", out=Path("o"), noise_std_range=(0.2, 0.1))
    with pytest.raises(ValueError, match="actor_lr: expected a finite number"):
        PPOConfig(base="b", out=Path("o"), actor_lr=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="advantage"):
        PPOConfig(base="b", out=Path("o"), advantage="vtrace")
    with pytest.raises(ValueError, match="max_minutes: expected a positive number"):
        PPOConfig(base="b", out=Path("o"), max_minutes=0)
    with pytest.raises(ValueError, match="adaptive_kl: expected a positive"):
        PPOConfig(base="b", out=Path("o"), adaptive_kl=-0.01)
    with pytest.raises(ValueError, match="adaptive_lr_bounds"):
        PPOConfig(base="b", out=Path("o"), adaptive_lr_bounds=(1e-4, 1e-6))
    assert PPOConfig(base="b", out=Path("o"), method="sde").algorithm == "flow-sde"


# ----------------------------------------------------------------------------- end to end
def _sim_checkpoint(folder: Path) -> Path:
    info = resolve_task(TASK)
    spec = RobotSpec(TASK, info.state_dim["state"], info.action_dim, info.control_hz, info.instruction)
    policy = tiny_policy(spec.state_dim, spec.action_dim, chunk_len=4, n_exec=2, num_inference_steps=6)
    ci = CheckpointInfo("flow_vla", policy.config.to_dict(), spec, {}, Lineage("sft"))
    save_checkpoint(folder, policy.state_dict(), ci)
    return folder


@pytest.mark.parametrize("method", ["noise", pytest.param("sde", marks=pytest.mark.slow)])
def test_train_ppo_end_to_end(method: str, tmp_path: Path) -> None:
    """Two real sim robots, two iterations (critic warm-up, then PPO): the shipped checkpoint's lineage,
    loadability, K, and a finite curve. The slow variant also evaluates the result (more processes)."""
    base = _sim_checkpoint(tmp_path / "base")
    cfg = PPOConfig(
        base=str(base),
        out=tmp_path / "run",
        method=method,
        num_steps=3,
        num_envs=2,
        env_steps=40,
        rollout_steps=10,
        max_episode_steps=8,  # truncations (and their bootstraps) inside the tiny budget
        minibatch_size=4,
        update_epochs=2,
        critic_warmup_iterations=1,
        reward="dense",  # a random policy never succeeds: sparse rewards would give zero advantages
        final_eval_episodes=2 if method == "sde" else 0,
        actor_lr=1e-3,
        adaptive_kl=0.01,
        round_index=2,
        progress=False,
    )
    result = train_ppo(cfg)
    assert result.env_steps == 40 and result.iterations == 2 and result.episodes == 4
    assert result.checkpoint == tmp_path / "run" / "checkpoints" / "last"
    assert [r["env_steps"] for r in result.curve] == [20, 40]
    assert math.isnan(result.curve[0]["policy_loss"])  # critic warm-up: no actor update
    for key in ("policy_loss", "value_loss", "approx_kl", "chunk_return"):
        assert math.isfinite(result.curve[1][key]), key
    assert result.curve[0]["chunks"] == 10  # 2 robots x 10 steps / n_exec 2: episodes of 8 never cut a chunk
    # the adaptive schedule: iteration 0 (critic only) keeps the rate, iteration 1's KL sets the next one
    assert [r["actor_lr"] for r in result.curve] == [1e-3, 1e-3]
    assert result.metrics["actor_lr_final"] == pytest.approx(
        adapt_lr(1e-3, result.curve[1]["approx_kl"], 0.01, cfg.adaptive_lr_bounds)
    )

    info = read_info(result.checkpoint)
    lp_base = load_policy(base)
    assert info.lineage.algorithm == f"flow-{method}" and info.lineage.round == 2
    assert info.lineage.parent_revision == lp_base.commit
    assert info.lineage.data["base_ref"] == str(base) and info.lineage.data["env_steps"] == 40
    assert info.metrics["env_steps"] == 40
    if method == "sde":
        assert info.metrics["eval_episodes"] == 2 and 0.0 <= info.metrics["eval_success"] <= 1.0
    lp = load_policy(result.checkpoint)
    assert lp.policy.config.num_inference_steps == 3  # deploys with the K it was fine-tuned for
    _, w_new = load_checkpoint(result.checkpoint)
    _, w_old = load_checkpoint(base)
    assert any(not torch.equal(w_new[k], w_old[k]) for k in w_old), "the actor update changed nothing"
    assert (tmp_path / "run" / "critic.pt").is_file() and (tmp_path / "run" / "curve.json").is_file()
    assert any((tmp_path / "run" / "tb").iterdir())


def test_a_spent_time_budget_ships_the_policy_as_it_is(tmp_path: Path) -> None:
    """``max_minutes``: no iteration starts after the budget; what exists is shipped and says so."""
    base = _sim_checkpoint(tmp_path / "base")
    cfg = PPOConfig(
        base=str(base),
        out=tmp_path / "run",
        num_steps=3,
        num_envs=1,
        env_steps=40,
        rollout_steps=10,
        max_minutes=1e-9,  # spent before the first iteration
        progress=False,
    )
    result = train_ppo(cfg)
    assert result.iterations == 0 and result.env_steps == 0 and result.curve == []
    assert result.metrics["stopped_by_time"] is True
    assert read_info(result.checkpoint).metrics["stopped_by_time"] is True
    _, w_new = load_checkpoint(result.checkpoint)
    _, w_old = load_checkpoint(base)
    assert all(torch.equal(w_new[k], w_old[k]) for k in w_old)


def test_cli_train_ppo_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vla_rl.cli import main

    missing = tmp_path / "no-such-checkpoint"
    assert main(["train", "flow-noise", "--base", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert "no-such-checkpoint" in capsys.readouterr().err
    base = _sim_checkpoint(tmp_path / "base")
    argv = ["train", "flow-sde", "--base", str(base), "--out", str(tmp_path / "o")]
    assert main([*argv, "--num-steps", "1"]) == 2
    assert "num_steps" in capsys.readouterr().err


@pytest.mark.slow
def test_train_grpo_end_to_end(tmp_path: Path) -> None:
    base = _sim_checkpoint(tmp_path / "base")
    cfg = PPOConfig(
        base=str(base),
        out=tmp_path / "run",
        advantage="grpo",
        group_size=2,
        num_steps=3,
        num_envs=2,
        env_steps=40,
        max_episode_steps=8,
        minibatch_size=8,
        update_epochs=1,
        progress=False,
    )
    result = train_ppo(cfg)
    # one iteration = 2 rounds x 8 steps x 2 robots (a random policy never succeeds early)
    assert [r["env_steps"] for r in result.curve] == [32, 64] and result.episodes == 8
    assert all(math.isfinite(r["policy_loss"]) and math.isnan(r["value_loss"]) for r in result.curve)
    assert read_info(result.checkpoint).lineage.algorithm == "flow-noise"

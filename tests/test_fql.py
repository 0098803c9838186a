"""FQL (vla_rl/train/fql.py): its losses against independent computations, the one-step policy against the
deployed sampler, and a short run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_base import tiny_base

from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from vla_rl.train.algorithms import ALGORITHMS, make_config
from vla_rl.train.fql import FQLConfig, FQLLearner, distillation_loss, fql_q_loss, one_step_actions
from vla_rl.train.qam_math import critic_td_target

torch.set_num_threads(1)  # small nets on a shared machine: extra threads only contend


def _policy() -> FlowVLAPolicy:
    torch.manual_seed(0)
    return FlowVLAPolicy(
        FlowVLAConfig(
            state_dim=3,
            action_dim=2,
            chunk_len=4,
            n_exec=2,
            d_model=16,
            n_layers=1,
            expert_n_layers=1,
            instruction_encoder="none",
        )
    )


def _cfg(tmp_path: Path, **kw: object) -> FQLConfig:
    args: dict[str, object] = dict(
        base="b", store=tmp_path, out=tmp_path, members=2, critic_hidden=(16,), flow_steps=3, steps=10,
        critic_mc_steps=0, critic_warmup=0, progress=False,
    )  # fmt: skip
    args.update(kw)
    return FQLConfig(**args)  # type: ignore[arg-type]


def _batch(b: int = 5) -> tuple[dict, dict]:
    torch.manual_seed(3)
    batch = {
        "state": torch.randn(b, 3),
        "cameras": {},
        "action": torch.rand(b, 4, 2) * 2 - 1,
        "action_is_pad": torch.zeros(b, 4, dtype=torch.bool),
        "reward_n": torch.full((b,), -0.1),
        "bootstrap": torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])[:b],
        "valid": torch.ones(b),
        "mc_return": torch.linspace(-1.0, 0.0, b),
    }
    return batch, {"state": torch.randn(b, 3), "cameras": {}}


def test_one_step_actions_hand_computed_and_equal_to_the_deployed_one_step_sampler(tmp_path: Path) -> None:
    a = torch.tensor([[0.5, -0.2], [0.1, 0.3]])
    c = torch.tensor([0.05, -0.4])
    z = torch.randn(3, 2)
    torch.testing.assert_close(one_step_actions(lambda x, t: x @ a + c, z), z + z @ a + c)
    # the actor's μ(s, z) is exactly what serving computes with the saved num_inference_steps = 1
    learner = FQLLearner(_policy(), _cfg(tmp_path))
    batch, _ = _batch()
    z = torch.randn(5, 4, 2)
    with torch.no_grad():
        mu = learner.one_step(batch, z)
        served = learner.actor.sample(batch, method="ode", noise=z[:, None]).actions[:, 0]
    assert learner.actor.config.num_inference_steps == 1
    torch.testing.assert_close(mu, served)


def test_distillation_and_q_losses_hand_computed_with_the_right_gradients() -> None:
    mu = torch.tensor([[1.0, 2.0], [0.0, -1.0]], requires_grad=True)
    target = torch.tensor([[0.0, 2.0], [1.0, 1.0]], requires_grad=True)
    loss = distillation_loss(mu, target)
    assert float(loss.detach()) == pytest.approx((1 + 0 + 1 + 4) / 4)
    loss.backward()
    torch.testing.assert_close(mu.grad, 2 * (mu - target).detach() / 4)
    assert target.grad is None  # the ODE target is a constant

    q = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]], requires_grad=True)  # [M = 2, B = 2]
    mean_q = torch.tensor([-1.5, -2.5])
    assert float(fql_q_loss(q, normalize=False).detach()) == pytest.approx(2.0)
    lq = fql_q_loss(q, normalize=True)
    assert float(lq.detach()) == pytest.approx(2.0 / mean_q.abs().mean())
    lq.backward()  # λ_q is a constant: d/dq = −λ_q / (M·B)
    torch.testing.assert_close(q.grad, torch.full((2, 2), -1.0 / 4 / 2.0))


def test_learner_losses_match_an_independent_recomputation(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, alpha=3.0, rho=0.5, gamma=0.9)
    learner = FQLLearner(_policy(), cfg)
    batch, nxt = _batch()
    torch.manual_seed(11)
    out = learner.losses(batch, nxt, mc=False, use_q=True)
    # the same draws: z' for the TD target, then z for the actor
    torch.manual_seed(11)
    z_next, z = torch.randn(5, 4, 2), torch.randn(5, 4, 2)
    with torch.no_grad():
        a_next = learner.one_step(nxt, z_next).clamp(-1, 1)[:, :2]
        y = critic_td_target(
            learner.critic_target(learner.features(nxt), a_next),
            batch["reward_n"], batch["bootstrap"], 0.9, 2, 0.5,
        )  # fmt: skip
        feats = learner.features(batch)
        q = learner.critic(feats, learner.dataset_chunk(batch["action"]))
        mu = learner.one_step(batch, z)
        ode = learner.base.sample(batch, method="ode", num_steps=3, noise=z[:, None]).actions[:, 0]
        q_pi = learner.critic(feats, mu.clamp(-1, 1)[:, :2]).mean(0)
    torch.testing.assert_close(out["loss_q"], (q - y[None]).square().mean())
    torch.testing.assert_close(out["loss_distill"], (mu - ode).square().mean())
    torch.testing.assert_close(out["loss_q_pi"], -q_pi.mean() / q_pi.abs().mean())
    torch.testing.assert_close(out["loss_actor"], 3.0 * out["loss_distill"] + out["loss_q_pi"])
    # the actor's Q term moves the actor only, never the critic's weights
    out["loss_actor"].backward()
    assert all(p.grad is None for p in learner.critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.actor.parameters())
    # the MC warm start regresses on the Monte-Carlo return, and no Q term before the warm-up ends
    mc = learner.losses(batch, None, mc=True, use_q=False)
    torch.testing.assert_close(mc["loss_q"], (q - batch["mc_return"][None]).square().mean())
    assert "loss_q_pi" not in mc


def test_registered_and_config_errors_name_the_field(tmp_path: Path) -> None:
    assert "fql" in ALGORITHMS
    cfg = make_config("fql", base="b", store=tmp_path, out=tmp_path, alpha=30.0)
    assert isinstance(cfg, FQLConfig) and cfg.algorithm == "fql" and cfg.alpha == 30.0
    with pytest.raises(ValueError, match="critic_warmup: the Q term would never"):
        _cfg(tmp_path, steps=5, critic_warmup=5)
    with pytest.raises(ValueError, match="alpha and rho: expected >= 0"):
        _cfg(tmp_path, alpha=-1.0)
    with pytest.raises(ValueError, match="feature_mode: expected"):
        _cfg(tmp_path, feature_mode="pixels")


# ---------------------------------------------------------------------------- end to end
KINEMATIC = "kinematic/Reach-v0"


@pytest.fixture(scope="module")
def kinematic_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Kinematic Reach demos and a tiny SFT base trained on them (tests/tiny_base.py)."""
    store, ckpt = tiny_base(
        tmp_path_factory.mktemp("fql"), KINEMATIC, episodes=4, noise=0.5, steps=10, batch_size=16
    )
    return store.root, ckpt


def test_offline_run_writes_a_one_step_fql_checkpoint(
    kinematic_base: tuple[Path, Path], tmp_path: Path
) -> None:
    from policies.loading import load_policy
    from vla_rl.hub.checkpoint import read_info
    from vla_rl.train.algorithms import train

    store, base = kinematic_base
    cfg = make_config(
        "fql", base=str(base), store=store, out=tmp_path / "fql", steps=8, critic_mc_steps=2, critic_warmup=4,
        batch_size=16, members=2, critic_hidden=(16,), flow_steps=3, log_every=2, threads=1, progress=False,
        device="cpu",
    )  # fmt: skip
    res = train(cfg)
    info = read_info(res.checkpoint)
    assert info.lineage.algorithm == "fql" and info.lineage.parent_revision.startswith("local:")
    assert info.model_config["num_inference_steps"] == 1 and info.metrics["train_steps"] == 8
    assert res.metrics["updates"] == 8 and [r["step"] for r in res.curve] == [2, 4, 6, 8]
    assert "loss_q_pi" in res.curve[-1] and "loss_q_pi" not in res.curve[0]  # the Q term after warm-up
    trained, start = load_policy(res.checkpoint, device="cpu").policy, load_policy(base, device="cpu").policy
    moved = [
        name for (name, p), q in zip(trained.state_dict().items(), start.state_dict().values(), strict=True)
        if not torch.equal(p, q)
    ]  # fmt: skip
    assert moved, "the one-step policy did not train"


def _distillation_error(
    policy: torch.nn.Module, base: torch.nn.Module, batch: dict, z: torch.Tensor
) -> float:
    """mean ||μ(s, z) − ODE_β(s, z)||² with μ the policy's one Euler step and ODE_β the base's 3-step ODE."""
    with torch.no_grad():
        mu = policy.sample(batch, method="ode", num_steps=1, noise=z[:, None]).actions[:, 0]
        ode = base.sample(batch, method="ode", num_steps=3, noise=z[:, None]).actions[:, 0]
    return float((mu - ode).square().mean())


def test_distillation_alone_turns_the_copy_into_a_one_step_base(
    kinematic_base: tuple[Path, Path], tmp_path: Path
) -> None:
    """The copy of the base evaluated at t = 0 is not yet a one-step base (its velocity at t = 0 points at
    the mean action); the distillation-only phase before ``critic_warmup``, at the default actor learning
    rate, makes the saved one-step policy match the base's ODE on the data's states (fixed z)."""
    from fleet.selection import Selection
    from policies.loading import load_policy
    from vla_rl.train.algorithms import train
    from vla_rl.train.common import batch_to_policy_inputs
    from vla_rl.train.transitions import load_transitions

    store, base = kinematic_base
    buf = load_transitions(store, Selection(task=KINEMATIC))
    rows = torch.randperm(len(buf), generator=torch.Generator().manual_seed(0))[:64].numpy()
    batch = batch_to_policy_inputs(buf.batch(rows, horizon=4, n_step=2), torch.device("cpu"))
    base_policy = load_policy(base, device="cpu").policy
    z = torch.randn(len(rows), 4, base_policy.config.action_dim, generator=torch.Generator().manual_seed(1))
    before = _distillation_error(base_policy, base_policy, batch, z)
    cfg = make_config(
        "fql", base=str(base), store=store, out=tmp_path / "fql", steps=100, critic_mc_steps=0,
        critic_warmup=99, batch_size=32, members=2, critic_hidden=(16,), flow_steps=3, log_every=50,
        threads=1, progress=False, device="cpu",
    )  # fmt: skip
    res = train(cfg)
    after = _distillation_error(load_policy(res.checkpoint, device="cpu").policy, base_policy, batch, z)
    assert after < 0.25 * before, (before, after)  # before: 0.017 per element
    assert res.curve[-1]["loss_distill"] < 0.25 * before

"""DIVL (vla_rl/train/divl.py): the quantile read-out and the loss's minimiser against independent
computations, its TD target in QAM, and a value-fit check on kinematic data in AWR."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_base import demo_store

from fleet.selection import Selection
from policies.critics import CategoricalValue
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from vla_rl.train.awr import AWRConfig, cross_fitted_values
from vla_rl.train.divl import DIVLConfig, DIVLValue, divl_support, divl_td_target, interpolated_quantile
from vla_rl.train.qam import QAMConfig, QAMLearner
from vla_rl.train.transitions import TransitionBuffer, load_transitions

KINEMATIC = "kinematic/Reach-v0"
torch.set_num_threads(1)  # small nets on a shared machine: extra threads only contend


def _brute_quantile(p: np.ndarray, atoms: np.ndarray, tau: float, grid: int = 200_001) -> float:
    """Smallest z on a dense grid where the histogram's CDF (each atom's mass uniform over its bin)
    reaches tau."""
    d = atoms[1] - atoms[0]
    edges = np.concatenate([[atoms[0] - d / 2], atoms + d / 2])
    z = np.linspace(edges[0], edges[-1], grid)
    cdf = np.interp(z, edges, np.concatenate([[0.0], np.cumsum(p)]))
    return float(z[np.argmax(cdf >= tau - 1e-12)])


def test_interpolated_quantile_matches_a_dense_grid_search() -> None:
    rng = np.random.default_rng(0)
    atoms = np.linspace(-2.0, 1.0, 7)
    for _ in range(20):
        p = rng.dirichlet(np.full(7, 0.7))
        for tau in (0.05, 0.3, 0.5, 0.77, 0.95):
            got = float(interpolated_quantile(torch.tensor(p[None]), torch.tensor(atoms), tau)[0])
            assert got == pytest.approx(_brute_quantile(p, atoms, tau), abs=2e-4), (p, tau)
    # a point mass has its median at its atom and every quantile inside its bin
    one_hot = torch.zeros(1, 7, dtype=torch.float64)
    one_hot[0, 3] = 1.0
    d = atoms[1] - atoms[0]
    for tau in (0.01, 0.5, 0.99):
        got = float(interpolated_quantile(one_hot, torch.tensor(atoms), tau)[0])
        assert got == pytest.approx(atoms[3] + (tau - 0.5) * d)
    with pytest.raises(ValueError, match="tau: expected in"):
        interpolated_quantile(one_hot, torch.tensor(atoms), 1.0)


def test_divl_loss_minimiser_is_the_projected_histogram_and_its_quantile_the_sample_quantile() -> None:
    """For one state, the cross-entropy to two-atom projections is minimised by the mean projection; its
    interpolated τ-quantile is the samples' τ-quantile to within a bin; gradient descent gets there."""
    torch.manual_seed(0)
    samples = torch.cat([torch.randn(3000) * 0.1 - 1.5, torch.rand(2000) * 0.6 - 0.6])  # bimodal
    cfg = DIVLConfig(quantile=0.8, bins=41)
    lo, hi = divl_support(samples, cfg.support_margin)
    span = float(samples.max() - samples.min())
    assert (lo, hi) == pytest.approx((float(samples.min()) - 0.1 * span, float(samples.max()) + 0.1 * span))
    head = DIVLValue(1, cfg, lo, hi, hidden=(8,))
    p_star = head.project(samples).mean(0, keepdim=True)
    assert float((p_star * head.atoms).sum()) == pytest.approx(float(samples.mean()), abs=1e-5)  # mean kept
    bin_w = (hi - lo) / (cfg.bins - 1)
    for tau in (0.2, 0.5, 0.8):
        q = float(interpolated_quantile(p_star, head.atoms, tau)[0])
        assert q == pytest.approx(float(np.quantile(samples.numpy(), tau)), abs=bin_w)
    # train the head on the samples from a constant feature: it reaches the minimiser's read-outs
    feats = torch.ones(256, 1)
    opt = torch.optim.Adam(head.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(150):
        batch = samples[torch.randint(0, len(samples), (256,), generator=gen)]
        loss = head.loss(feats, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        v = float(head(feats[:1])[0])
        p = head.probs(feats[:1])
        mean = float(CategoricalValue.mean(head, feats[:1])[0])
    assert v == pytest.approx(float(interpolated_quantile(p_star, head.atoms, 0.8)[0]), abs=1.5 * bin_w)
    assert float((p - p_star).abs().sum()) < 0.15  # total variation ~ sampling noise of the batches
    # the read-out differs from the categorical head's mean, which is what the "categorical" value uses
    assert v > mean + 0.2


def test_divl_td_target_hand_computed() -> None:
    v_next = torch.tensor([-0.5, -1.0, 0.0])
    r = torch.tensor([-0.1, -0.2, 1.0])
    boot = torch.tensor([1.0, 0.0, 1.0])
    y = divl_td_target(v_next, r, boot, gamma=0.9, n_step=2)
    torch.testing.assert_close(y, torch.tensor([-0.1 - 0.81 * 0.5, -0.2, 1.0]))


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="divl_quantile: expected in"):
        DIVLConfig(quantile=1.0)
    common = dict(base="b", store=tmp_path, out=tmp_path)
    with pytest.raises(ValueError, match="value: expected categorical, expectile or divl"):
        AWRConfig(**common, value="dist")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divl_quantile: expected in"):
        AWRConfig(**common, value="divl", divl_quantile=0.0)
    with pytest.raises(ValueError, match="next_action_cache: value='divl'"):
        QAMConfig(**common, value="divl", next_action_cache=100)
    with pytest.raises(ValueError, match="value: expected policy or divl"):
        QAMConfig(**common, value="categorical")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- on kinematic data
@pytest.fixture(scope="module")
def kinematic_buffer(tmp_path_factory: pytest.TempPathFactory) -> TransitionBuffer:
    store = demo_store(tmp_path_factory.mktemp("divl") / "store", KINEMATIC, episodes=16, noise=0.8)
    return load_transitions(store, Selection.parse(None, task=KINEMATIC), reward="steps_to_go", gamma=1.0)


def test_awr_divl_value_fits_the_return_distribution_of_kinematic_data(
    kinematic_buffer: TransitionBuffer, tmp_path: Path
) -> None:
    """AWR's DIVL value on kinematic Reach demos (steps-to-go returns): the share of returns below V_τ(s) is
    about τ and V_τ ranks the returns. A mean read-out (both shares ~0.5), an untrained head (no ranking)
    or a flipped quantile all fail."""
    buf = kinematic_buffer
    s = torch.from_numpy(buf.states).float()
    feats = (s - s.mean(0)) / s.std(0).clamp_min(1e-6)
    g = torch.from_numpy(buf.array("mc_return")).float()
    episode, human = buf.array("episode"), np.zeros(len(buf), bool)
    cover, corr = {}, {}
    for tau in (0.2, 0.8):
        cfg = AWRConfig(
            base="b", store=tmp_path, out=tmp_path, value="divl", divl_quantile=tau, value_steps=150,
            value_folds=1, value_hidden=(32, 32), batch_size=128, value_lr=3e-3, progress=False,
        )  # fmt: skip
        torch.manual_seed(0)
        v, _ = cross_fitted_values(cfg, feats, g, episode, human)
        cover[tau] = float((g <= v).float().mean())
        corr[tau] = float(np.corrcoef(v.numpy(), g.numpy())[0, 1])
    assert cover[0.2] == pytest.approx(0.2, abs=0.1) and cover[0.8] == pytest.approx(0.8, abs=0.1), cover
    assert min(corr.values()) > 0.4, corr


def test_qam_divl_td_target_is_the_value_quantile_and_never_samples_the_fine_policy(tmp_path: Path) -> None:
    """With value='divl' the critic's target is R_n + γ^n·bootstrap·V_τ(s') (hand-checked), and changing the
    fine policy does not change it; the value trains on the target critic at the data's actions."""
    torch.manual_seed(0)
    pol = FlowVLAPolicy(
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
    cfg = QAMConfig(
        base="b", store=tmp_path, out=tmp_path, value="divl", divl_quantile=0.7, members=2,
        critic_hidden=(16,), value_hidden=(16,), flow_steps=3, offline_steps=5, critic_warmup=0,
        critic_mc_steps=0, progress=False,
    )  # fmt: skip
    learner = QAMLearner(pol, cfg, value_support=(-2.0, 0.0))
    b = 6
    batch = {
        "state": torch.randn(b, 3),
        "cameras": {},
        "action": torch.rand(b, 4, 2) * 2 - 1,
        "action_is_pad": torch.zeros(b, 4, dtype=torch.bool),
        "reward_n": torch.full((b,), -0.1),
        "bootstrap": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
        "valid": torch.ones(b),
    }
    nxt = {"state": torch.randn(b, 3), "cameras": {}}
    out = learner.losses(batch, nxt, train_actor=False)
    with torch.no_grad():
        v = learner.value_head(learner.features(nxt))
        y = batch["reward_n"] + cfg.gamma**2 * batch["bootstrap"] * v
        q = learner.critic(learner.features(batch), learner.dataset_chunk(batch["action"]))
        q_data = learner.critic_target(learner.features(batch), learner.dataset_chunk(batch["action"])).mean(
            0
        )
        loss_v = learner.value_head.loss(learner.features(batch), q_data)
    torch.testing.assert_close(out["loss_q"], (q - y[None]).square().mean())
    torch.testing.assert_close(out["loss_v"], loss_v)
    with torch.no_grad():
        for p in learner.fine.parameters():
            p.add_(1.0)
    torch.testing.assert_close(learner.losses(batch, nxt, train_actor=False)["loss_q"], out["loss_q"])

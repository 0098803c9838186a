"""AWR / RECAP: weights and indicators by hand, advantage conditioning + guidance, a short end-to-end run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from left_right import LR_TASK, instruction_means, mixed_base, spec_instruction_only
from vla_rl_client.meta import Controller, SegmentKind

from fleet.store import EpisodeStore
from fleet.store_index import index_store
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from policies.flow_vla.modeling_flow_vla import ADVANTAGE_NEGATIVE, ADVANTAGE_POSITIVE
from policies.loading import load_policy
from sim.demos import record_demos, record_rollouts
from vla_rl.hub.checkpoint import read_info
from vla_rl.train.awr import AWRConfig, awr_weights, recap_indicators, train_awr
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "maniskill/PushCube-v1"


def test_awr_weights_hand_computed() -> None:
    adv = np.array([1.0, -1.0, 0.5])
    human = np.array([False, False, True])
    w = awr_weights(adv, human, beta=1.0, w_max=2.0, human_weight=1.0)
    # std of autonomous advantages [1, -1] is 1: weights exp(1) -> clipped to 2, exp(-1); human -> 1
    np.testing.assert_allclose(w, [2.0, np.exp(-1.0), 1.0], rtol=1e-6)
    w = awr_weights(adv, human, beta=2.0, w_max=20.0, human_weight=0.5)
    np.testing.assert_allclose(w, [np.exp(0.5), np.exp(-0.5), 0.5], rtol=1e-6)


def test_recap_indicators_hand_computed() -> None:
    adv = np.array([0.1, 0.2, 0.3, 0.4, -5.0])
    human = np.array([False, False, False, False, True])
    ind, eps = recap_indicators(adv, human, positive_fraction=0.5)
    assert eps == pytest.approx(0.25)
    N, P = ADVANTAGE_NEGATIVE, ADVANTAGE_POSITIVE
    assert ind.tolist() == [N, N, P, P, P]  # the human frame is positive whatever its advantage


def test_lambda_returns_match_the_forward_view() -> None:
    """Backward recursion vs the forward view on one terminal episode: G^λ_t = (1 - λ) Σ_{n=1}^{T-t-1}
    λ^{n-1} G^(n)_t + λ^{T-t-1} G_t, with n-step returns G^(n)_t = Σ_{k<n} γ^k r_{t+k} + γ^n V(s_{t+n})."""
    from vla_rl.train.awr import lambda_returns

    rng = np.random.default_rng(0)
    T, gamma = 7, 0.9
    r, v = rng.normal(size=T), rng.normal(size=T)
    mc = np.array([sum(gamma**k * r[t + k] for k in range(T - t)) for t in range(T)])
    last, cut = np.arange(T) == T - 1, np.zeros(T, bool)
    for lam in (0.0, 0.6, 1.0):
        got = lambda_returns(r, mc, v, last, cut, gamma, lam)
        for t in range(T):
            n_step = [
                sum(gamma**k * r[t + k] for k in range(n)) + gamma**n * v[t + n] for n in range(1, T - t)
            ]
            want = (1 - lam) * sum(lam ** (n - 1) * g for n, g in enumerate(n_step, 1)) + lam ** (
                T - t - 1
            ) * mc[t]
            assert got[t] == pytest.approx(want, rel=1e-5, abs=1e-5), (lam, t)
    np.testing.assert_allclose(
        lambda_returns(r, mc, v, last, cut, gamma, 0.0)[:-1], r[:-1] + gamma * v[1:], rtol=1e-5
    )


def test_lambda_one_is_the_monte_carlo_return_across_takeovers_and_idle_spans() -> None:
    """On a real buffer (a takeover cuts the returns, an idle span drops frames): λ = 1 gives back every
    frame's mc_return, and λ < 1 still keeps the cut and run-end frames' Monte-Carlo returns."""
    from vla_rl_client.spec import RobotSpec

    from vla_rl.train.awr import lambda_returns
    from vla_rl.train.transitions import TransitionBuffer

    spec = RobotSpec(name="t", state_dim=2, action_dim=1, control_hz=10.0, instruction="go")
    buf = TransitionBuffer(spec, reward="steps_to_go", gamma=0.95, max_steps=12)
    P, H = int(Controller.POLICY), int(Controller.HUMAN)
    ctrl = np.array([P, P, P, H, H, P, P, P, P, P])
    buf.add_episode(
        state=np.arange(20, dtype=np.float32).reshape(10, 2),
        action=np.zeros((10, 1), np.float32),
        reward=np.zeros(10, np.float32),
        terminated=np.eye(10, dtype=bool)[-1],
        controller=ctrl,
        success=True,
        spans=[("idle", 6, 8)],
    )
    buf.add_episode(
        state=np.ones((4, 2), np.float32),
        action=np.zeros((4, 1), np.float32),
        reward=np.zeros(4, np.float32),
        terminated=np.zeros(4, bool),
        controller=np.full(4, P),
        success=False,
    )
    end, cut = buf.array("end"), buf.array("cut")
    last = np.arange(len(buf)) == end - 1
    assert len(buf) == 12 and cut.sum() == 1 and last.sum() == 3  # runs: 0-5, 8-9, then episode 1
    v = np.random.default_rng(1).normal(size=len(buf))
    mc = buf.array("mc_return")
    args = (buf.array("reward"), mc, v, last, cut, 0.95)
    np.testing.assert_allclose(lambda_returns(*args, 1.0), mc, rtol=1e-5, atol=1e-6)
    td = lambda_returns(*args, 0.5)
    np.testing.assert_allclose(td[last | cut], mc[last | cut], rtol=1e-6)
    assert not np.allclose(td[~(last | cut)], mc[~(last | cut)])


def testcross_fitted_values_never_see_their_own_episode(tmp_path: Path) -> None:
    from vla_rl.train.awr import cross_fitted_values

    torch.manual_seed(0)
    cfg = AWRConfig(base="x", store=tmp_path, out=tmp_path, value_steps=20, batch_size=8, progress=False)
    episode = np.repeat(np.arange(6), 5)
    human = np.zeros(30, bool)
    feats, returns = torch.randn(30, 3), torch.randn(30)
    torch.manual_seed(0)  # same head initialisations in both calls
    v1, _ = cross_fitted_values(cfg, feats, returns, episode, human)
    fold_of = np.random.default_rng([cfg.seed, 2]).permutation(6) % 2
    changed = returns.clone()
    e = 0
    changed[torch.from_numpy(episode == e)] += 100.0  # rewrite one episode's returns
    torch.manual_seed(0)
    v2, _ = cross_fitted_values(cfg, feats, changed, episode, human)
    own = torch.from_numpy(fold_of[episode] == fold_of[e])
    torch.testing.assert_close(v2[own], v1[own])  # that episode's fold is scored by the other fold's value
    assert not torch.allclose(v2[~own], v1[~own])  # ...while the other fold's value did learn from it


def _tiny_cfg(**kw: object) -> FlowVLAConfig:
    base = dict(state_dim=3, action_dim=2, chunk_len=4, n_exec=2, d_model=16, n_layers=1, expert_n_layers=1)
    base["instruction_encoder"] = "none"
    base.update(kw)
    return FlowVLAConfig(**base)  # type: ignore[arg-type]


def test_weighted_flow_matching_loss_is_the_weighted_mean_of_per_sample_losses() -> None:
    torch.manual_seed(0)
    model = FlowVLAPolicy(_tiny_cfg())
    batch = {"state": torch.randn(3, 3), "action": torch.randn(3, 4, 2)}
    noise, t = torch.randn(3, 4, 2), torch.tensor([0.2, 0.5, 0.9])
    w = torch.tensor([2.0, 0.0, 0.5])
    loss, _ = model.flow_matching_loss(batch, noise=noise, time=t, weights=w)
    per = [
        model.flow_matching_loss(
            {"state": batch["state"][i : i + 1], "action": batch["action"][i : i + 1]},
            noise=noise[i : i + 1],
            time=t[i : i + 1],
        )[0]
        for i in range(3)
    ]
    torch.testing.assert_close(loss, sum(wi * li for wi, li in zip(w, per, strict=True)) / 3)


def test_advantage_conditioning_starts_from_the_base_and_guidance_mixes_velocities() -> None:
    torch.manual_seed(0)
    base = FlowVLAPolicy(_tiny_cfg()).eval()
    cond = FlowVLAPolicy(_tiny_cfg(advantage_conditioning=True)).eval()
    missing, _ = cond.load_state_dict(base.state_dict(), strict=False)
    assert missing == ["advantage_embedding.weight"]
    obs = {"state": torch.randn(2, 3)}
    noise = torch.randn(2, 1, 4, 2)
    a_base = base.sample(obs, noise=noise).actions
    torch.testing.assert_close(cond.sample(obs, noise=noise).actions, a_base)  # zero-initialised embedding
    with torch.no_grad():
        cond.advantage_embedding.weight.normal_()
    # guidance beta: v = (1 - beta) v_uncond + beta v_pos, integrated by Euler
    beta = 2.5
    cond.config.guidance_scale = beta
    got = cond.sample(obs, noise=noise, num_steps=3).actions[:, 0]
    pu = cond.encode_prefix({**obs, "advantage": torch.zeros(2, dtype=torch.long)})
    pp = cond.encode_prefix({**obs, "advantage": torch.full((2,), ADVANTAGE_POSITIVE)})
    x = noise[:, 0]
    for i in range(3):
        t = torch.full((2,), i / 3)
        v = (1 - beta) * cond.velocity(pu, x, t) + beta * cond.velocity(pp, x, t)
        x = x + v / 3
    torch.testing.assert_close(got, x)
    # an explicit indicator bypasses guidance; a bad one is refused
    neg = cond.sample({**obs, "advantage": torch.full((2,), ADVANTAGE_NEGATIVE)}, noise=noise).actions
    assert not torch.allclose(neg, got)
    with pytest.raises(ValueError, match="advantage: expected 2 values"):
        cond.sample({**obs, "advantage": torch.tensor([0, 7])})


@pytest.fixture(scope="module")
def base_and_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny SFT checkpoint and a store with demos plus one episode with a human takeover."""
    root = tmp_path_factory.mktemp("awr") / "store"
    store = EpisodeStore(root, create=True)
    record_demos(store, TASK, episodes=6, noise=0.5, seed=0, progress=False)
    # replay the first demo as a policy rollout with a human takeover in the middle
    ep = store.read_episode(store.episode_ids()[0])
    w = store.create_episode(ep.meta.spec, robot_id="arm-7", task=TASK)
    for i in range(ep.length):
        if i == 5:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        elif i == 12:
            w.begin_segment(SegmentKind.AUTONOMOUS, Controller.POLICY)
        w.add_frame(
            cameras={},
            state=ep.state[i],
            action=ep.action[i],
            reward=float(ep.reward[i]),
            terminated=bool(ep.terminated[i]),
            truncated=bool(ep.truncated[i]),
            controller=Controller.HUMAN if 5 <= i < 12 else Controller.POLICY,
            revision="rev-test",
        )
    w.close(outcome="success" if ep.meta.success else "failure", success=bool(ep.meta.success))
    sft = train_sft(
        SFTConfig(
            task=TASK,
            store=root,
            out=tmp_path_factory.mktemp("sft"),
            steps=60,
            batch_size=32,
            d_model=32,
            n_layers=1,
            expert_n_layers=1,
            instruction_encoder="none",
            checkpoint_every=60,
            progress=False,
        )
    )
    # the base's own autonomous rollouts join the data, as a deployed fleet's would
    rep = record_rollouts(
        store, load_policy(sft.checkpoint), TASK, episodes=2, seed=500, revision="rev-base", progress=False
    )
    for eid in rep.episode_ids:
        ep = store.read_episode(eid)
        assert (ep.controller == int(Controller.POLICY)).all() and ep.meta.revisions == ("rev-base",)
        assert np.array_equal(ep.proposed_action, ep.action) and ep.meta.is_closed
    return sft.checkpoint, root


@pytest.mark.parametrize("variant", ["awr", "recap"])
def test_train_end_to_end(base_and_store: tuple[Path, Path], tmp_path: Path, variant: str) -> None:
    base, store = base_and_store
    res = train_awr(
        AWRConfig(
            base=str(base),
            store=store,
            out=tmp_path,
            variant=variant,  # type: ignore[arg-type]
            value_steps=40,
            steps=30,
            batch_size=32,
            progress=False,
            data="max=1000",  # every closed episode, through the selection text
        )
    )
    assert res.data["human_frames"] == 7
    assert np.isfinite(res.metrics["final_loss"]) and np.isfinite(res.metrics["value_loss"])
    info = read_info(res.checkpoint)
    assert info.lineage.algorithm == variant and info.lineage.parent_revision
    assert info.lineage.data["frames"] == res.data["frames"]
    loaded = load_policy(res.checkpoint)
    assert loaded.policy.config.advantage_conditioning is (variant == "recap")
    chunks = loaded.predict_chunks({"state": np.zeros((2, 35), np.float32), "instruction": ["x"] * 2}, seed=0)
    assert chunks.shape == (2, 10, 4) and np.isfinite(chunks).all()
    if variant == "recap":
        assert 0.2 < res.metrics["positive_frac"] < 0.4


def test_a_recovery_span_label_is_cloned_like_a_takeover(
    base_and_store: tuple[Path, Path], tmp_path: Path, store_db_url: str | None
) -> None:
    """A person labels the autonomous frames after the takeover `recovery`: AWR clones them (weight
    ``human_weight``) as it clones the 7 human frames, instead of weighting them by an advantage."""
    import shutil

    from vla_rl.cli.common import open_db

    base, src = base_and_store
    store = tmp_path / "store"
    shutil.copytree(src, store)
    db = open_db(store, store_db_url)
    es = EpisodeStore(store)
    index_store(es, db)  # the demos bypassed the DB (the fixture's own training may have recorded some)
    eid = next(e for e in es.episode_ids() if "arm-7" in e)
    length = es.read_metadata(eid).length  # a replayed demo: its length depends on which demo it was
    assert length > 12, "the fixture's takeover episode has autonomous frames after its takeover"
    db.add_label(eid, "segment", "recovery", author="ana", start=12, end=length)
    res = train_awr(
        AWRConfig(
            base=str(base),
            store=store,
            out=tmp_path / "out",
            db_url=store_db_url,
            value_steps=5,
            steps=2,
            batch_size=32,
            progress=False,
            data="max=1000",
        )
    )
    assert res.data["human_frames"] == 7 and res.data["clone_frames"] == 7 + (length - 12)


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="variant: expected awr or recap"):
        AWRConfig(base="x", store=tmp_path, out=tmp_path, variant="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive_fraction"):
        AWRConfig(base="x", store=tmp_path, out=tmp_path, positive_fraction=1.5)


# ---------------------------------------------------------------------- language conditioning
@pytest.fixture(scope="module")
def left_right(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The mixed left/right store (both actions under both instructions, success iff the action is the
    instruction's) and a short MiniLM-conditioned SFT base on it."""
    return mixed_base(tmp_path_factory.mktemp("lr"))


def _awr_left_right(left_right: tuple[Path, Path], out: Path) -> tuple[float, float]:
    store, base = left_right
    res = train_awr(
        AWRConfig(
            base=str(base),
            store=store,
            out=out,
            value_steps=30,
            steps=100,
            batch_size=32,
            lr=1e-3,
            warmup_steps=10,
            beta=0.25,
            threads=1,
            progress=False,
        )
    )
    return instruction_means(res.checkpoint)


def test_awr_follows_each_frames_instruction(left_right: tuple[Path, Path], tmp_path: Path) -> None:
    """Behaviour cloning of this data acts ~0 under both instructions; AWR, conditioning each frame on its
    episode's instruction, weighs up the successful action of each and follows the words."""
    from fleet.selection import Selection
    from vla_rl.train.transitions import load_transitions

    buf = load_transitions(left_right[0], Selection(task=LR_TASK))
    assert buf.instructions == ["go left", "go right"]
    batch = buf.batch(np.arange(len(buf)), horizon=1, n_step=1)
    texts = [buf.instructions[i] for i in batch["instruction_index"].tolist()]
    success = np.array(buf.episode_success)[batch["episode_index"].numpy()]
    acts = batch["action"][:, 0, 0].numpy()
    assert all(((a < 0) == (t == "go left")) == s for a, t, s in zip(acts, texts, success, strict=True))

    left, right = _awr_left_right(left_right, tmp_path)
    assert left < -0.5 and right > 0.5, (left, right)


def test_awr_with_one_instruction_for_all_cannot_follow_it(
    left_right: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old behaviour (every frame conditioned on the spec's instruction) fails the test above."""
    from vla_rl.train import contract

    monkeypatch.setattr(contract, "instruction_table", spec_instruction_only)
    left, right = _awr_left_right(left_right, tmp_path)
    assert abs(left - right) < 0.5, (left, right)

"""Chunked transitions, rewards, intervention-aware credit, data selection, and the critic heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import (
    CategoricalValue,
    ChunkQEnsemble,
    ValueMLP,
    expectile_loss,
    pessimistic,
    polyak_update,
)
from vla_rl.train.transitions import (
    TransitionBuffer,
    credit_labels,
    select_episode_ids,
    step_rewards,
)

P, H_, S = int(Controller.POLICY), int(Controller.HUMAN), int(Controller.SCRIPTED)
SPEC = RobotSpec(name="toy", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")


# ---------------------------------------------------------------------------- credit
def test_credit_never_labels_human_frames_and_cuts_at_takeover() -> None:
    ctrl = np.array([P, P, P, H_, H_, P, P])
    credit, cut = credit_labels(ctrl, success=True)
    assert credit.tolist() == [0, 0, 0, -1, -1, 1, 1]  # taken over -> failure; last stretch -> success
    assert cut.tolist() == [False, False, True, False, False, False, False]
    credit, _ = credit_labels(ctrl, success=False)
    assert credit.tolist() == [0, 0, 0, -1, -1, 0, 0]
    # property: over random controller sequences, human frames never get an outcome
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = rng.choice([P, H_, S], size=rng.integers(1, 30))
        cr, _ = credit_labels(c, success=bool(rng.integers(2)))
        assert (cr[c == H_] == -1).all()
        assert (cr[c != H_] >= 0).all()


def test_human_only_episode_has_no_credit() -> None:
    credit, cut = credit_labels(np.array([H_, H_, H_]), success=True)
    assert credit.tolist() == [-1, -1, -1] and not cut.any()


def test_step_rewards() -> None:
    term = np.array([False, False, True])
    z = np.zeros(3, np.float32)
    assert step_rewards("sparse", stored_reward=z, success=True, terminated=term, max_steps=10).tolist() == [
        0,
        0,
        1,
    ]
    assert step_rewards("sparse", stored_reward=z, success=False, terminated=term, max_steps=10).tolist() == [
        0,
        0,
        0,
    ]
    r = step_rewards("steps_to_go", stored_reward=z, success=True, terminated=term, max_steps=10)
    np.testing.assert_allclose(r, [-0.1, -0.1, -0.1])
    r = step_rewards("steps_to_go", stored_reward=z, success=False, terminated=term, max_steps=10)
    np.testing.assert_allclose(r, [-0.1, -0.1, -1.1])
    dense = np.array([0.1, 0.2, 0.3], np.float32)
    np.testing.assert_allclose(
        step_rewards("dense", stored_reward=dense, success=True, terminated=term, max_steps=10), dense
    )
    # shaped: success + γΦ(s') − Φ(s), Φ(s_0) = 0, Φ(terminal) = 0 (by hand, γ = 0.5)
    r = step_rewards("shaped", stored_reward=dense, success=True, terminated=term, max_steps=10, gamma=0.5)
    np.testing.assert_allclose(r, [0.5 * 0.1 - 0.0, 0.5 * 0.2 - 0.1, 1.0 + 0.0 - 0.2], atol=1e-6)
    # a truncated failure keeps the last potential (no terminal state)
    r = step_rewards(
        "shaped", stored_reward=dense, success=False, terminated=np.zeros(3, bool), max_steps=10, gamma=0.5
    )
    np.testing.assert_allclose(r, [0.05, 0.0, 0.15 - 0.2], atol=1e-6)


# ---------------------------------------------------------------------------- buffer
def _buffer(gamma: float = 0.5, reward: str = "sparse") -> TransitionBuffer:
    buf = TransitionBuffer(SPEC, reward=reward, gamma=gamma, max_steps=10)  # type: ignore[arg-type]
    # episode 0: 5 frames, success (terminated at the end), a takeover at frames 2-3
    buf.add_episode(
        state=np.arange(10, dtype=np.float32).reshape(5, 2),
        action=np.arange(5, dtype=np.float32)[:, None],
        reward=np.zeros(5, np.float32),
        terminated=np.array([0, 0, 0, 0, 1], bool),
        controller=np.array([P, P, H_, H_, P]),
        success=True,
    )
    # episode 1: 3 frames, truncated failure
    buf.add_episode(
        state=100 + np.arange(6, dtype=np.float32).reshape(3, 2),
        action=10 + np.arange(3, dtype=np.float32)[:, None],
        reward=np.zeros(3, np.float32),
        terminated=np.zeros(3, bool),
        controller=np.array([P, P, P]),
        success=False,
    )
    return buf


def test_batch_hand_computed() -> None:
    buf = _buffer(gamma=0.5)
    assert len(buf) == 8
    b = buf.batch(np.array([0, 3, 4, 5, 7]), horizon=3, n_step=2)
    # chunks padded with the episode's last action
    assert b["action"][:, :, 0].tolist() == [[0, 1, 2], [3, 4, 4], [4, 4, 4], [10, 11, 12], [12, 12, 12]]
    assert b["action_is_pad"].tolist()[1] == [False, False, True]
    # sparse reward 1 on the success frame (ep0 frame 4): frame 3 sees it one step later (x0.5)
    assert b["reward_n"].tolist() == [0.0, 0.5, 1.0, 0.0, 0.0]
    # next state = frame t+2 when inside; terminal windows do not bootstrap; truncated ends are invalid
    assert b["next.state"][0].tolist() == [4.0, 5.0]
    assert b["bootstrap"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert b["valid"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert b["human"].tolist() == [False, True, False, False, False]
    assert b["credit"].tolist() == [0, -1, 1, 0, 0]
    # Monte-Carlo returns: cut at the takeover (frame 1 scores as a failure), success at the end
    np.testing.assert_allclose(buf.array("mc_return")[:5], [0.0, 0.0, 0.25, 0.5, 1.0])


def test_steps_to_go_returns_cut_at_takeover() -> None:
    buf = _buffer(gamma=1.0, reward="steps_to_go")
    mc = buf.array("mc_return")
    # frame 1 ends an autonomous stretch taken over by a human: -0.1 (its step) - 1 (failure)
    np.testing.assert_allclose(mc[:2], [-1.2, -1.1], rtol=1e-6)
    np.testing.assert_allclose(mc[2:5], [-0.3, -0.2, -0.1], rtol=1e-6)
    np.testing.assert_allclose(mc[5:], [-1.3, -1.2, -1.1], rtol=1e-6)


def test_add_episode_rejects_bad_shapes() -> None:
    buf = TransitionBuffer(SPEC)
    with pytest.raises(ValueError, match="action: expected shape"):
        buf.add_episode(
            state=np.zeros((3, 2)),
            action=np.zeros((3, 2)),
            reward=np.zeros(3),
            terminated=np.zeros(3, bool),
            controller=np.zeros(3),
            success=False,
        )
    with pytest.raises(ValueError, match="reward: expected one of"):
        TransitionBuffer(SPEC, reward="bogus")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- selection
def _record(
    store: EpisodeStore, robot: str, success: bool, revision: str, human_at: int | None = None
) -> str:
    w = store.create_episode(SPEC, robot_id=robot, task="toy", chunk_len=2)
    for i in range(6):
        if human_at is not None and i == human_at:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        w.add_frame(
            cameras={},
            state=np.full(2, i, np.float32),
            action=np.zeros(1, np.float32),
            reward=0.0,
            terminated=success and i == 5,
            truncated=not success and i == 5,
            controller=Controller.HUMAN if human_at is not None and i >= human_at else Controller.POLICY,
            revision=revision,
        )
    return w.close(outcome="success" if success else "failure", success=success).episode_id


def test_select_and_load_from_store(tmp_path) -> None:
    store = EpisodeStore(tmp_path / "store", create=True)
    a = _record(store, "arm-1", True, "rev-a")
    b = _record(store, "arm-2", False, "rev-b", human_at=3)
    c = _record(store, "arm-1", False, "rev-b")
    sel = Selection.parse("robot=arm-1", task="toy")
    assert select_episode_ids(store, sel) == [a, c]
    assert select_episode_ids(store, Selection.parse("revision=rev-b", task="toy")) == [b, c]
    assert select_episode_ids(store, Selection.parse("success=true", task="toy")) == [a]
    assert select_episode_ids(store, Selection.parse("max=1", task="toy")) == [c]
    with pytest.raises(ValueError, match=r"no closed episodes.*store import-lerobot"):  # not a sim task
        select_episode_ids(store, Selection.parse("robot=nobody", task="toy"))
    with pytest.raises(ValueError, match="sim demos --task PickCube"):
        select_episode_ids(store, Selection.parse(None, task="PickCube"))
    with pytest.raises(ValueError, match="needs the metadata DB"):
        select_episode_ids(store, Selection.parse("label.quality=good", task="toy"))
    with pytest.raises(ValueError, match="needs the metadata DB's rounds table"):
        select_episode_ids(store, Selection(task="toy", rounds=(2,)))
    assert not (store.root / "metadata.db").exists()  # selecting made no DB in the store
    # a round's episodes: those its checkpoint acted in (the store's DB, made now, indexes the store)
    db = MetadataDB.for_store(store.root)
    for _ in range(2):
        db.create_round(algo="awr", task="toy", base_ref="x", config={})
    db.update_round(2, checkpoint_revision="rev-a")
    assert select_episode_ids(store, Selection(task="toy", rounds=(2,)), db) == [a]
    buf = TransitionBuffer.from_store(store, [a, b], reward="sparse", gamma=0.9)
    assert len(buf) == 12
    human = buf.array("controller") == H_
    assert human.sum() == 3 and (buf.array("credit")[human] == -1).all()
    snap = buf.snapshot()
    assert snap["episode_lengths"] == {a: 6, b: 6} and snap["frames"] == 12 and len(snap["digest"]) == 40
    assert TransitionBuffer.from_store(store, [a, b]).snapshot()["digest"] == snap["digest"]
    assert TransitionBuffer.from_store(store, [a, c]).snapshot()["digest"] != snap["digest"]
    assert buf.array("credit")[:6].tolist() == [1] * 6 and buf.array("credit")[6:9].tolist() == [0] * 3


def test_every_frame_carries_its_episodes_instruction(tmp_path) -> None:
    """Stored episodes: each frame's instruction_index points at its episode's instruction (t and t + n);
    online episodes default to the spec's; the trainers embed ``buf.instructions`` once."""
    from vla_rl.train.transitions import next_observation

    store = EpisodeStore(tmp_path / "store", create=True)
    ids = []
    for text in ("push", "pull", "push"):
        w = store.create_episode(SPEC, robot_id="r", task="toy", instruction=text)
        w.add_frames({"state": np.zeros((3, 2), np.float32), "action": np.zeros((3, 1), np.float32)})
        ids.append(w.close().episode_id)
    buf = TransitionBuffer.from_store(store, ids)
    assert buf.instructions == ["push", "pull"]  # distinct, in order of first appearance
    assert buf.array("instruction").tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    batch = buf.batch(np.arange(9), horizon=2, n_step=2)
    assert batch["instruction_index"].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert torch.equal(next_observation(batch)["instruction_index"], batch["next.instruction_index"])
    assert buf.instruction_code() == 2 and buf.instructions[2] == "do it"  # the spec's (a simulator's)
    buf.add_episode(
        state=np.zeros((2, 2), np.float32),
        action=np.zeros((2, 1), np.float32),
        reward=np.zeros(2, np.float32),
        terminated=np.zeros(2, bool),
        controller=np.zeros(2, np.int64),
        success=True,
    )
    buf.add_episode(
        state=np.zeros((1, 2), np.float32),
        action=np.zeros((1, 1), np.float32),
        reward=np.zeros(1, np.float32),
        terminated=np.zeros(1, bool),
        controller=np.zeros(1, np.int64),
        success=True,
        instruction="pull",
    )
    assert buf.array("instruction")[9:].tolist() == [2, 2, 1] and len(buf.instructions) == 3


def test_selection_parse_errors() -> None:
    with pytest.raises(ValueError, match="unknown key 'colour'"):
        Selection.parse("colour=red", task="t")
    with pytest.raises(ValueError, match="success: expected true or false"):
        Selection.parse("success=maybe", task="t")
    with pytest.raises(ValueError, match="since: expected unix seconds or an ISO date"):
        Selection.parse("since=yesterday", task="t")
    sel = Selection.parse("robot=a|b, since=2026-11-01, label.quality=good, round=3|4", task="t")
    assert sel.robots == ("a", "b") and sel.rounds == (3, 4) and sel.labels == {"quality": "good"}
    assert sel.since is not None and sel.since > 1.7e9


def test_label_selection(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    a = _record(store, "arm-1", True, "r")
    b = _record(store, "arm-1", True, "r")
    db.add_label(a, "quality", "good", author="test")
    db.add_label(b, "quality", "bad", author="test")
    assert select_episode_ids(store, Selection.parse("label.quality=good", task="toy"), db=db) == [a]


# ---------------------------------------------------------------------------- critics
def test_q_ensemble_shapes_members_differ_and_pessimism() -> None:
    torch.manual_seed(0)
    q = ChunkQEnsemble(feature_dim=3, chunk_dim=4, members=5, hidden=(16, 16))
    out = q(torch.randn(7, 3), torch.randn(7, 2, 2))
    assert out.shape == (5, 7)
    assert out.std(0).mean() > 1e-3  # independently initialised members disagree
    with pytest.raises(ValueError, match="chunk"):
        q(torch.randn(7, 3), torch.randn(7, 3))
    vals = torch.tensor([[1.0, 2.0], [3.0, 2.0]])
    np.testing.assert_allclose(pessimistic(vals, 0.5).numpy(), [2.0 - 0.5, 2.0])


def test_q_ensemble_members_are_independent() -> None:
    torch.manual_seed(0)
    q = ChunkQEnsemble(feature_dim=2, chunk_dim=2, members=3, hidden=(8,))
    f, a = torch.randn(4, 2), torch.randn(4, 2)
    q(f, a)[1].sum().backward()  # only member 1's output
    assert q.layers[0].weight.grad[0].abs().sum() == 0
    assert q.layers[0].weight.grad[1].abs().sum() > 0


def test_expectile_loss_hand_computed() -> None:
    pred = torch.tensor([0.0, 0.0])
    target = torch.tensor([1.0, -2.0])
    # tau=0.8: 0.8 * 1 + 0.2 * 4 = 1.6, mean 0.8
    assert float(expectile_loss(pred, target, 0.8)) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="tau"):
        expectile_loss(pred, target, 1.0)


def test_expectile_regression_converges_to_the_expectile() -> None:
    torch.manual_seed(0)
    target = torch.tensor([0.0, 1.0])
    v = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.5)
    for _ in range(300):
        opt.zero_grad()
        expectile_loss(v.expand(2), target, 0.9).backward()
        opt.step()
    assert float(v.detach()) == pytest.approx(0.9, abs=1e-3)  # tau-expectile of {0, 1} is tau


def test_categorical_projection_and_quantile() -> None:
    head = CategoricalValue(feature_dim=2, bins=5, v_min=-1.0, v_max=0.0, hidden=(8,))
    probs = head.project(torch.tensor([-0.375, 0.5, -2.0]))
    # -0.375 sits between atoms -0.5 and -0.25, half way: 0.5 / 0.5
    np.testing.assert_allclose(probs[0].numpy(), [0, 0, 0.5, 0.5, 0])
    np.testing.assert_allclose(probs[1].numpy(), [0, 0, 0, 0, 1])  # clamped to v_max
    np.testing.assert_allclose(probs[2].numpy(), [1, 0, 0, 0, 0])
    assert torch.allclose((probs * head.atoms).sum(-1)[0], torch.tensor(-0.375))
    # train on a bimodal target: mean and quantiles come out right
    torch.manual_seed(0)
    feats = torch.zeros(64, 2)
    targets = torch.where(torch.arange(64) % 4 == 0, torch.tensor(-1.0), torch.tensor(0.0))
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        head.loss(feats, targets).backward()
        opt.step()
    f = torch.zeros(1, 2)
    assert float(head.mean(f).detach()) == pytest.approx(-0.25, abs=0.03)
    assert float(head.quantile(f, 0.1)) == -1.0 and float(head.quantile(f, 0.9)) == 0.0


def test_value_mlp_and_polyak() -> None:
    torch.manual_seed(0)
    v, target = ValueMLP(3, (8,)), ValueMLP(3, (8,))
    assert v(torch.randn(5, 3)).shape == (5,)
    before = [p.clone() for p in target.parameters()]
    polyak_update(target, v, 0.25)
    for b, t, s in zip(before, target.parameters(), v.parameters(), strict=True):
        torch.testing.assert_close(t, 0.75 * b + 0.25 * s)


def test_selection_exclude_parses_and_adds_ids() -> None:
    sel = Selection.parse("success=true,exclude=a|b,max=5", task="t")
    assert sel.exclude == ("a", "b") and sel.max_episodes == 5 and sel.success is True
    again = Selection.parse(sel.with_excluded(["b", "c"]).to_text(), task="t")
    assert again.exclude == ("a", "b", "c") and again.max_episodes == 5 and again.success is True
    assert Selection.parse(None, task="t").with_excluded([]).to_text() == ""

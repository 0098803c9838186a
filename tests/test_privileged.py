"""Privileged value inputs (vla_rl/train/privileged.py): every buffered frame's replayed simulator state,
standardised, hindsight copies reading their source; an episode that cannot be replayed is named; and
awr-pi and offline AWR run with ``value_input = "privileged"`` end to end (kinematic task: seconds; the
camera-to-state replay on the real PickCube is tests/test_replay.py's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from tiny_base import demo_store, tiny_sft

from fleet.selection import Selection
from fleet.store import EpisodeStore
from sim.registry import make_env
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.awr import AWRConfig
from vla_rl.train.hindsight import add_hindsight_copies, goal_layout
from vla_rl.train.privileged import ReplayedStates
from vla_rl.train.transitions import load_transitions

REACH = "kinematic/Reach-v0"


@pytest.fixture(scope="module")
def sloppy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """8 Reach demos at noise 0.9 (some fail: hindsight has copies to make) and a tiny base."""
    root = tmp_path_factory.mktemp("privileged")
    store = demo_store(root / "store", REACH, episodes=8, noise=0.9, seed=3)
    return store.root, tiny_sft(REACH, store.root, root / "sft", steps=10, batch_size=16)


def _replayed_by_hand(store: EpisodeStore, eid: str) -> np.ndarray:
    """The episode's states by stepping a fresh simulator from its seed, one action at a time."""
    ep = store.read_episode(eid, cameras=False)
    env = make_env(REACH)
    obs, _ = env.reset(seed=ep.meta.episode_seed)
    states = [obs["state"]]
    for a in ep.action[:-1]:
        states.append(env.step(a)[0]["state"])
    env.close()
    return np.asarray(states, np.float32)


def test_features_are_each_frames_replayed_state_standardised(sloppy: tuple[Path, Path]) -> None:
    store = EpisodeStore(sloppy[0])
    buf = load_transitions(store, Selection.parse(None, task=REACH), reward="shaped", gamma=0.99)
    n_source = len(buf)
    copies = add_hindsight_copies(buf, goal_layout(REACH, cameras=False))
    assert copies, "noise 0.9 should leave failures to relabel"
    replayed = ReplayedStates(REACH, lambda e: store.read_episode(e, cameras=False))
    try:
        feats = replayed.features(buf)
    finally:
        replayed.close()
    ep_idx, frame = buf.array("episode"), buf.array("frame")
    raw = np.zeros((len(buf), 7), np.float32)
    for k, eid in enumerate(buf.episode_ids):
        rows = np.flatnonzero(ep_idx == k)
        source = eid.removeprefix("hindsight:")
        raw[rows] = _replayed_by_hand(store, source)[frame[rows]]
    expect = (raw - raw.mean(axis=0)) / np.maximum(raw.std(axis=0), 1e-6)
    np.testing.assert_allclose(feats, expect, atol=1e-4)
    # a copy's rows read its source's states, not the relabelled goal it is trained on
    c = copies[0]
    rows = np.flatnonzero(ep_idx == c)
    src = buf.episode_ids.index(buf.episode_ids[c].removeprefix("hindsight:"))
    src_rows = np.flatnonzero(ep_idx == src)[: len(rows)]
    np.testing.assert_allclose(feats[rows], feats[src_rows], atol=1e-6)
    assert not np.allclose(buf.array("state")[rows], buf.array("state")[src_rows])  # the goal was relabelled
    assert len(buf) > n_source


def test_an_episode_without_a_seed_is_named(sloppy: tuple[Path, Path]) -> None:
    store = EpisodeStore(sloppy[0])
    buf = load_transitions(store, Selection.parse(None, task=REACH))
    first = store.read_episode(buf.episode_ids[0], cameras=False)
    unseeded = dataclasses.replace(first, meta=dataclasses.replace(first.meta, episode_seed=None))
    replayed = ReplayedStates(REACH, lambda e: unseeded)
    with pytest.raises(
        ValueError, match=rf"value_input 'privileged'.*{first.meta.episode_id} has no episode_seed"
    ):
        replayed.features(buf)
    replayed.close()
    # a camera policy's hindsight copies replay too: the message names what asked, not only the value
    cfg = AWRConfig(base="b", store=sloppy[0], out=sloppy[0].parent / "o", hindsight_weight=4.0)
    assert cfg.replay_uses(cameras=False) == []  # a state policy's own state holds the achieved goal
    assert cfg.replay_uses(cameras=True) == ["hindsight_weight > 0 on a camera policy"]
    both = dataclasses.replace(cfg, value_input="privileged").replay_uses(cameras=True)
    replayed = ReplayedStates(REACH, lambda e: unseeded, uses=both)
    with pytest.raises(
        ValueError, match=r"^value_input 'privileged' and hindsight_weight > 0 on a camera policy: "
    ):
        replayed.states(first.meta.episode_id)


def test_awr_pi_and_awr_train_with_a_privileged_value(sloppy: tuple[Path, Path], tmp_path: Path) -> None:
    store, base = sloppy
    common = dict(base=str(base), store=store, value_steps=5, batch_size=16, value_hidden=(16,), threads=1,
                  progress=False, device="cpu", value_input="privileged", reward="shaped", gamma=0.99)  # fmt: skip
    pi = train(
        make_config(
            "awr-pi",
            **common,
            out=tmp_path / "pi",
            episodes_per_iteration=2,
            num_envs=1,
            steps_per_iteration=3,
            env_steps=60,
            hindsight_weight=2.0,
        )
    )
    assert pi.curve and all(np.isfinite(r["value_loss"]) for r in pi.curve)
    assert pi.metrics["online_episodes"] >= 2
    off = train(make_config("awr", **common, out=tmp_path / "awr", steps=3, warmup_steps=1))
    assert np.isfinite(off.metrics["value_loss"])
    with pytest.raises(ValueError, match=r"value_input: expected policy or privileged, got 'oracle'"):
        make_config("awr", **{**common, "value_input": "oracle"}, out=tmp_path / "x")

"""Replaying recorded simulated episodes (sim/replay.py): the recorders keep each episode's reset seed,
and a camera episode of the real ManiSkill PickCube replayed in a state-mode simulator gives back its
recorded state as a prefix plus the privileged object pose; tampered actions and unseeded episodes are
refused with the episode named. And what replay is for: a camera policy's hindsight copies, computed on
the replayed state, are the state policy's copies of the same episodes cut to the camera state."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from vla_rl_client.meta import EpisodeMeta

from fleet.store import EpisodeStore
from sim.demos import record_demos
from sim.registry import make_env
from sim.replay import replay_episode, replay_states

PICK = "maniskill/PickCube-v1"


@pytest.fixture(scope="module")
def camera_store(tmp_path_factory: pytest.TempPathFactory) -> EpisodeStore:
    store = EpisodeStore(tmp_path_factory.mktemp("replay") / "store", create=True)
    record_demos(
        store,
        PICK,
        episodes=2,
        noise=0.5,
        seed=5,
        obs="rgb",
        image_size=16,
        max_episode_steps=50,
        progress=False,
        replayable=True,
    )
    return store


def test_a_camera_episode_replays_exactly_in_a_state_simulator(camera_store: EpisodeStore) -> None:
    episodes = list(camera_store.iter_episodes())
    assert sorted(e.meta.episode_seed for e in episodes) == [5, 6]  # the recorder's seed sequence
    env = make_env(PICK, obs="state")
    try:
        for ep in episodes:
            assert ep.cameras and ep.state.shape[1] == 29  # proprioception + the task extras
            states = replay_episode(env, ep)
            assert states.shape == (ep.length, 42)
            np.testing.assert_allclose(states[:, :29], ep.state, atol=1e-5)
            # recorded replayable: frame 0 too (without, a reset reports the previous episode's is_grasped)
            fresh = replay_states(env, ep.meta.episode_seed, ep.action[:1])
            np.testing.assert_allclose(fresh[0, :29], ep.state[0], atol=1e-5)
            # the columns a camera policy does not see: the cube's position, as the simulator has it
            env.reset(seed=ep.meta.episode_seed)
            np.testing.assert_allclose(states[0, 29:32], env.privileged()["obj_pos"], atol=1e-5)
            assert np.ptp(states[:, 29:32], axis=0).max() > 0.0 or ep.length < 5  # the cube is tracked

        ep = episodes[0]
        tampered = ep.action.copy()
        tampered[3:] = -tampered[3:]
        with pytest.raises(ValueError, match=rf"episode {ep.meta.episode_id} diverged at frame [4-9]"):
            replay_episode(env, dataclasses.replace(ep, action=tampered))
        unseeded = dataclasses.replace(ep, meta=dataclasses.replace(ep.meta, episode_seed=None))
        with pytest.raises(ValueError, match=r"has no episode_seed"):
            replay_episode(env, unseeded)
    finally:
        env.close()


def test_episode_seed_round_trips_and_old_metadata_reads_as_none(camera_store: EpisodeStore) -> None:
    meta = next(camera_store.iter_episodes()).meta
    d = meta.to_dict()
    assert EpisodeMeta.from_dict(d).episode_seed == meta.episode_seed is not None
    assert EpisodeMeta.from_dict({k: v for k, v in d.items() if k != "episode_seed"}).episode_seed is None


def test_a_writer_refuses_a_negative_episode_seed(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path / "s", create=True)
    env = make_env("kinematic/Reach-v0")
    w = store.create_episode(env.spec, robot_id="r", task=env.task)
    with pytest.raises(ValueError, match=r"episode_seed: expected a non-negative integer or None, got -1"):
        w.close(episode_seed=-1)
    assert w.close(episode_seed=3).episode_seed == 3


def test_camera_hindsight_copies_are_the_state_copies_cut_to_the_camera_state(
    camera_store: EpisodeStore, tmp_path: Path
) -> None:
    """The same 2 demos recorded in state mode (same seeds and expert: the same physics), both scored as
    failures so each gets a copy: the camera buffer's copies (replayed full state) must equal the state
    buffer's copies (the classic path) in their first 29 values, frames and actions, and keep the
    episode's images."""
    from vla_rl.train.hindsight import add_hindsight_copies, goal_layout
    from vla_rl.train.privileged import ReplayedStates
    from vla_rl.train.transitions import TransitionBuffer

    state_store = EpisodeStore(tmp_path / "state", create=True)
    record_demos(
        state_store,
        PICK,
        episodes=2,
        noise=0.5,
        seed=5,
        max_episode_steps=50,
        progress=False,
        replayable=True,
    )
    cam_eps, state_eps = list(camera_store.iter_episodes()), list(state_store.iter_episodes())
    cam_eps.sort(key=lambda e: e.meta.episode_seed)
    state_eps.sort(key=lambda e: e.meta.episode_seed)
    for c, s in zip(cam_eps, state_eps, strict=True):
        np.testing.assert_allclose(c.action, s.action, atol=1e-6)  # the same episodes

    def buffer(eps: list) -> TransitionBuffer:
        b = TransitionBuffer(eps[0].meta.spec, reward="sparse", gamma=0.99, max_steps=50)
        for ep in eps:
            b.add_stored_episode(ep, {"outcome": "failure"})
        return b

    cam_buf, state_buf = buffer(cam_eps), buffer(state_eps)
    # demos hold the cube but rest only at their (unstored) last state: reached = in hand, for this test
    layout = dataclasses.replace(goal_layout(PICK, cameras=True), still=None)
    by_id = {e.meta.episode_id: e for e in cam_eps}
    replayed = ReplayedStates(PICK, by_id.__getitem__)
    try:
        cam_copies = add_hindsight_copies(cam_buf, layout, replayed.states)
    finally:
        replayed.close()
    state_copies = add_hindsight_copies(state_buf, layout)
    assert len(cam_copies) == len(state_copies) >= 1
    ce, se = cam_buf.array("episode"), state_buf.array("episode")
    for kc, ks in zip(cam_copies, state_copies, strict=True):
        rc, rs = np.flatnonzero(ce == kc), np.flatnonzero(se == ks)
        assert len(rc) == len(rs)
        np.testing.assert_allclose(
            cam_buf.array("state")[rc], state_buf.array("state")[rs][:, :29], atol=1e-5
        )
        np.testing.assert_allclose(cam_buf.array("action")[rc], state_buf.array("action")[rs], atol=1e-6)
        source = np.flatnonzero(
            ce == cam_buf.episode_ids.index(cam_buf.episode_ids[kc].removeprefix("hindsight:"))
        )
        np.testing.assert_array_equal(
            cam_buf.array("image.base_camera")[rc], cam_buf.array("image.base_camera")[source[: len(rc)]]
        )
    with pytest.raises(ValueError, match="a camera buffer needs full_states"):
        add_hindsight_copies(cam_buf, layout)


def test_offline_awr_trains_a_camera_policy_with_a_privileged_value_and_hindsight_copies(
    camera_store: EpisodeStore, tmp_path: Path
) -> None:
    """The whole path on real PickCube camera episodes: a tiny camera base, then AWR with V on the replayed
    simulator state and the camera hindsight path (the demos all succeed: no copies; their equivalence is
    tested above); a few updates: the wiring, not learning."""
    from tiny_base import tiny_sft

    from vla_rl.train.algorithms import make_config, train

    base = tiny_sft(PICK, camera_store.root, tmp_path / "sft", steps=2, batch_size=8)
    cfg = make_config(
        "awr", base=str(base), store=camera_store.root, out=tmp_path / "awr", steps=2, warmup_steps=1,
        value_steps=3, batch_size=8, value_hidden=(8,), threads=1, progress=False, device="cpu",
        value_input="privileged", hindsight_weight=2.0, reward="shaped", gamma=0.99,
    )  # fmt: skip
    res = train(cfg)
    assert np.isfinite(res.metrics["value_loss"])


# slow: 6 state-mode demos replayed back to back and each in a new simulator (~1.5 min); run with -m slow
@pytest.mark.slow
def test_a_replay_is_the_same_back_to_back_as_in_a_new_simulator(tmp_path: Path) -> None:
    """clear_history: what the replaying simulator did before must not steer a replay (PhysX state left
    across resets made ~1 in 16 back-to-back replays drift by up to 2 cm before). The recordings
    themselves can carry such state from their own simulator's earlier episodes (docs/experiment-log.md),
    which replay_episode's check refuses; here only the replayer's history is under test."""
    store = EpisodeStore(tmp_path / "s", create=True)
    record_demos(store, PICK, episodes=6, noise=0.5, seed=0, progress=False)
    episodes = list(store.iter_episodes())[::-1]  # another order than recorded
    env = make_env(PICK, obs="state")
    try:
        back_to_back = [replay_states(env, ep.meta.episode_seed, ep.action) for ep in episodes]
    finally:
        env.close()
    for ep, states in zip(episodes, back_to_back, strict=True):
        new = make_env(PICK, obs="state")
        try:
            np.testing.assert_allclose(states, replay_states(new, ep.meta.episode_seed, ep.action), atol=1e-5)
        finally:
            new.close()


# slow: 12 demos on 2 worker processes, each replayed in a cleared simulator (~1 min); run with -m slow
@pytest.mark.slow
def test_episodes_recorded_replayable_on_workers_all_replay_exactly(tmp_path: Path) -> None:
    """Recorded without ``replayable``, 1 of these 12 episodes carried its simulator's history and was
    0.17 off its replay (docs/experiment-log.md); recorded replayable, every frame of every one matches,
    frame 0 included."""
    store = EpisodeStore(tmp_path / "s", create=True)
    record_demos(store, PICK, episodes=12, noise=0.5, seed=0, num_envs=2, progress=False, replayable=True)
    env = make_env(PICK, obs="state")
    try:
        for ep in store.iter_episodes():
            replayed = replay_states(env, ep.meta.episode_seed, ep.action)
            np.testing.assert_allclose(replayed, ep.state, atol=1e-5, err_msg=ep.meta.episode_id)
    finally:
        env.close()

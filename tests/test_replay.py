"""Replaying recorded simulated episodes (sim/replay.py): the recorders keep each episode's reset seed,
and a camera episode of the real ManiSkill PickCube replayed in a state-mode simulator gives back its
recorded state as a prefix plus the privileged object pose; tampered actions and unseeded episodes are
refused with the episode named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fleet.meta import EpisodeMeta
from fleet.store import EpisodeStore
from sim.demos import record_demos
from sim.registry import make_env
from sim.replay import replay_episode

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
        max_episode_steps=25,
        progress=False,
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

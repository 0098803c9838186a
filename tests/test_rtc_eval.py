"""Real-time chunking in evaluation (`vla-rl eval --rtc`): the rollout's proposer sends each robot's unexecuted
rest within an episode and nothing at an episode's start, and a loaded checkpoint's chunks with RTC rows
left empty are its plain chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_server import H, make_checkpoint, make_obs
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.spec import RobotSpec

import sim
from policies.loading import load_chunk_policy, load_policy
from vla_rl.evaluation import evaluate

TASK = "kinematic/Reach-v0"


@dataclass
class RecordingPolicy:
    """Chunks of zeros; records what real-time chunking each call carried."""

    spec: RobotSpec
    chunk_len: int = 4
    calls: list[list[Any]] = field(default_factory=list)

    def predict_chunks(self, obs: dict[str, Any], seed: int, rtc: list[Any]) -> np.ndarray:
        self.calls.append(rtc)
        return np.full((len(obs["state"]), self.chunk_len, self.spec.action_dim), 0.1, np.float32)


@pytest.fixture(scope="module")
def spec() -> RobotSpec:
    with sim.make_env(TASK) as env:
        return env.spec


def test_eval_rtc_on_sends_the_rest_of_each_robots_chunk(spec: RobotSpec) -> None:
    policy = RecordingPolicy(spec)
    evaluate(
        policy, TASK, episodes=2, num_envs=2, seed=3, n_exec=3, max_episode_steps=7, progress=False, rtc="on"
    )
    assert all(r is None for r in policy.calls[0])  # the episodes' first chunks: nothing to continue
    later = [r for call in policy.calls[1:] for r in call if r is not None]
    assert later and all(d == 0 and r.shape == (1, spec.action_dim) for d, r in later)  # H - n_exec = 1
    # 7 steps at 3 per chunk: chunks at steps 0, 3, 6 of each episode; the second episode starts afresh
    assert sum(r is None for call in policy.calls for r in call) >= 2


def test_eval_rtc_is_off_by_default_and_refused_where_it_cannot_run(spec: RobotSpec) -> None:
    @dataclass
    class Plain:
        spec: RobotSpec
        chunk_len: int = 4

        def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
            return np.zeros((len(obs["state"]), 4, self.spec.action_dim), np.float32)

    evaluate(Plain(spec), TASK, episodes=1, num_envs=1, max_episode_steps=3, progress=False)  # auto: off
    with pytest.raises(ValueError, match="cannot run real-time chunking"):
        evaluate(Plain(spec), TASK, episodes=1, progress=False, rtc="on")
    with pytest.raises(ValueError, match="rtc: expected one of"):
        evaluate(Plain(spec), TASK, episodes=1, progress=False, rtc="sometimes")


def test_a_checkpoints_rtc_chunks_keep_plain_rows_and_continue_the_others(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 0)
    rng = np.random.default_rng(0)
    obs_rows = [make_obs(rng) for _ in range(2)]
    obs = {
        "state": torch.from_numpy(np.stack([o["state"] for o in obs_rows])),
        "cameras": {"front": torch.from_numpy(np.stack([o["cameras"]["front"] for o in obs_rows]))},
        "instruction": ["push the cube"] * 2,
    }
    queued = rng.uniform(-0.5, 0.5, (H, 3)).astype(np.float32)
    for lp in (load_policy(ckpt, device="cpu"), load_chunk_policy(ckpt, device="cpu")):
        plain = lp.predict_chunks(obs, seed=5)
        rtc = lp.predict_chunks(obs, seed=5, rtc=[None, (1, queued)])
        np.testing.assert_allclose(rtc[0], plain[0], atol=RECOMPUTED_ATOL)
        assert np.abs(rtc[1, :1] - queued[:1]).mean() < np.abs(plain[1, :1] - queued[:1]).mean()

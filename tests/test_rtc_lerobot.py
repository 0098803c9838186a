"""Guided real-time chunking on LeRobot's flow VLAs served through the flow-policy contract: the server's
batch path (FlowPolicyModel) gives what LeRobot's own RTC gives (its policy with an ``RTCConfig``,
``predict_action_chunk(inference_delay=..., prev_chunk_left_over=...)``) on the same noise, queued actions
and settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from lerobot.policies.rtc.configuration_rtc import RTCConfig
from lerobot_offline import offline, one_torch_thread
from test_lerobot_flow_serving import INSTRUCTIONS, TINY, D, H, robot_obs
from tiny_vlas import SPEC, STATS

from policies.lerobot_adapter import to_lerobot_batch
from policies.lerobot_flow import FLOW_TYPES, LeRobotFlowPolicy
from policies.lerobot_tiny import save_tiny_policy
from policies.rtc import RTCSettings
from server.batching import RTCRequest
from server.slots import FlowPolicyModel, initial_noise


@pytest.fixture(autouse=True, scope="module")
def _offline_on_one_thread() -> Iterator[None]:
    with offline(), one_torch_thread():
        yield


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_served_guided_rtc_is_lerobots_rtc(ptype: str, tmp_path: Path) -> None:
    folder = save_tiny_policy(tmp_path / ptype, ptype, SPEC, words=INSTRUCTIONS, stats=STATS, seed=2, **TINY)
    fp = LeRobotFlowPolicy.load(folder)
    obs, seed, delay, horizon, max_w = robot_obs(1), 7, 2, 4, 5.0
    queued = np.random.default_rng(3).uniform(-1.0, 3.0, (5, SPEC.action_dim)).astype(np.float32)
    queued[:, 1] = queued[:, 1] * 3 - 2  # within the second dim's wider range

    model = FlowPolicyModel(fp, spec=SPEC, policy_type=ptype, commit="c", ref=str(folder))
    model.rtc_settings = RTCSettings(execution_horizon=horizon, max_guidance_weight=max_w)
    cams = {"top": obs["cameras"]["top"][None]}
    noise = initial_noise(seed, H, D)[None]
    ours, _ = model.infer_scored(
        obs["state"][None], cams, [obs["instruction"]], noise, rtc=[RTCRequest(delay, queued)]
    )

    fp.policy.config.rtc_config = RTCConfig(execution_horizon=horizon, max_guidance_weight=max_w)
    fp.policy.init_rtc_processor()
    batch = to_lerobot_batch(3, obs["state"][None], cams, [obs["instruction"]], fp.camera_keys)
    with torch.no_grad():
        padded = torch.from_numpy(np.concatenate([queued, queued[-1:].repeat(H - 5, 0)]))[None]
        prev = fp.normalize_actions(padded)[:, :5]  # LeRobot's leftover: the model's (normalised) space
        theirs = fp.policy.predict_action_chunk(
            fp.preprocessor(batch),
            noise=torch.from_numpy(noise),
            inference_delay=delay,
            prev_chunk_left_over=prev,
            execution_horizon=horizon,
        )
        theirs = fp.postprocessor(theirs)[0].numpy()
    np.testing.assert_allclose(ours[0], theirs, atol=1e-4, rtol=1e-4)
    plain, _ = model.infer_scored(obs["state"][None], cams, [obs["instruction"]], noise)
    assert np.abs(ours[0, :delay] - queued[:delay]).mean() < np.abs(plain[0, :delay] - queued[:delay]).mean()

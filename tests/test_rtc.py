"""Real-time chunking (policies/rtc.py): guided sampling equals LeRobot 0.6.1's RTCProcessor on the same
noise and velocity, rows without RTC are the plain sampler's, and the guided chunk's executed prefix
agrees with the queued actions."""

from __future__ import annotations

import pytest
import torch
from lerobot.configs import RTCAttentionSchedule
from lerobot.policies.common.flow_matching import euler_integrate
from lerobot.policies.rtc.configuration_rtc import RTCConfig
from lerobot.policies.rtc.modeling_rtc import RTCProcessor
from test_flow_policy import tiny_policy

from policies.flow_vla.conventions import velocity_to_openpi
from policies.flow_vla.sampling import euler_sample
from policies.rtc import (
    RTCGuide,
    RTCSettings,
    guidance_weight,
    inpaint_sample,
    prefix_weights,
    rtc_sample,
    step_cap,
)

H, D, K = 10, 3, 8


def toy_velocity(seed: int = 0):
    """A fixed nonlinear velocity v(x, t) (our time), the same function for both implementations."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(D, D, generator=g) * 0.5
    b = torch.randn(H, D, generator=g)

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tt = torch.as_tensor(t, dtype=x.dtype).expand(x.shape[0])[:, None, None]
        return torch.tanh(x @ m + tt * b) - x

    return v


@pytest.mark.parametrize("schedule", ["zeros", "ones", "linear", "exp"])
def test_prefix_weights_are_lerobots(schedule: str) -> None:
    proc = RTCProcessor(RTCConfig(prefix_attention_schedule=RTCAttentionSchedule(schedule.upper())))
    for delay, horizon in [(0, 5), (2, 5), (3, 10), (5, 5), (7, 4), (0, 12)]:
        ours = prefix_weights(delay, horizon, H, schedule)  # type: ignore[arg-type]
        theirs = proc.get_prefix_weights(delay, horizon, H)
        torch.testing.assert_close(ours, theirs.float(), atol=1e-7, rtol=0)


def test_guidance_weight_is_the_papers() -> None:
    t = torch.tensor([0.0, 0.25, 0.5, 0.9])
    r2 = (1 - t) ** 2 / (t**2 + (1 - t) ** 2)
    want = torch.minimum((1 - t) / (t * r2), torch.tensor(5.0))
    torch.testing.assert_close(guidance_weight(t, 5.0), want)
    assert guidance_weight(torch.tensor([0.0]), 5.0).item() == 5.0  # capped where the formula is infinite


@pytest.mark.parametrize(
    ("delay", "queued", "horizon", "max_w"), [(3, 8, 6, 8.0), (1, 10, None, 5.0), (4, 5, 8, 2.0)]
)
def test_guided_sampling_equals_lerobots_rtc_processor(
    delay: int, queued: int, horizon: int | None, max_w: float
):
    v = toy_velocity()
    x0 = torch.randn(1, H, D, generator=torch.Generator().manual_seed(1))
    prev = torch.randn(queued, D, generator=torch.Generator().manual_seed(2))
    settings = RTCSettings(execution_horizon=horizon, max_guidance_weight=max_w)
    ours = rtc_sample(v, x0, RTCGuide.build([prev], [delay], (H, D), settings), K).actions

    proc = RTCProcessor(RTCConfig(max_guidance_weight=max_w, execution_horizon=horizon or H))
    theirs = euler_integrate(
        velocity_to_openpi(v),  # LeRobot's loop runs openpi time (1 = noise) and velocity
        x0.clone(),
        K,
        rtc_processor=proc,
        rtc_enabled=True,
        inference_delay=delay,
        prev_chunk_left_over=prev[None],
        execution_horizon=horizon or H,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_rows_without_rtc_are_the_plain_sampler_in_a_mixed_batch() -> None:
    v = toy_velocity(3)
    x0 = torch.randn(3, H, D, generator=torch.Generator().manual_seed(4))
    prev = torch.randn(H, D, generator=torch.Generator().manual_seed(5))
    guide = RTCGuide.build([None, prev, None], [None, 3, 2], (H, D), RTCSettings())
    mixed = rtc_sample(v, x0, guide, K).actions
    plain = euler_sample(v, x0, K).actions
    assert torch.equal(mixed[[0, 2]], plain[[0, 2]])  # bit for bit (selected, never added to)
    assert not torch.allclose(mixed[1], plain[1], atol=1e-3)


def test_the_guided_chunk_continues_the_queued_actions_on_flowvla() -> None:
    policy = tiny_policy(chunk_len=8, n_exec=4)
    h, d = policy.event_shape
    obs = {"state": torch.randn(4, 3), "cameras": {}, "instruction": "reach"}
    x0 = torch.randn(4, h, d, generator=torch.Generator().manual_seed(6))
    prev = [torch.randn(6, d, generator=torch.Generator().manual_seed(7 + i)).clamp(-1, 1) for i in range(4)]
    delays = [1, 2, 3, 4]
    with torch.inference_mode():
        prefix = policy.encode_prefix(obs)
        vel = lambda x, t: policy.velocity(prefix, x, t)  # noqa: E731
        plain = euler_sample(vel, x0, 10).actions
        guided = rtc_sample(vel, x0, RTCGuide.build(prev, delays, (h, d), RTCSettings()), 10).actions
    for i, dl in enumerate(delays):
        err_guided = (guided[i, :dl] - prev[i][:dl]).abs().mean()
        err_plain = (plain[i, :dl] - prev[i][:dl]).abs().mean()
        assert err_guided < 0.25 * err_plain, (i, float(err_guided), float(err_plain))


def test_inpainting_keeps_the_given_prefix_exactly() -> None:
    calls: list[torch.Tensor] = []

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls.append(t.clone())
        assert t.shape == x.shape[:2]  # one flow time per action
        return -x

    x0 = torch.randn(2, H, D, generator=torch.Generator().manual_seed(8))
    prefix = torch.randn(2, H, D, generator=torch.Generator().manual_seed(9))
    out = inpaint_sample(v, x0, prefix, torch.tensor([3, 0]), 4).actions
    assert torch.equal(out[0, :3], prefix[0, :3])
    assert torch.equal(calls[1][0, :3], torch.ones(3)) and float(calls[1][0, 3]) == pytest.approx(0.25)
    torch.testing.assert_close(out[1], x0[1] * 0.75**4)  # row without a prefix: plain Euler on -x


def test_settings_are_validated_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="execution_horizon"):
        RTCSettings(execution_horizon=0)
    with pytest.raises(ValueError, match="max_guidance_weight"):
        RTCSettings(max_guidance_weight=0.0)
    with pytest.raises(ValueError, match="schedule"):
        RTCSettings(schedule="cosine")  # type: ignore[arg-type]


def test_the_guidance_weight_is_capped_at_the_step_count() -> None:
    """One Euler step with LeRobot's beta = 10 would land 9 errors past the queued actions; capped at K = 1
    the one step lands on them (weight 1 on the executed prefix)."""
    v = toy_velocity(4)
    x0 = torch.randn(1, H, D, generator=torch.Generator().manual_seed(10))
    prev = torch.randn(H, D, generator=torch.Generator().manual_seed(11))
    guide = RTCGuide.build([prev], [3], (H, D), RTCSettings(max_guidance_weight=10.0))
    out = rtc_sample(v, x0, guide, 1).actions
    torch.testing.assert_close(out[0, :3], prev[:3], atol=1e-5, rtol=1e-5)
    assert step_cap(10.0, 1) == 1.0 and step_cap(10.0, 10) == 10.0 and step_cap(5.0, 8) == 5.0

"""Flow-matching VLA policy: samplers on analytic fields, log-likelihoods by hand, loss, IO, overfitting.

The analytic toy: data x1 ~ N(MU, SD²) in 1-D, noise x0 ~ N(0, 1), x_t = (1 - t) x0 + t x1. Then
(x1 - x0, x_t) are jointly Gaussian and the exact flow velocity is linear in x:
v(x, t) = MU + (t SD² - (1 - t)) / var_t * (x - t MU), var_t = (1 - t)² + t² SD².
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.spec import CameraSpec, RobotSpec

from policies.flow_vla import (
    ConfigError,
    FlowVLAConfig,
    FlowVLAPolicy,
    SDESchedule,
    accel_score,
    chain_log_prob,
    compute_normalization_stats,
    euler_sample,
    from_openpi_time,
    learnable_noise_sample,
    sde_sample,
    straightness,
    to_openpi_time,
    velocity_from_openpi,
    velocity_to_openpi,
)
from policies.flow_vla.encoders import MiniLMEmbedder, random_shift
from policies.flow_vla.sampling import noise_kernel, sde_kernel

MU, SD = 1.5, 0.5
Normal = torch.distributions.Normal


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models: one intra-op thread. With 2 cores shared with other processes, torch's default
    2 spinning OpenMP threads ran these tests up to 25x slower than a single thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def toy_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Exact velocity of the linear interpolant for data N(MU, SD²), OUR convention (t = 1 data)."""
    t = t.view(-1, *([1] * (x.ndim - 1)))
    var = (1 - t) ** 2 + t**2 * SD**2
    return MU + (t * SD**2 - (1 - t)) / var * (x - t * MU)


def toy_velocity_openpi(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The same field derived independently in openpi's convention: x_s = s ε + (1 - s) a, u = ε - a."""
    s = s.view(-1, *([1] * (x.ndim - 1)))
    var = s**2 + (1 - s) ** 2 * SD**2
    return -MU + (s - (1 - s) * SD**2) / var * (x - (1 - s) * MU)


def tiny_config(**kw) -> FlowVLAConfig:
    base = dict(
        state_dim=3,
        action_dim=2,
        chunk_len=4,
        n_exec=2,
        d_model=32,
        n_layers=1,
        expert_n_layers=2,
        n_heads=4,
        instruction_encoder="none",
        noise_head_hidden=(16,),
        image_encoder_width=8,
        image_encoder_stages=1,
    )
    base.update(kw)
    return FlowVLAConfig(**base)


def tiny_obs(cfg: FlowVLAConfig, b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    obs: dict = {"state": torch.randn(b, cfg.state_dim, generator=g)}
    if cfg.cameras:
        obs["cameras"] = {
            c.name: torch.randint(0, 256, (b, c.height, c.width, 3), generator=g, dtype=torch.uint8)
            for c in cfg.cameras
        }
    if cfg.uses_instruction:
        obs["instruction_embedding"] = torch.randn(b, 384, generator=g)
    return obs


def randomize_noise_head(policy: FlowVLAPolicy) -> None:
    """The noise head's last layer starts at zero (constant std); make its std vary for the tests."""
    with torch.no_grad():
        policy.noise_head.out.weight.normal_(0, 1.0)
        policy.noise_head.out.bias.normal_(0, 1.0)


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"n_exec": 5, "chunk_len": 4}, "n_exec"),
        ({"action_dim": 0}, "action_dim"),
        ({"dropout": 1.0}, "dropout"),
        ({"instruction_encoder": "bert"}, "instruction_encoder"),
        ({"noise_std_min": 0.2, "noise_std_max": 0.1}, "noise_std_max"),
        ({"action_norm": "quantile"}, "action_norm"),
        ({"cameras": ({"name": "cam", "height": 0, "width": 8},)}, "cameras[0]"),
        ({"cameras": ({"name": "cam", "height": 8},)}, "cameras[0].width"),
        (
            {"normalization_stats": {"state": {"mean": [0.0] * 3, "std": [1.0] * 3}}},
            "normalization_stats.action",
        ),
        (
            {
                "normalization_stats": {
                    "state": {"mean": [0.0] * 3, "std": [1.0] * 3},
                    "action": {"min": [-1.0, -1.0], "max": [1.0]},
                }
            },
            "normalization_stats.action.max",
        ),
        ({"state_dim": 0, "instruction_encoder": "none"}, "state_dim"),
        ({"image_resize": 0}, "image_resize"),
        ({"image_resize": (32,)}, "image_resize"),
        ({"image_encoder": "vit"}, "image_encoder"),
        ({"image_encoder_weights": "weights/"}, "image_encoder_weights"),
        ({"freeze_image_encoder": True}, "freeze_image_encoder"),
        ({"image_encoder": "resnet18", "image_encoder_weights": ""}, "image_encoder_weights"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        tiny_config(**kwargs)
    assert e.value.field == field
    assert field in str(e.value)


def test_config_json_round_trip_and_unknown_fields() -> None:
    stats = compute_normalization_stats(torch.randn(50, 3), torch.randn(50, 4, 2))
    cfg = tiny_config(
        cameras=(CameraSpec("base_camera", 16, 16),),
        normalization_stats=stats,
        extras={"a": 1},
        image_resize=12,
    )
    assert cfg.image_resize == (12, 12)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["type"] == "flow_vla" and d["image_resize"] == [12, 12]
    assert FlowVLAConfig.from_dict(d) == cfg
    assert FlowVLAConfig.from_json(cfg.to_json()) == cfg
    policy = FlowVLAPolicy.from_config_dict(d)
    assert policy.config == cfg
    with pytest.raises(ConfigError, match="hidden_size"):
        FlowVLAConfig.from_dict({**d, "hidden_size": 3})
    with pytest.raises(ConfigError, match="type"):
        FlowVLAConfig.from_dict({**d, "type": "act"})
    spec = RobotSpec("arm", 7, 4, 20.0, "pick", cameras=(CameraSpec("hand", 32, 32),))
    from_spec = FlowVLAConfig.from_robot_spec(spec, d_model=64)
    assert (from_spec.state_dim, from_spec.action_dim, from_spec.camera_names, from_spec.d_model) == (
        7,
        4,
        ("hand",),
        64,
    )


# ---------------------------------------------------------------------- time conventions
def test_time_converters_round_trip() -> None:
    t = torch.linspace(0, 1, 9, dtype=torch.float64)  # dyadic: 1 - (1 - t) is exact
    assert torch.equal(from_openpi_time(to_openpi_time(t)), t)
    t = torch.rand(100, dtype=torch.float64)
    torch.testing.assert_close(to_openpi_time(from_openpi_time(t)), t, rtol=0, atol=1e-15)
    assert to_openpi_time(0.0) == 1.0 and from_openpi_time(1.0) == 0.0  # noise end
    x = torch.randn(7, 1, dtype=torch.float64)
    tt = torch.rand(7, dtype=torch.float64)
    v = toy_velocity(x, tt)
    # openpi field, derived independently, converts to ours; and ours converts back to openpi.
    torch.testing.assert_close(velocity_from_openpi(toy_velocity_openpi)(x, tt), v)
    torch.testing.assert_close(velocity_to_openpi(toy_velocity)(x, 1 - tt), toy_velocity_openpi(x, 1 - tt))


def test_openpi_sampler_equals_our_euler_on_converted_velocity() -> None:
    """openpi's loop (t: 1 -> 0, x += -1/K u) == our Euler (t: 0 -> 1, x += v/K) with v = -u(x, 1 - t)."""
    k = 10
    x0 = torch.randn(1000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x, t, dt = x0.clone(), 1.0, -1.0 / k
    while t >= -dt / 2:
        x = x + dt * toy_velocity_openpi(x, torch.full((x.shape[0],), t, dtype=x.dtype))
        t += dt
    ours = euler_sample(velocity_from_openpi(toy_velocity_openpi), x0, k).actions
    torch.testing.assert_close(ours, x, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- samplers on the analytic toy
def test_toy_ode_and_sde_keep_the_target_marginals() -> None:
    n = 20_000
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(n, 1, generator=g, dtype=torch.float64)
    ode = euler_sample(toy_velocity, x0, 100).actions
    assert abs(ode.mean().item() - MU) < 0.03 and abs(ode.std().item() - SD) < 0.02
    for schedule, k in (
        (SDESchedule("memoryless"), 10),
        (SDESchedule("memoryless"), 50),
        (SDESchedule("flow_sde", noise_level=0.5), 50),
    ):
        res = sde_sample(toy_velocity, x0, k, schedule, generator=g)
        assert abs(res.actions.mean().item() - MU) < 0.05, (schedule, k)
        assert abs(res.actions.std().item() - SD) < 0.05, (schedule, k)
        assert res.log_prob is not None and torch.isfinite(res.log_prob).all()


def test_flow_sde_with_sqrt2_is_the_memoryless_schedule() -> None:
    t = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    mem, fsde = SDESchedule("memoryless"), SDESchedule("flow_sde", noise_level=math.sqrt(2))
    torch.testing.assert_close(mem.sigma(t), fsde.sigma(t))
    torch.testing.assert_close(mem.sigma(t), torch.sqrt(2 * (1 - t) / t))
    # Flow-SDE is defined in openpi time s: σ = a sqrt(s / (1 - s)).
    s = to_openpi_time(t)
    torch.testing.assert_close(SDESchedule("flow_sde", 0.5).sigma(t), 0.5 * torch.sqrt(s / (1 - s)))


def test_memoryless_sde_step_is_qam_drift_and_single_step_log_prob() -> None:
    """Drift 2v - x/t (QAM), std sqrt(dt)·sqrt(2(1-t)/t); non-stochastic steps are plain ODE steps."""
    k, step = 10, 3
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(64, 1, generator=g, dtype=torch.float64)
    noise = torch.randn(64, k, 1, generator=g, dtype=torch.float64)
    res = sde_sample(toy_velocity, x0, k, stochastic_steps=[step], noise=noise, return_iterates=True)
    it, dt = res.iterates, 1.0 / k
    for i in range(k):
        x, t = it[:, i], torch.full((64,), i / k, dtype=torch.float64)
        v = toy_velocity(x, t)
        if i == step:
            mean = x + dt * (2 * v - x / (i / k))
            std = math.sqrt(dt) * math.sqrt(2 * (1 - i / k) / (i / k))
            torch.testing.assert_close(it[:, i + 1], mean + std * noise[:, i])
            expected_lp = Normal(mean, std).log_prob(it[:, i + 1]).sum(1)
        else:
            torch.testing.assert_close(it[:, i + 1], x + dt * v)
    torch.testing.assert_close(res.log_prob, expected_lp)
    recomputed = chain_log_prob(sde_kernel(toy_velocity, SDESchedule()), it, stochastic_steps=[step])
    torch.testing.assert_close(recomputed, expected_lp)


def test_learnable_noise_chain_on_analytic_field_matches_hand_sum() -> None:
    k = 5
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(32, 3, generator=g, dtype=torch.float64)
    noise = torch.randn(32, k, 3, generator=g, dtype=torch.float64)

    def noisy(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return toy_velocity(x, t), 0.1 + 0.05 * t.view(-1, 1).expand_as(x)

    mask = torch.tensor([True, True, False], dtype=torch.float64)
    res = learnable_noise_sample(noisy, x0, k, noise=noise, logprob_mask=mask, return_iterates=True)
    lp = Normal(0.0, 1.0).log_prob(x0)[:, :2].sum(1)
    x = x0
    for i in range(k):
        v, std = noisy(x, torch.full((32,), i / k, dtype=torch.float64))
        x_new = x + v / k + std * noise[:, i]
        lp = lp + Normal(x + v / k, std).log_prob(x_new)[:, :2].sum(1)
        x = x_new
    torch.testing.assert_close(res.actions, x)
    torch.testing.assert_close(res.log_prob, lp)
    again = chain_log_prob(noise_kernel(noisy), res.iterates, logprob_mask=mask, include_initial=True)
    torch.testing.assert_close(again, lp)


# ---------------------------------------------------------------------- the model's samplers
def test_euler_on_tiny_model_matches_hand_loop_exactly() -> None:
    torch.manual_seed(0)
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),))
    policy = FlowVLAPolicy(cfg).eval()
    obs = tiny_obs(cfg, 3)
    k = 7
    x0 = torch.randn(3, 1, cfg.chunk_len, cfg.action_dim)
    with torch.no_grad():
        out = policy.sample(obs, num_steps=k, noise=x0, return_iterates=True)
        prefix = policy.encode_prefix(obs)
        x = x0[:, 0]
        hand = [x]
        for i in range(k):
            x = x + (1.0 / k) * policy.velocity(prefix, x, i / k)
            hand.append(x)
    assert torch.equal(out.actions[:, 0], x)
    assert torch.equal(out.iterates[:, 0], torch.stack(hand, 1))


def test_learnable_noise_log_prob_by_hand_recompute_and_gradients() -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    policy = FlowVLAPolicy(cfg)
    randomize_noise_head(policy)
    obs = tiny_obs(cfg, 2)
    b, n, k, h, a = 2, 3, 4, cfg.chunk_len, cfg.action_dim
    x0 = torch.randn(b, n, h, a)
    eps = torch.randn(b, n, k, h, a)
    out = policy.sample(obs, method="noise", num_steps=k, num_samples=n, noise=x0, step_noise=eps)

    with torch.no_grad():
        prefix = policy.encode_prefix(obs)
        rows = prefix.repeat_interleave(n)
        x = x0.reshape(b * n, h, a)
        e = cfg.n_exec  # only the executed actions count
        lp = Normal(0.0, 1.0).log_prob(x)[:, :e].sum((1, 2))
        for i in range(k):
            v, hidden = policy.velocity(rows, x, i / k, return_hidden=True)
            std = policy.noise_std(hidden)
            assert (std >= cfg.noise_std_min - 1e-6).all() and (std <= cfg.noise_std_max + 1e-6).all()
            mean = x + v / k
            x_new = mean + std * eps.reshape(b * n, k, h, a)[:, i]
            lp = lp + Normal(mean, std).log_prob(x_new)[:, :e].sum((1, 2))
            x = x_new
    torch.testing.assert_close(out.actions.reshape(b * n, h, a), x)
    torch.testing.assert_close(out.log_prob.reshape(-1), lp)
    assert out.chain is not None and out.chain.iterates.shape == (b, n, k + 1, h, a)

    prefix = policy.encode_prefix(obs)  # with grad
    recomputed = policy.chain_log_prob(prefix, out.chain)
    torch.testing.assert_close(recomputed.detach().reshape(-1), lp)
    recomputed.sum().backward()
    for p in policy.noise_head.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert policy.expert.action_out.weight.grad.abs().sum() > 0  # the mean depends on the velocity


def test_sde_chain_log_prob_recompute_on_model() -> None:
    torch.manual_seed(0)
    cfg = tiny_config()
    policy = FlowVLAPolicy(cfg)
    obs = tiny_obs(cfg, 2)
    stoch = torch.zeros(2, 3, 5, dtype=torch.bool)
    stoch[..., 2] = True
    stoch[1, 0, 4] = True  # per-row masks are allowed
    out = policy.sample(
        obs,
        method="sde",
        num_steps=5,
        num_samples=3,
        schedule=SDESchedule("flow_sde", 0.5),
        stochastic_steps=stoch,
    )
    assert out.log_prob.shape == (2, 3)
    again = policy.chain_log_prob(policy.encode_prefix(obs), out.chain)
    torch.testing.assert_close(again, out.log_prob)


def test_batched_sampling_equals_unbatched_and_prefix_is_computed_once() -> None:
    torch.manual_seed(0)
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),))
    policy = FlowVLAPolicy(cfg).eval()
    b, n, k = 3, 4, 10
    obs = tiny_obs(cfg, b)
    noise = torch.randn(b, n, cfg.chunk_len, cfg.action_dim)
    calls = {"trunk": 0, "expert": 0}
    policy.trunk_norm.register_forward_hook(lambda *_: calls.__setitem__("trunk", calls["trunk"] + 1))
    policy.expert.register_forward_hook(lambda *_: calls.__setitem__("expert", calls["expert"] + 1))
    with torch.no_grad():
        batched = policy.sample(obs, num_steps=k, num_samples=n, noise=noise).actions
        assert calls == {"trunk": 1, "expert": k}  # one prefix for all B*N chains; one expert pass per step
        for i in range(b):
            one = {"state": obs["state"][i : i + 1], "cameras": {"cam": obs["cameras"]["cam"][i : i + 1]}}
            single = policy.sample(one, num_steps=k, num_samples=n, noise=noise[i : i + 1]).actions
            torch.testing.assert_close(single[0], batched[i], rtol=0, atol=RECOMPUTED_ATOL)
            # and one chain at a time
            for j in range(n):
                chain = policy.sample(one, num_steps=k, noise=noise[i : i + 1, j : j + 1]).actions
                torch.testing.assert_close(chain[0, 0], batched[i, j], rtol=0, atol=RECOMPUTED_ATOL)


def test_generator_makes_sampling_reproducible() -> None:
    cfg = tiny_config()
    policy = FlowVLAPolicy(cfg)
    obs = tiny_obs(cfg, 2)
    for method in ("ode", "sde", "noise"):
        a = policy.sample(
            obs, method=method, num_samples=2, generator=torch.Generator().manual_seed(5)
        ).actions
        b = policy.sample(
            obs, method=method, num_samples=2, generator=torch.Generator().manual_seed(5)
        ).actions
        assert torch.equal(a, b), method


def test_predict_action_chunk_is_unnormalised_and_clipped() -> None:
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 10.0])
    stats = {"state": {"mean": [1.0, 2.0, 3.0], "std": [2.0, 2.0, 2.0]}, "action": {"min": low, "max": high}}
    cfg = tiny_config(normalization_stats=stats)
    policy = FlowVLAPolicy(cfg).eval()
    obs = tiny_obs(cfg, 2)
    noise = torch.randn(2, cfg.chunk_len, cfg.action_dim) * 5  # large: some actions would leave the range
    chunk = policy.predict_action_chunk(obs, noise=noise)
    assert chunk.shape == (2, cfg.chunk_len, cfg.action_dim)
    assert (chunk >= low - 1e-5).all() and (chunk <= high + 1e-5).all()
    normed = policy.sample(obs, noise=noise[:, None]).actions[:, 0].clamp(-1, 1)
    torch.testing.assert_close(chunk, normed * (high - low) / 2 + (high + low) / 2)
    many = policy.predict_action_chunk(obs, num_samples=5)
    assert many.shape == (2, 5, cfg.chunk_len, cfg.action_dim)
    torch.testing.assert_close(policy.normalizer.normalize_action(high), torch.ones(2))


# ---------------------------------------------------------------------- loss
def test_flow_matching_loss_matches_hand_computation_and_masks_padding() -> None:
    torch.manual_seed(0)
    stats = compute_normalization_stats(torch.randn(40, 3), torch.randn(40, 2) * 3)
    cfg = tiny_config(normalization_stats=stats)
    policy = FlowVLAPolicy(cfg)
    b = 4
    batch = tiny_obs(cfg, b)
    batch["action"] = torch.randn(b, cfg.chunk_len, cfg.action_dim) * 3
    x0 = torch.randn(b, cfg.chunk_len, cfg.action_dim)
    t = torch.tensor([0.0, 0.3, 0.7, 0.999])
    loss, metrics = policy.flow_matching_loss(batch, noise=x0, time=t)

    x1 = policy.normalizer.normalize_action(batch["action"])
    tt = t.view(-1, 1, 1)
    x_t = (1 - tt) * x0 + tt * x1
    v = policy.velocity(policy.encode_prefix(batch), x_t, t)
    torch.testing.assert_close(loss, ((v - (x1 - x0)) ** 2).mean())
    assert metrics["loss"].item() == pytest.approx(loss.item())

    # Padding: padded steps do not count; each sample averages over its own valid steps.
    pad = torch.zeros(b, cfg.chunk_len, dtype=torch.bool)
    pad[0, 2:] = True
    pad[1, 1:] = True
    per = ((v - (x1 - x0)) ** 2).mean(-1)  # [B, H]
    valid = (~pad).float()
    expected = ((per * valid).sum(1) / valid.sum(1)).mean()
    padded = dict(batch, action_is_pad=pad)
    loss_pad, _ = policy.flow_matching_loss(padded, noise=x0, time=t)
    torch.testing.assert_close(loss_pad, expected)
    loss_w, _ = policy.flow_matching_loss(
        padded, noise=x0, time=t, weights=torch.tensor([2.0, 0.0, 1.0, 1.0])
    )
    torch.testing.assert_close(
        loss_w, ((per * valid).sum(1) / valid.sum(1) * torch.tensor([2.0, 0, 1, 1])).mean()
    )
    all_pad = dict(batch, action_is_pad=torch.ones(b, cfg.chunk_len, dtype=torch.bool))
    assert policy.flow_matching_loss(all_pad, noise=x0, time=t)[0].item() == 0.0


def test_training_time_distribution_emphasises_noise() -> None:
    policy = FlowVLAPolicy(tiny_config())
    torch.manual_seed(0)
    t = policy.sample_time(50_000)
    assert t.min() >= 0 and t.max() <= 0.999
    # s = 1 - t ~ 0.999 * Beta(1.5, 1) + 0.001 has mean 0.999 * 0.6 + 0.001; t = 0 is noise.
    assert t.mean().item() == pytest.approx(1 - (0.999 * 0.6 + 0.001), abs=0.01)
    assert (t < 0.5).float().mean() > 0.6


# ---------------------------------------------------------------------- uncertainty
def test_accel_is_zero_for_straight_paths_and_positive_for_curved() -> None:
    k, h, a = 10, 4, 2
    start, end = torch.randn(h, a), torch.randn(h, a)
    frac = torch.linspace(0, 1, k + 1).view(k + 1, 1, 1)
    straight = start + frac * (end - start)
    curved = straight + torch.sin(math.pi * frac) * torch.randn(h, a)
    assert accel_score(straight[None], n_exec=2).item() == pytest.approx(0.0, abs=1e-5)
    assert accel_score(curved[None], n_exec=2).item() > 0.1
    assert straightness(straight[None]).item() == pytest.approx(1.0, abs=1e-5)
    policy = FlowVLAPolicy(tiny_config())
    out = policy.sample(tiny_obs(policy.config, 2), num_samples=3, return_iterates=True)
    assert policy.accel(out.iterates).shape == (2, 3)


def test_accel_matches_a_hand_loop_and_scores_the_executed_sample() -> None:
    """accel_p = p * sum_{t=1}^{p-1} ||v_t - v_{t-1}|| / sum_{t=0}^{p-1} ||v_t|| over the executed window."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    it = torch.randn(2, 11, 4, 3, generator=g, dtype=torch.float64)  # [B, K + 1, H, A]
    scale = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    for n_exec, p, dim_scale in ((2, None, None), (3, 4, scale), (4, 10, None)):
        got = accel_score(it, n_exec=n_exec, prefix_steps=p, dim_scale=dim_scale)
        for b in range(2):
            x = it[b, :, :n_exec].numpy()
            if dim_scale is not None:
                x = x / dim_scale.numpy()
            x = x.reshape(11, -1)
            pp = 5 if p is None else p  # default: round(K / 2) with K = 10
            v = [x[t + 1] - x[t] for t in range(pp)]
            num = sum(np.linalg.norm(v[t] - v[t - 1]) for t in range(1, pp))
            den = sum(np.linalg.norm(v[t]) for t in range(pp))
            assert got[b].item() == pytest.approx(pp * num / (den + 1e-8), rel=1e-9)
    # the iterates a sample returns are its own Euler path: the last one is the chunk
    policy = FlowVLAPolicy(tiny_config())
    out = policy.sample(tiny_obs(policy.config, 2), return_iterates=True)
    assert out.iterates is not None
    torch.testing.assert_close(out.iterates[:, :, -1], out.actions, rtol=0, atol=0)


# ---------------------------------------------------------------------- weights IO
def test_state_dict_round_trips_through_safetensors_bit_exact(tmp_path: Path) -> None:
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),), instruction_encoder="minilm")
    policy = FlowVLAPolicy(cfg)
    sd = policy.state_dict()
    assert not any(k.startswith(("minilm", "instruction_encoder.model")) or "bert" in k for k in sd)
    assert {"normalizer.action_offset", "normalizer.action_scale", "normalizer.state_offset"} <= set(sd)
    assert sum(v.numel() for v in sd.values()) < 1_000_000  # MiniLM alone is ~22.7M
    path = tmp_path / "model.safetensors"
    policy.save_weights(path)
    assert set(load_file(str(path))) == set(sd)
    fresh = FlowVLAPolicy.from_config_dict(json.loads(cfg.to_json()))
    fresh.load_weights(path)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, sd[key]), key
    # plain safetensors on the plain state_dict works too (no shared or non-contiguous tensors)
    save_file(sd, str(tmp_path / "plain.safetensors"))
    obs = tiny_obs(cfg, 2)
    noise = torch.randn(2, cfg.chunk_len, cfg.action_dim)
    assert torch.equal(
        policy.predict_action_chunk(obs, noise=noise), fresh.predict_action_chunk(obs, noise=noise)
    )


def test_precomputed_instruction_embeddings_are_served_without_the_model() -> None:
    """``add_precomputed``: a machine without the encoder's weights gets the exact vectors computed elsewhere."""
    text = "an instruction no test embeds with the model: 7f3a"
    vec = torch.linspace(-1, 1, 384)
    before = MiniLMEmbedder.load_count
    MiniLMEmbedder.add_precomputed({text: vec.tolist()})
    emb = MiniLMEmbedder.embed([text, text])
    assert MiniLMEmbedder.load_count == before  # the model was not loaded for it
    assert emb.shape == (2, 384) and torch.equal(emb[0], vec) and torch.equal(emb[1], vec)
    with pytest.raises(ValueError, match="expected 384 floats"):
        MiniLMEmbedder.add_precomputed({"short": [0.0, 1.0]})


def test_minilm_instruction_is_frozen_cached_and_not_saved() -> None:
    cfg = tiny_config(instruction_encoder="minilm")
    policy = FlowVLAPolicy(cfg).eval()
    obs = {"state": torch.randn(2, 3), "instruction": ["pick up the cube", "push the cube"]}
    before = MiniLMEmbedder.load_count
    with torch.no_grad():
        p_text = policy.encode_prefix(obs)
        policy.encode_prefix(
            {"state": obs["state"], "instruction": "pick up the cube"}
        )  # one string, broadcast
    assert MiniLMEmbedder.load_count - before <= 1
    assert MiniLMEmbedder.load_count == 1  # once per process
    emb = MiniLMEmbedder.embed(obs["instruction"])
    assert emb.shape == (2, 384) and not emb.requires_grad
    assert not torch.allclose(emb[0], emb[1])
    with torch.no_grad():
        p_emb = policy.encode_prefix({"state": obs["state"], "instruction_embedding": emb})
    torch.testing.assert_close(p_text.tokens, p_emb.tokens)
    assert all(p.requires_grad for p in policy.parameters())  # nothing frozen lives in the module tree
    assert sum(p.numel() for p in policy.instruction_encoder.parameters()) == 384 * 2 + 384 * 32 + 32


# ---------------------------------------------------------------------- learning
def _overfit(cfg: FlowVLAConfig, batch: dict, steps: int, lr: float) -> tuple[float, float]:
    torch.manual_seed(0)
    policy = FlowVLAPolicy(cfg)
    b = batch["action"].shape[0]
    g = torch.Generator().manual_seed(1)
    # Fixed evaluation draws from the training time distribution: t = 0.999 (1 - u^(1/1.5)).
    evals = [
        (
            torch.randn(b, cfg.chunk_len, cfg.action_dim, generator=g),
            0.999 * (1 - torch.rand(b, generator=g) ** (1 / 1.5)),
        )
        for _ in range(16)
    ]

    def eval_loss() -> float:
        with torch.no_grad():
            return sum(policy.flow_matching_loss(batch, noise=n, time=t)[0].item() for n, t in evals) / len(
                evals
            )

    before = eval_loss()
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss, _ = policy.flow_matching_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, eval_loss()


def _dataset(b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(b, 3, generator=g)
    action = torch.tanh(state[:, None, :2] * torch.linspace(0.5, 1.5, 4)[None, :, None])
    return state, action


def test_tiny_state_only_model_overfits() -> None:
    state, action = _dataset(16)
    cfg = tiny_config(d_model=64, normalization_stats=compute_normalization_stats(state, action))
    before, after = _overfit(cfg, {"state": state, "action": action}, steps=300, lr=1e-3)
    assert after < before / 10, (before, after)


def test_tiny_image_and_state_model_overfits() -> None:
    """The state is uninformative here: the target is only readable from the image."""
    state, action = _dataset(16)
    img = (state.sigmoid() * 255).to(torch.uint8)[:, None, None, :].expand(16, 16, 16, 3).contiguous()
    cfg = tiny_config(d_model=64, cameras=(CameraSpec("cam", 16, 16),), image_augment_pad=0)
    batch = {"state": torch.zeros_like(state), "cameras": {"cam": img}, "action": action}
    before, after = _overfit(cfg, batch, steps=300, lr=1e-3)
    assert after < before / 10, (before, after)


# ---------------------------------------------------------------------- inputs
def test_random_shift_is_a_crop_of_the_padded_image() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 12, 10)
    y = random_shift(x, 2)
    padded = F.pad(x, (2, 2, 2, 2), mode="replicate")
    for i in range(6):
        crops = [padded[i, :, dy : dy + 12, dx : dx + 10] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(c, y[i]) for c in crops)


def test_bad_inputs_name_the_field() -> None:
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),))
    policy = FlowVLAPolicy(cfg)
    obs = tiny_obs(cfg, 2)
    with pytest.raises(ValueError, match="state"):
        policy.encode_prefix({**obs, "state": torch.zeros(2, 5)})
    with pytest.raises(ValueError, match=r"cameras\.cam"):
        policy.encode_prefix({**obs, "cameras": {}})
    with pytest.raises(ValueError, match="noise"):
        policy.sample(obs, noise=torch.zeros(2, 1, 3, 2))
    with pytest.raises(ValueError, match="instruction"):
        FlowVLAPolicy(tiny_config(instruction_encoder="minilm")).encode_prefix({"state": torch.zeros(1, 3)})


def test_config_json_without_newer_fields_loads_with_defaults() -> None:
    """A config.json written before image_resize (and the other later fields) existed still loads."""
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),))
    old = {k: v for k, v in cfg.to_dict().items() if k not in NEWER_FIELDS}
    assert FlowVLAConfig.from_dict(old) == cfg


NEWER_FIELDS = ("image_resize", "image_encoder", "image_encoder_weights", "freeze_image_encoder")


def test_images_are_resized_inside_the_model_to_image_resize() -> None:
    cfg = tiny_config(cameras=(CameraSpec("cam", 96, 96),), image_resize=(32, 24))
    policy = FlowVLAPolicy(cfg).eval()
    seen: list[tuple[int, ...]] = []
    policy.image_encoders["cam"].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    obs = tiny_obs(cfg, 2)
    assert obs["cameras"]["cam"].shape == (2, 96, 96, 3)
    policy.predict_action_chunk(obs)
    policy.train()
    policy.flow_matching_loss({**obs, "action": torch.zeros(2, cfg.chunk_len, cfg.action_dim)})
    assert seen == [(2, 3, 32, 24), (2, 3, 32, 24)]  # inference and training (with augmentation)
    native = tiny_config(cameras=(CameraSpec("cam", 96, 80),))
    assert native.image_input_size(native.cameras[0]) == (96, 80)  # no image_resize: the camera's size


# ---------------------------------------------------------------------- pretrained vision encoder
def random_resnet18_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A randomly initialised torchvision ResNet-18's state dict, as a real export has it (fc included)."""
    from torchvision.models import resnet18

    torch.manual_seed(seed)
    net = resnet18(weights=None)
    with torch.no_grad():
        for name, buf in net.named_buffers():  # non-trivial batch-norm statistics, so they are checked too
            if name.endswith(("running_mean", "running_var")):
                buf.uniform_(0.5, 1.5)
    return {k: v.contiguous() for k, v in net.state_dict().items()}


def resnet_config(**kw) -> FlowVLAConfig:
    return tiny_config(cameras=(CameraSpec("cam", 48, 48),), image_encoder="resnet18", image_resize=32, **kw)


def test_default_image_encoder_is_the_small_conv_net() -> None:
    cfg = tiny_config(cameras=(CameraSpec("cam", 16, 16),))
    assert cfg.image_encoder == "conv" and cfg.image_encoder_weights is None and not cfg.freeze_image_encoder
    assert type(FlowVLAPolicy(cfg).image_encoders["cam"]).__name__ == "ImageEncoder"


def test_resnet18_encoder_loads_safetensors_weights_frozen(tmp_path: Path) -> None:
    saved = random_resnet18_weights()
    save_file(saved, str(tmp_path / "model.safetensors"))
    cfg = resnet_config(image_encoder_weights=str(tmp_path), freeze_image_encoder=True)
    policy = FlowVLAPolicy(cfg)
    assert policy.load_pretrained_image_encoders() == 1
    backbone = policy.image_encoders["cam"].backbone.state_dict()
    assert set(backbone) == {k for k in saved if not k.startswith("fc.") and "num_batches" not in k}
    assert all(torch.equal(backbone[k], saved[k]) for k in backbone)
    # Frozen: only the projection trains; no gradient reaches the backbone.
    enc = policy.image_encoders["cam"]
    assert not any(p.requires_grad for p in enc.backbone.parameters())
    assert all(p.requires_grad for p in enc.proj.parameters())
    policy.train()
    obs = tiny_obs(cfg, 3)
    loss, _ = policy.flow_matching_loss({**obs, "action": torch.zeros(3, cfg.chunk_len, cfg.action_dim)})
    loss.backward()
    assert all(p.grad is None for p in enc.backbone.parameters()) and enc.proj.weight.grad is not None
    # The checkpoint carries the weights: a model rebuilt from the config alone (no weights source read)
    # and its saved weights is the same model, and batched inference equals unbatched.
    policy.eval().save_weights(tmp_path / "policy.safetensors")
    again = FlowVLAPolicy(FlowVLAConfig.from_dict({**cfg.to_dict(), "image_encoder_weights": None})).eval()
    again.load_weights(tmp_path / "policy.safetensors")
    noise = torch.randn(3, cfg.chunk_len, cfg.action_dim)
    batched = again.predict_action_chunk(obs, noise=noise)
    one = again.predict_action_chunk({k: _row(v, 1) for k, v in obs.items()}, noise=noise[1:2])
    assert torch.allclose(batched, policy.predict_action_chunk(obs, noise=noise))
    assert torch.allclose(batched[1:2], one, atol=RECOMPUTED_ATOL)
    # Not frozen: the backbone fine-tunes.
    assert all(p.requires_grad for p in FlowVLAPolicy(resnet_config()).image_encoders["cam"].parameters())


def _row(v, i: int):
    return {k: x[i : i + 1] for k, x in v.items()} if isinstance(v, dict) else v[i : i + 1]


def test_resnet18_weights_errors_name_the_field(tmp_path: Path) -> None:
    bad = random_resnet18_weights()
    bad["conv1.weight"] = torch.zeros(64, 1, 7, 7)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ConfigError, match=r"image_encoder_weights: .*conv1\.weight has shape \[64, 1, 7, 7\]"
    ) as e:
        FlowVLAPolicy(resnet_config(image_encoder_weights=str(tmp_path))).load_pretrained_image_encoders()
    assert e.value.field == "image_encoder_weights"
    save_file({"encoder.conv1.weight": torch.zeros(64, 3, 7, 7)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="not a torchvision ResNet-18"):
        FlowVLAPolicy(
            resnet_config(image_encoder_weights=str(tmp_path / "other.safetensors"))
        ).load_pretrained_image_encoders()
    (tmp_path / "weights.pt").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=r"only \.safetensors"):
        FlowVLAPolicy(
            resnet_config(image_encoder_weights=str(tmp_path / "weights.pt"))
        ).load_pretrained_image_encoders()
    with pytest.raises(ConfigError, match=r"no model\.safetensors"):
        FlowVLAPolicy(
            resnet_config(image_encoder_weights=str(tmp_path / "nowhere"))
        ).load_pretrained_image_encoders()

"""Training-time real-time chunking: FlowVLA's per-action flow times, the loss with the executed prefix given
clean, the SFT option saved in the checkpoint, and the server serving such a checkpoint in its trained mode
(the prefix fed clean; a delay beyond the checkpoint's maximum refused)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from test_flow_policy import tiny_policy
from test_server import SPEC, make_checkpoint, make_obs, start_server
from tiny_base import demo_store, tiny_sft
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.policy_client import PolicyClient, PolicyError, RTCInput
from vla_rl_client.spec import CameraSpec

from policies.flow_policy import FlowVLAFlowPolicy
from policies.flow_vla import FlowVLAPolicy
from policies.flow_vla.configuration_flow_vla import ConfigError, FlowVLAConfig
from policies.flow_vla.sampling import sample_delays
from policies.loading import load_policy
from policies.rtc import RTCSettings, sample_rtc
from vla_rl.hub.checkpoint import load_checkpoint
from vla_rl.train.sft import SFTConfig, train_with_rtc


def test_one_time_per_action_equals_the_rows_time() -> None:
    policy = tiny_policy(chunk_len=6, n_exec=3).model
    obs = {"state": torch.randn(3, 3), "cameras": {}, "instruction": "reach"}
    x = torch.randn(3, 6, 2)
    t = torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        prefix = policy.encode_prefix(obs)
        per_row = policy.velocity(prefix, x, t)
        per_action = policy.velocity(prefix, x, t[:, None].expand(3, 6))
    torch.testing.assert_close(per_action, per_row, atol=1e-6, rtol=1e-6)


def test_the_loss_gives_the_prefix_clean_and_scores_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = tiny_policy(chunk_len=6, n_exec=3, rtc_max_delay=3).model
    b = 2
    given = torch.tensor([[True, True, False, False, False, False], [False] * 6])
    monkeypatch.setattr(policy, "_rtc_prefix", lambda n, device: given)
    batch = {"state": torch.randn(b, 3), "cameras": {}, "instruction": "reach", "action": torch.rand(b, 6, 2)}
    noise, time = torch.randn(b, 6, 2), torch.tensor([0.3, 0.6])
    with torch.no_grad():
        loss = policy.per_sample_loss(batch, noise=noise, time=time)
        x1 = policy.normalizer.normalize_action(batch["action"])
        t = torch.where(given, torch.ones(b, 6), time[:, None].expand(b, 6))
        x_t = (1 - t[..., None]) * noise + t[..., None] * x1
        err = (policy.velocity(policy.encode_prefix(batch), x_t, t) - (x1 - noise)).square()
    torch.testing.assert_close(loss[0], err[0, 2:].mean(), atol=1e-6, rtol=1e-6)  # the given 2 do not count
    torch.testing.assert_close(loss[1], err[1].mean(), atol=1e-6, rtol=1e-6)


def _camera_policy(**kw) -> FlowVLAFlowPolicy:
    """A tiny FlowVLA with one 16x16 camera besides the state (put it in eval mode to turn off the
    random-shift augmentation the loss applies in training mode)."""
    cams = (CameraSpec("front", 16, 16),)
    return tiny_policy(
        cameras=cams, image_encoder="conv", image_encoder_width=8, image_encoder_stages=2, **kw
    )


def _camera_batch(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (b, 16, 16, 3), generator=g, dtype=torch.uint8)
    return {"state": torch.randn(b, 3, generator=g), "cameras": {"front": image}, "instruction": "push"}


def test_a_camera_policy_takes_per_action_times_and_scores_only_after_the_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The camera branch feeds the expert the same per-action times as the state one: one time per action
    equal to the row's is the row's time, and the loss gives the prefix clean and scores the rest."""
    policy = _camera_policy(chunk_len=6, n_exec=3, rtc_max_delay=3).model.eval()
    b = 2
    given = torch.tensor([[True, True, True, False, False, False], [False] * 6])
    monkeypatch.setattr(policy, "_rtc_prefix", lambda n, device: given)
    batch = {**_camera_batch(b), "action": torch.rand(b, 6, 2) * 2 - 1}
    noise, time = torch.randn(b, 6, 2), torch.tensor([0.2, 0.7])
    with torch.no_grad():
        loss = policy.per_sample_loss(batch, noise=noise, time=time)
        prefix = policy.encode_prefix(batch)
        x1 = policy.normalizer.normalize_action(batch["action"])
        t = torch.where(given, torch.ones(b, 6), time[:, None].expand(b, 6))
        x_t = (1 - t[..., None]) * noise + t[..., None] * x1
        err = (policy.velocity(prefix, x_t, t) - (x1 - noise)).square()
        per_row = policy.velocity(prefix, x_t, time)
    torch.testing.assert_close(policy.velocity(prefix, x_t, time[:, None].expand(b, 6)), per_row)
    torch.testing.assert_close(loss[0], err[0, 3:].mean(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss[1], err[1].mean(), atol=1e-6, rtol=1e-6)


def test_a_camera_policy_trained_for_rtc_samples_as_a_plain_one_at_no_delay() -> None:
    """Trained RTC at delay 0 (queued actions present but none given) is the plain sampler exactly, with
    cameras: what ``vla-rl eval`` and a 0 ms latency world ask of such a checkpoint."""
    policy = _camera_policy(chunk_len=6, n_exec=3, rtc_max_delay=3)
    policy.model.eval()
    obs = _camera_batch(3, seed=1)
    x0 = torch.randn(3, 6, 2)
    queued = np.full((4, 2), 0.25, np.float32)
    with torch.no_grad():
        plain = policy.model.sample(obs, noise=x0[:, None]).actions[:, 0]
        trained = sample_rtc(policy, obs, x0, [(0, queued), None, (0, queued)], RTCSettings()).actions
    torch.testing.assert_close(trained, plain, atol=1e-6, rtol=1e-6)


def test_rtc_max_delay_is_validated_and_saved(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rtc_max_delay"):
        tiny_policy(chunk_len=4, n_exec=2, rtc_max_delay=4)
    with pytest.raises(ValueError, match="rtc_max_delay"):
        SFTConfig(store=tmp_path, out=tmp_path / "o", init="scratch", chunk_len=4, n_exec=2, rtc_max_delay=4)
    policy = tiny_policy(chunk_len=4, n_exec=2)
    train_with_rtc(policy, 2)
    assert policy.rtc_max_delay == 2
    with pytest.raises(ValueError, match="rtc_max_delay"):
        train_with_rtc(object(), 1)  # type: ignore[arg-type]


def test_sft_records_the_maximum_delay_in_the_checkpoint(tmp_path: Path) -> None:
    store = demo_store(tmp_path / "store", "kinematic/Reach-v0", episodes=2, noise=0.5)
    ckpt = tiny_sft("kinematic/Reach-v0", store.root, tmp_path / "sft", 3, 8, rtc_max_delay=1)
    assert load_checkpoint(ckpt)[0].model_config["rtc_max_delay"] == 1


def test_the_uniform_delay_is_kept_and_the_mixture_draws_zero_at_its_probability() -> None:
    """rtc_zero_delay_prob None: d ~ U{0..D}, the same draws as before the option; p: d = 0 at rate p,
    else U{1..D}; d never exceeds D."""
    n, d_max = 70_000, 6
    torch.manual_seed(0)
    uniform = sample_delays(d_max, n, "cpu")
    torch.manual_seed(0)
    assert torch.equal(uniform, torch.randint(0, d_max + 1, (n,)))
    freq = torch.bincount(uniform, minlength=d_max + 1) / n
    torch.testing.assert_close(freq, torch.full((d_max + 1,), 1 / (d_max + 1)), atol=0.01, rtol=0)
    for p in (0.0, 0.4, 0.9):
        torch.manual_seed(1)
        mixed = sample_delays(d_max, n, "cpu", p)
        assert int(mixed.min()) >= 0 and int(mixed.max()) <= d_max
        freq = torch.bincount(mixed, minlength=d_max + 1) / n
        want = torch.tensor([p] + [(1 - p) / d_max] * d_max)
        torch.testing.assert_close(freq, want, atol=0.01, rtol=0)
    torch.manual_seed(2)
    assert int((sample_delays(d_max, n, "cpu", 0.0) == 0).sum()) == 0


def _scored_rate(model: FlowVLAPolicy, n: int) -> torch.Tensor:
    """``[H]``: the share of ``n`` training rows whose loss scores each action (the flow loss's mask)."""
    batch = {"state": torch.randn(n, 3), "cameras": {}, "instruction": "reach", "action": torch.rand(n, 6, 2)}
    torch.manual_seed(3)
    with torch.no_grad():
        valid = model._per_sample_loss(batch, None, None)[1]
    return (valid[..., 0] > 0).float().mean(0)


def test_the_first_action_is_trained_more_often_as_the_zero_delay_probability_rises() -> None:
    """Action h gets loss only when d <= h: U{0..3} scores action 0 in 1/4 of the rows, the mixture in p
    of them, and action h in p + (1 - p) h / 3; the last action always."""
    n, d_max = 4000, 3
    rates = {}
    for p in (None, 0.5, 0.8):
        model = tiny_policy(chunk_len=6, n_exec=3, rtc_max_delay=d_max, rtc_zero_delay_prob=p).model.eval()
        rates[p] = _scored_rate(model, n)
    assert rates[None][0] < rates[0.5][0] < rates[0.8][0]
    h = torch.arange(6, dtype=torch.float32)
    torch.testing.assert_close(rates[None], ((h + 1) / (d_max + 1)).clamp(max=1.0), atol=0.03, rtol=0)
    for p in (0.5, 0.8):
        torch.testing.assert_close(rates[p], (p + (1 - p) * h / d_max).clamp(max=1.0), atol=0.03, rtol=0)


def test_rtc_zero_delay_prob_is_validated(tmp_path: Path) -> None:
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ConfigError, match="rtc_zero_delay_prob"):
            tiny_policy(chunk_len=4, n_exec=2, rtc_max_delay=2, rtc_zero_delay_prob=bad)
        with pytest.raises(ValueError, match="rtc_zero_delay_prob"):
            SFTConfig(store=tmp_path, out=tmp_path / "o", rtc_max_delay=2, rtc_zero_delay_prob=bad)
    with pytest.raises(ConfigError, match="rtc_zero_delay_prob: expected None without"):
        tiny_policy(chunk_len=4, n_exec=2, rtc_zero_delay_prob=0.5)  # no training-time RTC to draw for
    with pytest.raises(ValueError, match="rtc_zero_delay_prob"):
        SFTConfig(store=tmp_path, out=tmp_path / "o", rtc_zero_delay_prob=0.5)
    policy = tiny_policy(chunk_len=4, n_exec=2)
    with pytest.raises(ValueError, match="rtc_zero_delay_prob"):
        train_with_rtc(policy, 2, 1.5)
    train_with_rtc(policy, 2, 0.5)
    assert (policy.rtc_max_delay, policy.rtc_zero_delay_prob) == (2, 0.5)
    train_with_rtc(policy, 2)
    assert policy.rtc_zero_delay_prob is None
    assert (
        tiny_policy(chunk_len=4, n_exec=2, rtc_max_delay=1, rtc_zero_delay_prob=0).rtc_zero_delay_prob == 0.0
    )


def test_sft_records_the_zero_delay_probability_and_an_old_checkpoint_reads_none(tmp_path: Path) -> None:
    store = demo_store(tmp_path / "store", "kinematic/Reach-v0", episodes=2, noise=0.5)
    ckpt = tiny_sft(
        "kinematic/Reach-v0", store.root, tmp_path / "sft", 2, 8, rtc_max_delay=1, rtc_zero_delay_prob=0.5
    )
    config = load_checkpoint(ckpt)[0].model_config
    assert (config["rtc_max_delay"], config["rtc_zero_delay_prob"]) == (1, 0.5)
    assert load_policy(ckpt, device="cpu").policy.config.rtc_zero_delay_prob == 0.5
    old = {k: v for k, v in config.items() if k != "rtc_zero_delay_prob"}  # written before the field
    assert FlowVLAConfig.from_dict(old).rtc_zero_delay_prob is None


def test_the_server_feeds_the_prefix_clean_and_refuses_longer_delays(tmp_path: Path) -> None:
    srv = start_server({"arm": make_checkpoint(tmp_path / "ckpt", 0, rtc_max_delay=2)})
    rng = np.random.default_rng(0)
    queued = rng.uniform(-0.5, 0.5, (3, SPEC.action_dim)).astype(np.float32)
    try:
        with PolicyClient(srv.address, timeout_s=30, model_id="arm", backoff=None) as c:
            info = c.info()["arm"]
            assert (info.rtc_mode, info.rtc_max_delay) == ("trained", 2)
            res = c.act(make_obs(rng), seed=4, rtc=RTCInput(2, queued))
            assert res.rtc is not None and (res.rtc.mode, res.rtc.inference_delay, res.rtc.queued) == (
                "trained",
                2,
                3,
            )
            np.testing.assert_allclose(res.actions[:2], queued[:2], atol=RECOMPUTED_ATOL)
            plain = c.act(make_obs(rng), seed=4)  # robots without RTC share the trained checkpoint
            assert plain.rtc is None and np.isfinite(plain.actions).all()
            with pytest.raises(PolicyError, match="rtc_max_delay") as e:
                c.act(make_obs(rng), seed=4, rtc=RTCInput(3, queued))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        srv.stop()

"""Training-time real-time chunking on LeRobot's SmolVLA and π0 (policies/lerobot_times.py): per-action flow
times in the velocity (one time per row gives today's velocity; each action token is LeRobot's at its own
time), the loss with the executed prefix given clean, SFT with ``rtc_max_delay`` on a LeRobot base
(recorded in the folder's sidecar), and the real gRPC server serving such a folder in trained mode (the
first d actions are the queued ones; a longer delay refused naming ``rtc_max_delay``). π0.5 is refused:
its expert is conditioned on the time through adaRMS, one condition per chunk in LeRobot as installed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from lerobot_offline import offline, one_torch_thread
from test_lerobot_flow_serving import INSTRUCTIONS, TINY, robot_obs
from test_train_lerobot import TINY as TRAIN_TINY
from test_train_lerobot import _sft as train_sft_on
from test_train_lerobot import store  # noqa: F401 (a fixture: the task's demonstrations, made once here)
from tiny_vlas import SPEC, STATS
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.policy_client import PolicyClient, PolicyError, RTCInput
from vla_rl_client.spec import RobotSpec

from fleet.store import EpisodeStore
from policies.flow_policy import FlowPolicyError
from policies.lerobot_flow import LINEAGE_FILE, LeRobotFlowPolicy
from policies.lerobot_times import PER_ACTION_TYPES
from policies.lerobot_tiny import save_tiny_policy
from server.config import ServerConfig
from server.policy_server import PolicyServer
from vla_rl.train.sft import train_with_rtc

MAX_DELAY = 2


@pytest.fixture(autouse=True, scope="module")
def _offline_on_one_thread() -> Iterator[None]:
    with offline(), one_torch_thread():
        yield


def _tiny(tmp_path: Path, ptype: str) -> LeRobotFlowPolicy:
    folder = save_tiny_policy(tmp_path / ptype, ptype, SPEC, words=INSTRUCTIONS, stats=STATS, seed=2, **TINY)
    return LeRobotFlowPolicy.load(folder).eval()


def _obs(n: int) -> dict[str, Any]:
    rows = [robot_obs(k) for k in range(n)]
    return {
        "state": torch.from_numpy(np.stack([r["state"] for r in rows])),
        "cameras": {"top": torch.from_numpy(np.stack([r["cameras"]["top"] for r in rows]))},
        "instruction": [r["instruction"] for r in rows],
    }


# ---------------------------------------------------------------------------- per-action times
@pytest.mark.parametrize("ptype", PER_ACTION_TYPES)
def test_one_time_per_action_equals_the_rows_time(ptype: str, tmp_path: Path) -> None:
    fp = _tiny(tmp_path, ptype)
    h, d = fp.event_shape
    x, t = torch.randn(3, h, d), torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        prefix = fp.encode_prefix(_obs(3))
        per_row = fp.velocity(prefix, x, t)
        per_action = fp.velocity(prefix, x, t[:, None].expand(3, h))
    torch.testing.assert_close(per_action, per_row, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ptype", PER_ACTION_TYPES)
def test_each_action_is_embedded_at_its_own_time(ptype: str, tmp_path: Path) -> None:
    """With a different time per action, action h's token is the one LeRobot's ``embed_suffix`` makes for
    action h at that time given to the whole chunk; the velocity differs from any one-time velocity."""
    fp = _tiny(tmp_path, ptype)
    m, (h, d) = fp.policy.model, fp.event_shape
    x, s = torch.randn(2, h, d), torch.rand(2, h)
    from policies.lerobot_times import action_time_tokens

    with torch.no_grad():
        ours = action_time_tokens(m, ptype, x, s)
        for j in range(h):
            args = (x, s[:, j]) if ptype == "smolvla" else (torch.zeros(2, 8), x, s[:, j])
            theirs = m.embed_suffix(*args)[0][:, -h:]
            torch.testing.assert_close(ours[:, j], theirs[:, j], atol=1e-5, rtol=1e-5)
        prefix = fp.encode_prefix(_obs(2))
        t = torch.linspace(0.2, 0.8, h).expand(2, h)
        mixed = fp.velocity(prefix, x, t)
        for j in (0, -1):  # not the velocity at any one of the times (the first or the last action's)
            assert not torch.allclose(mixed, fp.velocity(prefix, x, t[:, j]), atol=1e-4)


@pytest.mark.parametrize("ptype", PER_ACTION_TYPES)
def test_the_loss_gives_the_prefix_clean_and_scores_the_rest(
    ptype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp = _tiny(tmp_path, ptype)
    fp.set_rtc_max_delay(MAX_DELAY)
    h, d = fp.event_shape
    given = torch.zeros(2, h, dtype=torch.bool)
    given[0, :2] = True
    monkeypatch.setattr(fp, "_rtc_prefix", lambda b, device: given)
    rng = np.random.default_rng(0)
    batch = {**_obs(2), "action": torch.from_numpy(rng.uniform(-1, 3, (2, h, 2)).astype(np.float32))}
    noise, time = torch.randn(2, h, d), torch.tensor([0.3, 0.6])
    with torch.no_grad():
        loss = fp.loss(batch, noise=noise, time=time)
        x1 = fp.normalize_actions(batch["action"])
        t = torch.where(given, torch.ones(2, h), time[:, None].expand(2, h))
        x_t = (1 - t[..., None]) * noise + t[..., None] * x1
        err = (fp.velocity(fp.encode_prefix(batch), x_t, t) - (x1 - noise)).square()[..., :2]
    torch.testing.assert_close(loss[0], err[0, 2:].mean(), atol=1e-5, rtol=1e-4)  # the given 2 do not count
    torch.testing.assert_close(loss[1], err[1].mean(), atol=1e-5, rtol=1e-4)


def test_pi05_cannot_take_per_action_times(tmp_path: Path) -> None:
    fp = _tiny(tmp_path, "pi05")
    for bad in (lambda: fp.set_rtc_max_delay(1), lambda: train_with_rtc(fp, 1)):
        with pytest.raises(FlowPolicyError, match=r"rtc_max_delay.*pi05"):
            bad()
    h, d = fp.event_shape
    x, t = torch.randn(2, h, d), torch.tensor([0.25, 0.75])
    with torch.no_grad():
        prefix = fp.encode_prefix(_obs(2))
        one_per_row = fp.velocity(prefix, x, t[:, None].expand(2, h))  # one time per row: fine
        torch.testing.assert_close(one_per_row, fp.velocity(prefix, x, t), atol=1e-6, rtol=1e-6)
        with pytest.raises(FlowPolicyError, match=r"rtc_max_delay.*pi05"):
            fp.velocity(prefix, x, torch.linspace(0.1, 0.9, h).expand(2, h))


def test_lerobots_adarms_norm_takes_one_condition_per_chunk() -> None:
    """Why π0.5 is refused: a per-token condition [B, H, C] does not modulate each token (the norm
    broadcasts it to [B, B, H, W]). If LeRobot's norm starts taking one, π0.5 can join PER_ACTION_TYPES."""
    from lerobot.policies.pi_gemma import PiGemmaRMSNorm

    norm = PiGemmaRMSNorm(8, cond_dim=4)
    x = torch.randn(3, 5, 8)
    assert norm(x, cond=torch.randn(3, 4))[0].shape == (3, 5, 8)
    assert norm(x, cond=torch.randn(3, 5, 4))[0].shape != (3, 5, 8)


def test_rtc_max_delay_is_validated_and_kept_by_save(tmp_path: Path) -> None:
    fp = _tiny(tmp_path, "smolvla")
    for bad in (-1, TINY["chunk_size"], True):
        with pytest.raises(FlowPolicyError, match="rtc_max_delay"):
            fp.set_rtc_max_delay(bad)  # type: ignore[arg-type]
    fp.set_rtc_max_delay(MAX_DELAY)
    out = fp.save(tmp_path / "saved")
    assert json.loads((out / LINEAGE_FILE).read_text())["rtc_max_delay"] == MAX_DELAY
    assert LeRobotFlowPolicy.load(out).rtc_max_delay == MAX_DELAY
    assert _tiny(tmp_path / "plain", "smolvla").rtc_max_delay == 0


def test_the_zero_delay_probability_is_validated_drawn_and_kept_by_save(tmp_path: Path) -> None:
    fp = _tiny(tmp_path, "smolvla")
    for bad in (1.0, -0.5, True):
        with pytest.raises(FlowPolicyError, match="rtc_zero_delay_prob"):
            fp.set_rtc_max_delay(MAX_DELAY, bad)  # type: ignore[arg-type]
    with pytest.raises(FlowPolicyError, match="rtc_zero_delay_prob"):
        fp.set_rtc_max_delay(0, 0.5)  # no training-time RTC to draw a delay for
    assert fp.rtc_zero_delay_prob is None
    fp.set_rtc_max_delay(MAX_DELAY, 0.75)
    torch.manual_seed(0)
    given = fp._rtc_prefix(4000, torch.device("cpu"))
    assert abs(float((~given[:, 0]).float().mean()) - 0.75) < 0.03  # d = 0 at p: the first action scored
    out = fp.save(tmp_path / "saved")
    assert json.loads((out / LINEAGE_FILE).read_text())["rtc_zero_delay_prob"] == 0.75
    assert LeRobotFlowPolicy.load(out).rtc_zero_delay_prob == 0.75


def test_the_sidecar_reads_rtc_max_delay_and_refuses_a_bad_one(tmp_path: Path) -> None:
    from policies.lerobot_sidecar import Sidecar, read_sidecar
    from vla_rl.hub.checkpoint import CheckpointError

    assert Sidecar.from_dict({}).rtc_max_delay == 0  # a folder written before the field existed
    assert Sidecar.from_dict(Sidecar(rtc_max_delay=3).to_dict()).rtc_max_delay == 3
    for bad in (-1, 1.5, "2", True):
        (tmp_path / LINEAGE_FILE).write_text(json.dumps({"rtc_max_delay": bad}))
        with pytest.raises(CheckpointError, match="rtc_max_delay"):
            read_sidecar(tmp_path)
    assert Sidecar.from_dict({"rtc_max_delay": 3}).rtc_zero_delay_prob is None  # written before it
    both = Sidecar(rtc_max_delay=3, rtc_zero_delay_prob=0.5)
    assert Sidecar.from_dict(both.to_dict()) == both
    for bad_prob in (1.5, "0.5"):
        (tmp_path / LINEAGE_FILE).write_text(
            json.dumps({"rtc_max_delay": 3, "rtc_zero_delay_prob": bad_prob})
        )
        with pytest.raises(CheckpointError, match="rtc_zero_delay_prob"):
            read_sidecar(tmp_path)


# ---------------------------------------------------------------------------- SFT and serving
@pytest.fixture(scope="module")
def task(store: Path) -> tuple[Path, RobotSpec]:  # noqa: F811 (test_train_lerobot's store fixture)
    """The kinematic reach task's demonstrations from its 32 px camera and its robot spec."""
    from fleet.dataset import ChunkDataset

    return store, ChunkDataset(EpisodeStore(store), TRAIN_TINY["chunk_size"]).spec


@pytest.fixture(scope="module")
def trained(task: tuple[Path, RobotSpec], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A few SFT steps with rtc_max_delay on tiny SmolVLA and π0 bases of the task."""
    (demos, spec), root = task, tmp_path_factory.mktemp("rtc_lerobot")
    return {
        ptype: train_sft_on(
            demos,
            save_tiny_policy(root / ptype, ptype, spec, seed=0, **TRAIN_TINY),
            root / f"sft_{ptype}",
            2,
            rtc_max_delay=MAX_DELAY,
        )
        for ptype in PER_ACTION_TYPES
    }


@pytest.mark.parametrize("ptype", PER_ACTION_TYPES)
def test_sft_on_a_lerobot_base_records_the_maximum_delay(ptype: str, trained: dict[str, Path]) -> None:
    record = json.loads((trained[ptype] / LINEAGE_FILE).read_text())
    assert record["rtc_max_delay"] == MAX_DELAY and record["lineage"]["algorithm"] == "sft"
    assert json.loads((trained[ptype] / "config.json").read_text())["type"] == ptype
    assert LeRobotFlowPolicy.load(trained[ptype]).rtc_max_delay == MAX_DELAY


def test_sft_with_rtc_max_delay_refuses_a_pi05_base(task: tuple[Path, RobotSpec], tmp_path: Path) -> None:
    demos, spec = task
    base = save_tiny_policy(tmp_path / "pi05", "pi05", spec, seed=0, **TRAIN_TINY)
    with pytest.raises(ValueError, match=r"rtc_max_delay.*pi05"):
        train_sft_on(demos, base, tmp_path / "sft", 1, rtc_max_delay=1)


def test_the_server_serves_a_trained_lerobot_folder_in_trained_mode(
    task: tuple[Path, RobotSpec], trained: dict[str, Path]
) -> None:
    spec = task[1]
    refs = {ptype: str(folder) for ptype, folder in trained.items()}
    config = ServerConfig(checkpoint=refs["smolvla"], port=0, torch_threads=1, device="cpu")
    srv = PolicyServer(config, models=refs).start()
    rng = np.random.default_rng(0)
    cam = spec.cameras[0]
    try:
        for ptype in PER_ACTION_TYPES:
            with PolicyClient(srv.address, timeout_s=60, model_id=ptype, backoff=None) as c:
                info = c.info()[ptype]
                assert (info.rtc_mode, info.rtc_max_delay) == ("trained", MAX_DELAY)
                obs = {
                    "state": rng.normal(size=spec.state_dim).astype(np.float32),
                    "cameras": {cam.name: rng.integers(0, 256, (cam.height, cam.width, 3), dtype=np.uint8)},
                }
                queued = rng.uniform(-0.5, 0.5, (3, spec.action_dim)).astype(np.float32)
                res = c.act(obs, seed=4, rtc=RTCInput(MAX_DELAY, queued))
                assert res.rtc is not None and (res.rtc.mode, res.rtc.inference_delay) == (
                    "trained",
                    MAX_DELAY,
                )
                np.testing.assert_allclose(res.actions[:MAX_DELAY], queued[:MAX_DELAY], atol=RECOMPUTED_ATOL)
                assert not np.allclose(res.actions[MAX_DELAY], queued[MAX_DELAY], atol=RECOMPUTED_ATOL)
                with pytest.raises(PolicyError, match="rtc_max_delay") as e:
                    c.act(obs, seed=4, rtc=RTCInput(MAX_DELAY + 1, queued))
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        srv.stop()


def test_compiled_buckets_serve_trained_rtc_rows_as_eager_does(
    task: tuple[Path, RobotSpec], trained: dict[str, Path]
) -> None:
    """A served version with its denoising step compiled (dynamo's real graph capture on a backend that
    runs the captured graph): plain batches run the warm graphs, and a batch mixing trained-RTC rows (per
    action flow times, a shape the graphs were not captured for) with plain ones gives eager's chunks, the
    executed prefix kept."""
    from test_server_compile import graph_counting_compiler

    from policies.loading import load_servable
    from server.batching import RTCRequest
    from server.slots import ServedVersion

    spec, cam = task[1], task[1].cameras[0]
    rng = np.random.default_rng(3)
    rows = 3
    states = rng.normal(size=(rows, spec.state_dim)).astype(np.float32)
    cams = {cam.name: rng.integers(0, 256, (rows, cam.height, cam.width, 3), dtype=np.uint8)}
    queued = rng.uniform(-0.5, 0.5, (3, spec.action_dim)).astype(np.float32)
    rtc = [RTCRequest(MAX_DELAY, queued), None, RTCRequest(1, queued)]
    version, reference = (ServedVersion(load_servable(trained["smolvla"], device="cpu")) for _ in range(2))
    assert version.rtc_mode == "trained"
    noise = np.stack([version.initial_noise(s) for s in range(rows)])
    batch = (states, cams, ["reach the target"] * rows, noise)
    runs: list[int] = []
    compiled = version.start_compiled("on", 4, compiler=graph_counting_compiler(runs))
    assert compiled is not None and compiled.join(300) and compiled.ready == {1, 2, 4}, compiled.failed
    before = len(runs)
    plain = version.infer_scored(*batch)
    assert len(runs) > before  # the plain batch ran the warm graph of bucket 4
    np.testing.assert_allclose(plain[0], reference.infer_scored(*batch)[0], atol=RECOMPUTED_ATOL, rtol=1e-4)
    got = version.infer_scored(*batch, rtc)
    assert not compiled.failed  # the per-action rows took the eager path, compiling was not abandoned
    want = reference.infer_scored(*batch, rtc)
    np.testing.assert_allclose(got[0], want[0], atol=RECOMPUTED_ATOL, rtol=1e-4)
    np.testing.assert_allclose(got[0][0, :MAX_DELAY], queued[:MAX_DELAY], atol=RECOMPUTED_ATOL)
    np.testing.assert_allclose(got[0][1], plain[0][1], atol=RECOMPUTED_ATOL, rtol=1e-4)  # a plain row

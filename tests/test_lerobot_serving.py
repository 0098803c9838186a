"""LeRobot policies served by our policy server (policies/lerobot_adapter.py), on loopback.

Tiny randomly initialised ACT and Diffusion policies (ResNet-18 backbone without pretrained weights, one
transformer / U-Net level, 64 px camera) are saved with LeRobot's own ``save_pretrained`` and processor
pipelines. The reference for "right answer" is LeRobot itself: its async policy server's
``_predict_action_chunk`` for ACT, and ``DiffusionPolicy.select_action`` (its online path) for Diffusion.
PI0 needs PaliGemma weights that cannot be downloaded here: what is tested is that the adapter recognises
the type, derives the robot spec, and refuses a folder without weights quickly with a clear error.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.codec import to_tensor
from vla_rl_client.policy_client import PolicyClient, PolicyError, build_request
from vla_rl_client.spec import CameraSpec, RobotSpec

from policies.lerobot_adapter import is_lerobot_folder, save_random_policy, spec_from_config
from policies.loading import load_servable
from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.slots import initial_noise
from vla_rl.hub.checkpoint import CheckpointError

torch.set_num_threads(1)

TOKEN = "lerobot-test-token"
SPEC = RobotSpec("so100", 5, 3, 30.0, "", cameras=(CameraSpec("front", 64, 64),))
SC = grpc.StatusCode
TINY_ACT = dict(
    chunk_size=6,
    n_action_steps=6,
    dim_model=32,
    n_heads=2,
    dim_feedforward=64,
    n_encoder_layers=1,
    n_decoder_layers=1,
    n_vae_encoder_layers=1,
    latent_dim=8,
)
TINY_DIFFUSION = dict(
    horizon=8,
    n_action_steps=4,
    n_obs_steps=2,
    down_dims=(16, 32),
    crop_shape=None,
    diffusion_step_embed_dim=16,
    n_groups=4,
    num_inference_steps=3,
    spatial_softmax_num_keypoints=8,
    noise_scheduler_type="DDIM",  # deterministic given the initial noise (DDPM adds noise every step)
)
STATS = {
    "observation.state": {
        "mean": np.full(5, 0.5),
        "std": np.full(5, 2.0),
        "min": -np.ones(5),
        "max": np.ones(5),
    },
    "observation.images.front": {
        "mean": np.full((3, 1, 1), 0.4),
        "std": np.full((3, 1, 1), 0.3),
        "min": np.zeros((3, 1, 1)),
        "max": np.ones((3, 1, 1)),
    },
    "action": {
        "mean": np.array([1.0, -2.0, 0.5]),
        "std": np.array([3.0, 0.5, 1.0]),
        "min": -np.ones(3),
        "max": np.ones(3),
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lerobot")
    return {
        "act": save_random_policy(root / "act", "act", SPEC, seed=0, stats=STATS, **TINY_ACT),
        "act2": save_random_policy(root / "act2", "act", SPEC, seed=1, stats=STATS, **TINY_ACT),
        "diffusion": save_random_policy(
            root / "diffusion", "diffusion", SPEC, seed=2, stats=STATS, **TINY_DIFFUSION
        ),
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[PolicyServer]:
    models = {"act": str(folders["act"]), "diffusion": str(folders["diffusion"])}
    config = ServerConfig(
        checkpoint=models["act"], port=0, torch_threads=1, device="cpu", max_batch=8, max_wait_us=5000
    )
    srv = PolicyServer(config, models=models, token=TOKEN).start()
    yield srv
    srv.stop()


def make_obs(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "state": rng.normal(size=5).astype(np.float32),
        "cameras": {"front": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
    }


@pytest.fixture(scope="module")
def lerobot_server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """LeRobot's own async policy server object, set up as its SendPolicyInstructions would, without gRPC."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("lerobot_logs"))  # its logger writes ./logs/ at import
    try:
        from lerobot.async_inference.configs import PolicyServerConfig
        from lerobot.async_inference.policy_server import PolicyServer as LeRobotPolicyServer
    finally:
        os.chdir(cwd)
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.utils.feature_utils import hw_to_dataset_features

    srv = LeRobotPolicyServer(PolicyServerConfig(host="127.0.0.1", port=1))
    srv.device, srv.policy_type, srv.actions_per_chunk = "cpu", "act", TINY_ACT["chunk_size"]
    hw = {f"j{i}.pos": float for i in range(5)} | {"front": (64, 64, 3)}
    srv.lerobot_features = hw_to_dataset_features(hw, "observation", use_video=False)
    srv.policy = get_policy_class("act").from_pretrained(str(folders["act"]))
    srv.preprocessor, srv.postprocessor = make_pre_post_processors(
        srv.policy.config, pretrained_path=str(folders["act"])
    )
    return srv


def lerobot_act_reference(srv: Any, obs: dict[str, Any]) -> np.ndarray:
    from lerobot.async_inference.helpers import TimedObservation

    raw = {f"j{i}.pos": float(v) for i, v in enumerate(obs["state"])} | {"front": obs["cameras"]["front"]}
    timed = srv._predict_action_chunk(TimedObservation(timestamp=time.time(), timestep=0, observation=raw))
    return torch.stack([t.get_action() for t in timed]).numpy()


def lerobot_diffusion_reference(folder: Path, obs: dict[str, Any], seed: int) -> np.ndarray:
    """LeRobot's online path: reset, pre-process, select_action with the initial noise, post-process."""
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
    from lerobot.policies.factory import make_pre_post_processors

    policy = DiffusionPolicy.from_pretrained(str(folder))
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder))
    policy.reset()
    batch = pre(
        {
            "observation.state": torch.from_numpy(obs["state"]),
            "observation.images.front": torch.from_numpy(obs["cameras"]["front"]).permute(2, 0, 1).float()
            / 255,
        }
    )
    noise = torch.from_numpy(initial_noise(seed, 8, 3))[None]
    first = policy.select_action(batch, noise=noise)  # fills the action queue with the rest of the chunk
    chunk = torch.stack([first, *policy._queues["action"]], dim=1)
    return post(chunk)[0].numpy()


# ------------------------------------------------------------------------------------------------ tests
def test_serves_act_like_lerobot_does(
    server: PolicyServer, lerobot_server: Any, folders: dict[str, Path]
) -> None:
    with PolicyClient(server.address, timeout_s=30, model_id="act") as c:
        info = c.info()["act"]
        assert info.policy_type == "lerobot/act" and (info.chunk_len, info.n_exec) == (6, 6)
        spec = RobotSpec.from_json(info.robot_spec_json)
        assert (spec.state_dim, spec.action_dim, spec.cameras) == (5, 3, SPEC.cameras)
        assert info.commit.startswith("local:") and info.last_load_error == ""
        rng = np.random.default_rng(0)
        for _ in range(2):
            obs = make_obs(rng)
            r = c.act(obs, seed=3)
            assert r.actions.shape == (6, 3) and r.model_id == "act"
            assert np.isnan(r.uncertainty) and r.uncertainty_kind == ""  # LeRobot: not available
            np.testing.assert_allclose(r.actions, lerobot_act_reference(lerobot_server, obs), atol=1e-4)
        # post-processing really ran: un-normalised actions are centred on the action mean, not on 0
        assert abs(float(r.actions[:, 0].mean()) - 1.0) < abs(float(r.actions[:, 0].mean()))


def test_batched_lerobot_requests_match_unbatched(server: PolicyServer, lerobot_server: Any) -> None:
    rng = np.random.default_rng(1)
    work = [make_obs(rng) for _ in range(12)]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def robot(k: int) -> None:
        with PolicyClient(server.address, timeout_s=60, model_id="act") as c:
            barrier.wait()
            for i in range(k, len(work), 4):
                try:
                    results[i] = c.act(work[i])
                except BaseException as e:
                    errors.append(e)

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == len(work)
    assert max(r.batch_size for r in results.values()) > 1
    for i, obs in enumerate(work):
        np.testing.assert_allclose(results[i].actions, lerobot_act_reference(lerobot_server, obs), atol=1e-4)


def test_serves_diffusion_reproducibly_from_seed(server: PolicyServer, folders: dict[str, Path]) -> None:
    with PolicyClient(server.address, timeout_s=30, model_id="diffusion") as c:
        info = c.info()["diffusion"]
        assert info.policy_type == "lerobot/diffusion" and (info.chunk_len, info.n_exec) == (4, 4)
        obs = make_obs(np.random.default_rng(2))
        r = c.act(obs, seed=11)
        np.testing.assert_allclose(
            r.actions, lerobot_diffusion_reference(folders["diffusion"], obs, 11), atol=1e-4
        )
        # explicit noise over the policy's horizon [8, 3] is the same as the seed that draws it
        rn = c.act(obs, noise=initial_noise(11, 8, 3))
        np.testing.assert_allclose(rn.actions, r.actions, atol=RECOMPUTED_ATOL)
        assert not np.allclose(c.act(obs, seed=12).actions, r.actions)


@pytest.mark.parametrize(
    ("model", "obs", "mutate", "words"),
    [
        ("act", {"state": np.zeros(4, np.float32)}, None, ["observation.state", "[5]"]),
        ("act", {"cameras": {}}, None, ["observation.cameras.front", "missing"]),
        (
            "act",
            {"cameras": {"front": np.zeros((32, 32, 3), np.uint8)}},
            None,
            ["observation.cameras.front", "[64, 64, 3]"],
        ),
        ("act", {"state": np.array([0, np.nan, 0, 0, 0], np.float32)}, None, ["observation.state", "finite"]),
        ("act", {}, "noise", ["noise", "takes no initial noise"]),
        ("diffusion", {}, "noise", ["noise", "[8, 3]"]),
    ],
    ids=["state-size", "camera-missing", "image-shape", "state-nan", "act-noise", "diffusion-noise-shape"],
)
def test_bad_input_names_the_field(
    server: PolicyServer, model: str, obs: dict[str, Any], mutate: str | None, words: list[str]
) -> None:
    full = make_obs(np.random.default_rng(3)) | obs
    req = build_request(full, model_id=model)
    if mutate == "noise":
        req.noise.CopyFrom(to_tensor(np.zeros((4, 3), np.float32)))
    with PolicyClient(server.address, timeout_s=30) as c:
        with pytest.raises(PolicyError) as err:
            c.act_request(req)
        assert err.value.code == SC.INVALID_ARGUMENT
        for w in words:
            assert w in err.value.message, (w, err.value.message)
        assert c.act(make_obs(np.random.default_rng(4)), model_id=model).actions.shape[1] == 3


def test_swap_and_refusals(server: PolicyServer, folders: dict[str, Path], tmp_path: Path) -> None:
    """LoadCheckpoint with LeRobot folders: a good one swaps in; broken ones are refused, old keeps serving."""
    truncated = tmp_path / "truncated"
    shutil.copytree(folders["act2"], truncated)
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    wider = save_random_policy(tmp_path / "wider", "act", SPEC, **(TINY_ACT | {"dim_model": 48}))
    shutil.copy2(folders["act"] / "model.safetensors", wider / "model.safetensors")  # weights of another size
    unknown = tmp_path / "unknown"
    shutil.copytree(folders["act2"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(cfg | {"type": "not_a_policy"}))
    with PolicyClient(server.address, token=TOKEN, timeout_s=120, model_id="act") as c:
        old = c.info()["act"].commit
        obs = make_obs(np.random.default_rng(5))
        before = c.act(obs).actions
        for folder, words in (
            (truncated, ["model.safetensors"]),
            (wider, ["model.safetensors", "does not load"]),
            (unknown, ["type", "not_a_policy", "act"]),
        ):
            with pytest.raises(PolicyError) as err:
                c.load_checkpoint(str(folder))
            assert err.value.code == SC.FAILED_PRECONDITION, err.value
            for word in words:
                assert word in err.value.message, (word, err.value.message)
            assert c.info()["act"].commit == old
        np.testing.assert_allclose(c.act(obs).actions, before, atol=RECOMPUTED_ATOL)
        resp = c.load_checkpoint(str(folders["act2"]))
        assert resp.serving and resp.previous_commit == old
        after = c.act(obs)
        assert after.commit == resp.commit and not np.allclose(after.actions, before)
        assert c.rollback().commit == old
        np.testing.assert_allclose(c.act(obs).actions, before, atol=RECOMPUTED_ATOL)


def test_pi0_is_recognised_and_refused_without_weights(tmp_path: Path) -> None:
    from lerobot.policies.pi0.configuration_pi0 import PI0Config

    from policies.lerobot_adapter import features_for_spec

    spec = RobotSpec("aloha", 14, 14, 50.0, "", cameras=(CameraSpec("top", 224, 224),))
    inputs, outputs = features_for_spec(spec)
    folder = tmp_path / "pi0"
    folder.mkdir()
    PI0Config(input_features=inputs, output_features=outputs, device="cpu")._save_pretrained(folder)
    assert is_lerobot_folder(folder)
    derived, keys = spec_from_config(json.loads((folder / "config.json").read_text()))
    assert (derived.state_dim, derived.action_dim, derived.cameras) == (14, 14, spec.cameras)
    assert keys == {"top": "observation.images.top"} and derived.name == "lerobot/pi0"
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        load_servable(folder, device="cpu")
    assert "model.safetensors is missing" in str(err.value) and "PaliGemma" in str(err.value)
    assert time.monotonic() - t0 < 10, "must refuse before building a 4B-parameter model"


def test_config_without_robot_spec_counterpart_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "env_state"
    shutil.copytree(folders["act2"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["input_features"]["observation.environment_state"] = {"type": "ENV", "shape": [7]}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"input_features\.observation\.environment_state"):
        load_servable(folder, device="cpu")


@pytest.mark.slow  # ~50 s on 2 shared cores (lerobot import + model load in a fresh process)
def test_cli_serve_picks_the_lerobot_adapter(
    folders: dict[str, Path], cli_server: Callable[..., str]
) -> None:
    """`vla-rl serve --checkpoint LEROBOT_FOLDER` in its own process: the folder's "type" picks the adapter.

    The short version is every other test here: PolicyServer picks the adapter the same way in-process."""
    address = cli_server("--checkpoint", str(folders["act"]), "--device", "cpu", env={"OMP_NUM_THREADS": "1"})
    with PolicyClient(address, timeout_s=2.0) as c:
        assert c.info()["default"].policy_type == "lerobot/act"
        assert c.act(make_obs(np.random.default_rng(6)), timeout_s=30).actions.shape == (6, 3)


def test_rtc_is_refused_for_a_policy_that_cannot_run_it(server: PolicyServer) -> None:
    """ACT and Diffusion are not flow policies: GetInfo's rtc_mode is empty and a request with an inference
    delay is refused naming the field (the robot falls back to its merges)."""
    from vla_rl_client.policy_client import RTCInput

    obs = make_obs(np.random.default_rng(5))
    with PolicyClient(server.address, timeout_s=30, backoff=None) as c:
        assert {m: i.rtc_mode for m, i in c.info().items()} == {"act": "", "diffusion": ""}
        with pytest.raises(PolicyError, match=r"inference_delay.*cannot run real-time chunking") as err:
            c.act(obs, model_id="act", rtc=RTCInput(1, np.zeros((2, 3), np.float32)))
        assert err.value.code == SC.INVALID_ARGUMENT

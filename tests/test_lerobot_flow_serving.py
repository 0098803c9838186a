"""LeRobot's flow VLAs (SmolVLA, π0, π0.5) served by our policy server through the flow-policy contract.

Tiny configurations of the published architectures built here (policies/lerobot_tiny.py; no download, a
guard refuses any connection off this machine). What is checked, per type, on loopback gRPC:

* N robots with different observations, instructions and seeds answered in ONE batch get exactly what a
  batch of one gives each of them, and what LeRobot's own ``predict_action_chunk`` + post-processor gives
  on the same initial noise (the seed's, drawn as :func:`server.slots.initial_noise`): every chunk is
  routed to its own robot;
* each reply carries the ``accel`` uncertainty of its own ODE iterates (a one-step head: none);
* the folder is served through the contract (:class:`server.slots.FlowPolicyModel`), not LeRobot's
  per-policy ``predict_action_chunk`` path, which stays for ACT / Diffusion and for a flow VLA config
  the contract refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from lerobot_offline import offline, one_torch_thread
from tiny_vlas import SPEC, STATS
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.policy_client import PolicyClient
from vla_rl_client.spec import RobotSpec

from policies.flow_policy import FlowPolicyError
from policies.flow_vla.uncertainty import accel_score
from policies.lerobot_adapter import LeRobotModel, to_lerobot_batch
from policies.lerobot_flow import FLOW_TYPES, LeRobotFlowPolicy
from policies.lerobot_tiny import save_tiny_policy
from policies.loading import LoadedFlowPolicy, load_servable
from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.slots import FlowPolicyModel, ServedVersion, initial_noise

INSTRUCTIONS = ("push the red cube", "pick up the block", "open the drawer", "press the green button")
TINY = {"chunk_size": 6, "n_action_steps": 3, "max_state_dim": 8, "max_action_dim": 8}
H, D = 6, 8  # the chunk and the model's padded action dims: the initial noise a seed draws
N_ROBOTS = 4


@pytest.fixture(autouse=True, scope="module")
def _offline_on_one_thread() -> Iterator[None]:
    with offline(), one_torch_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served_vlas")
    return {
        ptype: save_tiny_policy(root / ptype, ptype, SPEC, words=INSTRUCTIONS, stats=STATS, seed=2, **TINY)
        for ptype in FLOW_TYPES
    }


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[PolicyServer]:
    """Every type under its own model id. A batch waits (up to 3 s) for all N robots, so the batched
    test really puts them in one batch."""
    refs = {ptype: str(folder) for ptype, folder in folders.items()}
    config = ServerConfig(
        checkpoint=refs["smolvla"],
        port=0,
        torch_threads=1,
        device="cpu",
        max_batch=N_ROBOTS,
        max_wait_us=3_000_000,
        adaptive_wait=False,
    )
    srv = PolicyServer(config, models=refs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lerobot(folders: dict[str, Path]) -> dict[str, LeRobotFlowPolicy]:
    """The folders built in the test process: LeRobot's own policy objects and processors."""
    return {ptype: LeRobotFlowPolicy.load(folder) for ptype, folder in folders.items()}


def robot_obs(k: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 + k)
    return {
        "state": rng.normal(size=3).astype(np.float32),
        "cameras": {"top": rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)},
        "instruction": INSTRUCTIONS[k % len(INSTRUCTIONS)],
    }


def lerobot_chunk(fp: LeRobotFlowPolicy, obs: dict[str, Any], seed: int) -> np.ndarray:
    """LeRobot's own answer for one robot: its pre-processor, ``predict_action_chunk(noise=...)`` and
    post-processor on the batch its async server builds, from the noise the seed draws."""
    batch = to_lerobot_batch(
        3, obs["state"][None], {"top": obs["cameras"]["top"][None]}, [obs["instruction"]], fp.camera_keys
    )
    noise = torch.from_numpy(initial_noise(seed, H, D))[None]
    with torch.no_grad():
        return fp.postprocessor(fp.policy.predict_action_chunk(fp.preprocessor(batch), noise=noise))[
            0
        ].numpy()


def local_accel(fp: LeRobotFlowPolicy, obs: dict[str, Any], seed: int) -> float:
    """The ``accel`` score of the same observation and seed from the contract's own sampler."""
    batch = {
        "state": torch.from_numpy(obs["state"][None]),
        "cameras": {"top": torch.from_numpy(obs["cameras"]["top"][None])},
        "instruction": [obs["instruction"]],
    }
    noise = torch.from_numpy(initial_noise(seed, H, D))[None, None]
    with torch.no_grad():
        s = fp.sample(batch, noise=noise, return_iterates=True)
    return float(accel_score(s.iterates[:, 0, ..., :2], n_exec=fp.n_exec).item())


def close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)


# ------------------------------------------------------------------------------------------------ tests
def test_flow_vla_folders_are_served_through_the_contract(
    server: PolicyServer, folders: dict[str, Path]
) -> None:
    for ptype in FLOW_TYPES:
        model = server.slots[ptype].active.model
        assert isinstance(model, FlowPolicyModel), (ptype, type(model))
        assert isinstance(model.policy, LeRobotFlowPolicy) and model.noise_shape == (H, D)
    with PolicyClient(server.address, timeout_s=60) as c:
        info = c.info()
    for ptype in FLOW_TYPES:
        assert info[ptype].policy_type == f"lerobot/{ptype}"
        assert (info[ptype].chunk_len, info[ptype].n_exec) == (H, 3)
        assert RobotSpec.from_json(info[ptype].robot_spec_json).cameras == SPEC.cameras


def test_the_sidecar_robot_spec_is_the_one_served(server: PolicyServer, folders: dict[str, Path]) -> None:
    """A folder whose sidecar records the task's robot spec is served with it (its name, instruction and
    control rate; the config alone says lerobot/<type>, no instruction and LeRobot's 30 Hz), through the
    contract and through LeRobot's own predict_action_chunk alike."""
    assert (SPEC.name, SPEC.control_hz) != ("lerobot/smolvla", 30.0)
    with PolicyClient(server.address, timeout_s=60) as c:
        info = c.info()
    for ptype in FLOW_TYPES:
        served = RobotSpec.from_json(info[ptype].robot_spec_json)
        assert served == SPEC, (ptype, served)
        assert (served.name, served.instruction, served.control_hz) == (
            SPEC.name,
            SPEC.instruction,
            SPEC.control_hz,
        )
        assert server.slots[ptype].active.spec == SPEC
    with mock.patch.object(LeRobotFlowPolicy, "__init__", _refuse):
        fallback = load_servable(folders["pi0"], device="cpu")
    assert isinstance(fallback, LeRobotModel) and fallback.spec == SPEC
    assert fallback.spec.control_hz == SPEC.control_hz


def _refuse(self: LeRobotFlowPolicy, build: Any) -> None:
    raise FlowPolicyError("refused by the test")


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_robots_in_one_batch_get_what_a_batch_of_one_gives_them(
    ptype: str, server: PolicyServer, lerobot: dict[str, LeRobotFlowPolicy]
) -> None:
    """N robots, different observations / instructions / seeds, one batch: each chunk and its uncertainty
    are that robot's own, equal to the batch of one, and to LeRobot's own predict_action_chunk. Robot 0
    sends its seed's noise explicitly (the same chunk)."""
    work = [(robot_obs(k), 1000 * k + 7) for k in range(N_ROBOTS)]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_ROBOTS)

    def robot(k: int) -> None:
        try:
            with PolicyClient(server.address, timeout_s=120, model_id=ptype) as c:
                barrier.wait()
                obs, seed = work[k]
                results[k] = c.act(obs, noise=initial_noise(seed, H, D)) if k == 0 else c.act(obs, seed=seed)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(N_ROBOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == N_ROBOTS, errors
    assert [results[k].batch_size for k in range(N_ROBOTS)] == [N_ROBOTS] * N_ROBOTS
    fp = lerobot[ptype]
    chunks = [results[k].actions for k in range(N_ROBOTS)]
    assert all(not np.allclose(chunks[0], c) for c in chunks[1:]), "the robots' chunks must differ"
    version = server.slots[ptype].active
    for k, (obs, seed) in enumerate(work):
        r = results[k]
        assert r.actions.shape == (H, 2) and r.model_id == ptype
        close(r.actions, lerobot_chunk(fp, obs, seed))
        assert r.uncertainty_kind == "accel" and np.isfinite(r.uncertainty)
        np.testing.assert_allclose(r.uncertainty, local_accel(fp, obs, seed), atol=1e-4, rtol=1e-3)
        # the served version's batch of one
        alone, score = version.infer_scored(
            obs["state"][None],
            {"top": obs["cameras"]["top"][None]},
            [obs["instruction"]],
            initial_noise(seed, H, D)[None],
        )
        close(r.actions, alone[0])
        np.testing.assert_allclose(r.uncertainty, score[0], atol=1e-4, rtol=1e-3)


def test_a_one_step_head_is_served_without_an_uncertainty(lerobot: dict[str, LeRobotFlowPolicy]) -> None:
    """accel needs two velocity steps: K = 1 answers with NaN (kind "" on the wire), as for FlowVLA."""
    fp = lerobot["smolvla"]
    model = FlowPolicyModel(fp, spec=fp.spec, policy_type="lerobot/smolvla", commit="c", ref="r", num_steps=1)
    obs = robot_obs(0)
    actions, score = ServedVersion(model).infer_scored(
        obs["state"][None],
        {"top": obs["cameras"]["top"][None]},
        [obs["instruction"]],
        initial_noise(3, H, D)[None],
    )
    assert actions.shape == (1, H, 2) and np.isfinite(actions).all() and np.isnan(score).all()


def test_a_flow_vla_the_contract_refuses_falls_back_to_lerobot_predict_action_chunk(
    folders: dict[str, Path],
) -> None:
    """A flow VLA whose config the contract refuses (e.g. π0's ``use_relative_actions``, applied by
    LeRobot's processors around its own call) is still served, through LeRobot's ``predict_action_chunk``,
    with a note saying why; a plain one goes through the contract."""
    assert isinstance(load_servable(folders["pi0"], device="cpu"), LoadedFlowPolicy)
    why = "pi0 config.use_relative_actions: True is not supported by the flow contract"

    def refuse(self: LeRobotFlowPolicy, build: Any) -> None:
        raise FlowPolicyError(why)

    with mock.patch.object(LeRobotFlowPolicy, "__init__", refuse):
        loaded = load_servable(folders["pi0"], device="cpu")
    assert isinstance(loaded, LeRobotModel) and loaded.policy_type == "lerobot/pi0"
    assert any(why in n and "predict_action_chunk" in n for n in loaded.notes), loaded.notes

"""The trainers on LeRobot flow VLAs through the flow-policy contract (vla_rl/train/contract.py): SFT
(continued fine-tuning), AWR (weighted flow matching) and RECAP (the "Advantage: positive / negative" text,
classifier-free guidance at deployment) on a tiny SmolVLA (and π0.5 for SFT) acting on the kinematic test
bed's camera. Each test asserts what breaks when the piece does: the loss falls, "expert" leaves the VLM's
weights as they were and "full" moves them, the saved folder is a LeRobot folder that LeRobot's own
``from_pretrained`` loads and that acts as ours, the lineage names the algorithm and the parent.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from lerobot_offline import from_pretrained, lerobot_actions, offline, one_torch_thread
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL

from fleet.store import EpisodeStore
from policies.lerobot_flow import LINEAGE_FILE, GuidedPrefix, LeRobotFlowPolicy
from policies.lerobot_tiny import save_tiny_policy
from policies.loading import load_flow_checkpoint, load_flow_policy
from vla_rl.hub.registry import pull

TASK = "kinematic/Reach-v0"
IMAGE = 32
TINY = {
    "chunk_size": 4,
    "n_action_steps": 2,
    "max_state_dim": 8,
    "max_action_dim": 8,
    "tokenizer_max_length": 24,
}
QUICK = {"threads": 1, "progress": False, "ema_decay": 0.0}
"""Every run: one thread, no bar, the shipped weights are the trained ones (no EMA lag in a few steps)."""


@pytest.fixture(autouse=True, scope="module")
def _offline() -> Iterator[None]:
    with offline(), one_torch_thread():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six noisy scripted demos of the kinematic reach task from its 32 px top camera."""
    from sim.demos import record_demos

    root = tmp_path_factory.mktemp("kinematic_rgb") / "store"
    record_demos(
        EpisodeStore(root, create=True),
        TASK,
        episodes=6,
        noise=0.5,
        obs="rgb",
        image_size=IMAGE,
        progress=False,
    )
    return root


@pytest.fixture(scope="module")
def bases(store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SmolVLA and π0.5 folders for the task's robot (its spec recorded beside them)."""
    import sim

    env = sim.make(TASK, obs="rgb", image_size=IMAGE, num_envs=1, seed=0)
    spec = env.spec
    env.close()
    root = tmp_path_factory.mktemp("bases")
    return {t: save_tiny_policy(root / t, t, spec, seed=0, **TINY) for t in ("smolvla", "pi05")}


def _batch(policy: LeRobotFlowPolicy, store: Path) -> dict[str, Any]:
    """Every training sample of the store as one contract batch (each with its instruction)."""
    from fleet.dataset import ChunkDataset
    from vla_rl.train.contract import PolicyInputs

    ds = ChunkDataset(EpisodeStore(store), policy.chunk_len)
    return PolicyInputs(policy, ds, policy.device)(ds.batch(np.arange(len(ds))))


@torch.no_grad()
def _fixed_loss(folder: Path, batch: dict[str, Any]) -> float:
    """The mean flow-matching loss of ``folder``'s policy on ``batch`` at fixed noise and times."""
    policy = LeRobotFlowPolicy.load(folder).eval()
    gen = torch.Generator().manual_seed(0)
    n = len(batch["instruction"])
    noise = torch.randn(n, *policy.event_shape, generator=gen)
    time = torch.rand(n, generator=gen)
    return float(policy.loss(batch, noise=noise, time=time).mean())


def _vlm_and_expert(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The folder's weights split into the VLM's and everything else (the action expert's part)."""
    state = LeRobotFlowPolicy.load(folder).policy.state_dict()
    vlm = {k: v for k, v in state.items() if ".vlm." in k or ".paligemma." in k}
    return vlm, {k: v for k, v in state.items() if k not in vlm}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _sft(store: Path, base: Path, out: Path, steps: int, **knobs: Any) -> Path:
    from vla_rl.train.sft import SFTConfig, train_sft

    cfg = SFTConfig(
        store=store,
        base=str(base),
        out=out,
        steps=steps,
        batch_size=16,
        checkpoint_every=steps,
        **QUICK,
        **knobs,
    )
    return train_sft(cfg).checkpoint


def _rows(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """The first ``n`` samples of a contract batch."""
    return {k: {c: x[:n] for c, x in v.items()} if isinstance(v, dict) else v[:n] for k, v in batch.items()}


def _observations(store: Path, bases: dict[str, Path], n: int = 3) -> dict[str, Any]:
    """``n`` frames of the store as an observation batch (state, camera, instruction)."""
    batch = _rows(_batch(LeRobotFlowPolicy.load(bases["smolvla"]), store), n)
    return {k: batch[k] for k in ("state", "cameras", "instruction")}


# ---------------------------------------------------------------------------- SFT
@pytest.mark.parametrize("ptype", ["smolvla", "pi05"])
def test_sft_continues_a_lerobot_base_expert_only(
    ptype: str, store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    """Default on a CPU: the action expert trains, the VLM's weights stay the base's; the loss on the
    data falls; the checkpoint is a LeRobot folder of the same type with its lineage beside it."""
    ckpt = _sft(store, bases[ptype], tmp_path / "sft", steps=12, lr=3e-3, warmup_steps=1)
    assert json.loads((ckpt / "config.json").read_text())["type"] == ptype
    assert (ckpt / "model.safetensors").is_file()
    record = json.loads((ckpt / LINEAGE_FILE).read_text())
    assert record["lineage"]["algorithm"] == "sft"
    assert record["lineage"]["parent_revision"] == pull(str(bases[ptype])).commit  # the base's content hash
    assert record["robot_spec"]["name"] == TASK
    vlm0, expert0 = _vlm_and_expert(bases[ptype])
    vlm1, expert1 = _vlm_and_expert(ckpt)
    assert vlm0 and not _changed(vlm0, vlm1)
    assert _changed(expert0, expert1)
    batch = _batch(LeRobotFlowPolicy.load(bases[ptype]), store)
    before, after = _fixed_loss(bases[ptype], batch), _fixed_loss(ckpt, batch)
    assert after < 0.9 * before, (before, after)


def test_a_folder_trained_from_one_that_names_no_task_records_its_task(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    """From a LeRobot folder from elsewhere (no sidecar) and --task, the trained folder names that task, so
    the next run or round on it knows it (rather than its config's name, 'lerobot/smolvla'); another task
    than the one a base names is refused."""
    folder = shutil.copytree(bases["smolvla"], tmp_path / "elsewhere")
    (folder / LINEAGE_FILE).unlink()
    ckpt = _sft(store, folder, tmp_path / "sft", steps=1, task=TASK)
    assert json.loads((ckpt / LINEAGE_FILE).read_text())["robot_spec"]["name"] == TASK
    assert load_flow_checkpoint(str(ckpt), algorithm="sft", device="cpu").task(None) == TASK
    with pytest.raises(ValueError, match=f"task: the base checkpoint is for '{TASK}', not 'kinematic/Other'"):
        _sft(store, ckpt, tmp_path / "again", steps=1, task="kinematic/Other")


def test_sft_full_trains_the_vlm_too(store: Path, bases: dict[str, Path], tmp_path: Path) -> None:
    ckpt = _sft(store, bases["smolvla"], tmp_path / "sft", steps=2, trainable="full")
    vlm0, _ = _vlm_and_expert(bases["smolvla"])
    vlm1, _ = _vlm_and_expert(ckpt)
    assert _changed(vlm0, vlm1)
    assert not json.loads((ckpt / "config.json").read_text())["train_expert_only"]


def test_lora_sft_trains_adapters_only_and_ships_a_plain_lerobot_folder(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    """``trainable lora``: the loss on the data falls; the folder is an ordinary LeRobot folder (no adapter
    keys, the base's key set) whose vision encoder is the base's, and its lineage records the adapters."""
    ckpt = _sft(
        store,
        bases["smolvla"],
        tmp_path / "sft",
        steps=12,
        lr=3e-3,
        warmup_steps=1,
        trainable="lora",
        lora_rank=4,
    )
    lineage = json.loads((ckpt / LINEAGE_FILE).read_text())["lineage"]
    assert lineage["algorithm"] == "sft" and lineage["lora"]["rank"] == 4 and lineage["lora"]["merged"]
    state0 = LeRobotFlowPolicy.load(bases["smolvla"]).policy.state_dict()
    state1 = LeRobotFlowPolicy.load(ckpt).policy.state_dict()
    assert set(state0) == set(state1)
    vision = [k for k in state0 if ".vision_model." in k]
    assert vision and not _changed({k: state0[k] for k in vision}, state1)
    assert _changed(state0, state1)
    batch = _batch(LeRobotFlowPolicy.load(bases["smolvla"]), store)
    before, after = _fixed_loss(bases["smolvla"], batch), _fixed_loss(ckpt, batch)
    assert after < 0.9 * before, (before, after)


def test_trained_folder_loads_in_lerobot_and_acts_as_ours(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = _sft(store, bases["smolvla"], tmp_path / "sft", steps=2)
    ours = load_flow_policy(ckpt, algorithm="awr", device="cpu")
    assert isinstance(ours, LeRobotFlowPolicy)
    obs = _observations(store, bases)
    x0 = torch.randn(3, *ours.event_shape, generator=torch.Generator().manual_seed(1))
    theirs = lerobot_actions(from_pretrained(ckpt), ckpt, obs, x0, ours.camera_keys)
    with torch.no_grad():
        torch.testing.assert_close(
            ours.predict_action_chunk(obs, noise=x0), theirs, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL
        )


def test_trainable_knob_is_checked_when_the_config_is_made(tmp_path: Path) -> None:
    from vla_rl.train.awr import AWRConfig
    from vla_rl.train.sft import SFTConfig

    with (
        mock.patch("importlib.util.find_spec", return_value=None),
        pytest.raises(ValueError, match="trainable: 'lora' needs the peft package"),
    ):
        AWRConfig(store=tmp_path, base=str(tmp_path), out=tmp_path / "o", trainable="lora")
    AWRConfig(store=tmp_path, base=str(tmp_path), out=tmp_path / "o", trainable="lora")  # peft is here
    with pytest.raises(ValueError, match="trainable: SFT from scratch trains the whole new model"):
        SFTConfig(store=tmp_path, out=tmp_path / "o", init="scratch", trainable="expert")
    from vla_rl.train.algorithms import make_config

    with pytest.raises(ValueError, match="trainable: fql does not choose which parts of its policy train"):
        make_config("fql", base="b", store=tmp_path, out=tmp_path / "o", trainable="expert")
    with pytest.raises(ValueError, match="trainable: expected"):
        SFTConfig(store=tmp_path, out=tmp_path / "o", trainable="half")  # type: ignore[arg-type]


def test_a_lerobot_base_that_is_not_a_flow_vla_is_refused_at_config_time(tmp_path: Path) -> None:
    from vla_rl.train.awr import AWRConfig
    from vla_rl.train.sft import SFTConfig

    act = tmp_path / "act"
    act.mkdir()
    (act / "config.json").write_text(json.dumps({"type": "act", "chunk_size": 4}))
    with pytest.raises(ValueError, match="base: awr needs a flow-matching policy; act is not one — use sft"):
        AWRConfig(store=tmp_path, base=str(act), out=tmp_path / "o")
    with pytest.raises(
        ValueError, match="base: sft needs a flow-matching policy; act is not one — fine-tune it"
    ):
        SFTConfig(store=tmp_path, base=str(act), out=tmp_path / "o")
    SFTConfig(
        store=tmp_path, base=str(act), out=tmp_path / "o", init="scratch"
    )  # the base only compared against


# ---------------------------------------------------------------------------- AWR
def test_eval_of_a_lerobot_folder_that_names_no_task_asks_for_it(
    bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder from elsewhere (no sidecar) has only its config's spec: `vla-rl eval` asks for --task rather
    than call the config's name no simulator task and ask for --store."""
    from vla_rl.cli import main as cli_main

    folder = shutil.copytree(bases["smolvla"], tmp_path / "elsewhere")
    (folder / LINEAGE_FILE).unlink()
    capsys.readouterr()
    assert cli_main(["eval", "--checkpoint", str(folder), "--episodes", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a LeRobot smolvla folder that names no task" in err and "say which (--task)" in err, err


def test_weighted_flow_loss_weights_each_sample(store: Path, bases: dict[str, Path]) -> None:
    """AWR's and the intervention-aware credit's weights reach the loss sample by sample: the loss is
    ``mean_b w_b loss_b``, and a sample weighted 0 sends no gradient."""
    from vla_rl.train.contract import weighted_flow_loss

    policy = LeRobotFlowPolicy.load(bases["smolvla"])
    params = policy.set_trainable("expert")
    batch = _rows(_batch(policy, store), 2)
    noise = torch.randn(2, *policy.event_shape, generator=torch.Generator().manual_seed(0))
    time = torch.tensor([0.3, 0.7])
    per_sample = policy.loss(batch, noise=noise, time=time).detach()
    w = torch.tensor([2.0, 0.5])
    loss, metrics = weighted_flow_loss(policy, batch, weights=w, noise=noise, time=time)
    torch.testing.assert_close(loss.detach(), (w * per_sample).mean())
    torch.testing.assert_close(metrics["mse"], per_sample.mean())
    loss, _ = weighted_flow_loss(policy, batch, weights=torch.zeros(2), noise=noise, time=time)
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in params)


def _awr(store: Path, base: Path, out: Path, variant: str, **knobs: Any) -> Path:
    from vla_rl.train.awr import AWRConfig, train_awr

    cfg = AWRConfig(
        variant=variant,  # type: ignore[arg-type]
        store=store,
        base=str(base),
        out=out,
        steps=4,
        batch_size=16,
        value_steps=20,
        checkpoint_every=4,
        **QUICK,
        **knobs,
    )
    return train_awr(cfg).checkpoint


def test_awr_on_a_lerobot_vla_trains_its_expert_and_saves_a_lerobot_folder(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = _awr(store, bases["smolvla"], tmp_path / "awr", "awr")
    assert json.loads((ckpt / "config.json").read_text())["type"] == "smolvla"
    record = json.loads((ckpt / LINEAGE_FILE).read_text())
    assert record["lineage"]["algorithm"] == "awr" and record["metrics"]["train_steps"] == 4
    assert record["advantage"] is None
    vlm0, expert0 = _vlm_and_expert(bases["smolvla"])
    vlm1, expert1 = _vlm_and_expert(ckpt)
    assert not _changed(vlm0, vlm1) and _changed(expert0, expert1)


# ---------------------------------------------------------------------------- RECAP
def test_recap_conditions_the_prompt_and_deploys_with_guidance(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    """RECAP trains on "Advantage: positive / negative" prompts; the folder records the guidance scale;
    deployed, an observation naming no advantage acts with classifier-free guidance between the plain
    and the positive prompt; LeRobot's own loader still loads the folder."""
    ckpt = _awr(store, bases["smolvla"], tmp_path / "recap", "recap", guidance_scale=2.0)
    record = json.loads((ckpt / LINEAGE_FILE).read_text())
    assert record["lineage"]["algorithm"] == "recap"
    assert record["advantage"]["guidance_scale"] == 2.0
    policy = LeRobotFlowPolicy.load(ckpt).eval()
    assert policy._conditioned(["reach"], torch.tensor([2])) == ["reach\nAdvantage: positive"]
    assert policy._conditioned(["reach"], torch.tensor([1])) == ["reach\nAdvantage: negative"]
    assert policy._conditioned(["reach"], torch.tensor([0])) == ["reach"]
    obs = _observations(store, bases)
    x0 = torch.randn(3, *policy.event_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        guided = policy.predict_action_chunk(obs, noise=x0)
        plain = policy.encode_prefix({**obs, "advantage": torch.zeros(3, dtype=torch.long)})
        positive = policy.encode_prefix({**obs, "advantage": torch.full((3,), 2)})
        by_hand = policy.sample(GuidedPrefix(plain, positive, 2.0), noise=x0[:, None]).actions[:, 0]
        torch.testing.assert_close(guided, policy.unnormalize_actions(by_hand))
        t = torch.full((3,), 0.4)
        torch.testing.assert_close(
            policy.velocity(GuidedPrefix(plain, positive, 2.0), x0, t),
            2.0 * policy.velocity(positive, x0, t) - policy.velocity(plain, x0, t),
            atol=RECOMPUTED_ATOL,
            rtol=RECOMPUTED_RTOL,
        )
        unguided = policy.predict_action_chunk({**obs, "advantage": torch.full((3,), 2)}, noise=x0)
    assert not torch.allclose(guided, unguided, atol=1e-3)
    assert type(from_pretrained(ckpt)).name == "smolvla"


def test_a_policy_not_trained_with_recap_refuses_an_advantage(store: Path, bases: dict[str, Path]) -> None:
    from policies.flow_policy import FlowPolicyError

    policy = LeRobotFlowPolicy.load(bases["smolvla"])
    with pytest.raises(FlowPolicyError, match="advantage: this policy is not advantage-conditioned"):
        policy.encode_prefix({**_observations(store, bases), "advantage": torch.full((3,), 2)})


# ---------------------------------------------------------------------------- awr-pi
def test_awr_pi_collects_with_a_lerobot_vla_and_trains_its_expert(
    store: Path, bases: dict[str, Path], tmp_path: Path
) -> None:
    """One online iteration on the camera task: the SmolVLA acts in the simulator (its episodes recorded
    as the base's commit), the value reads its features, its expert trains, and a LeRobot folder ships."""
    from vla_rl.train.awr_pi import AWRPIConfig, train_awr_pi

    cfg = AWRPIConfig(
        store=store,
        base=str(bases["smolvla"]),
        out=tmp_path / "pi",
        env_steps=30,
        episodes_per_iteration=2,
        num_envs=1,
        max_episode_steps=10,
        steps_per_iteration=3,
        value_steps=10,
        batch_size=8,
        stop_at=1,
        **QUICK,
    )
    res = train_awr_pi(cfg)
    assert res.metrics["iterations"] == 1 and res.metrics["online_episodes"] == 2
    assert res.curve[0]["revision"] == pull(str(bases["smolvla"])).commit
    online = EpisodeStore(tmp_path / "pi" / "online_store")
    metas = [online.read_metadata(e) for e in online.episode_ids()]
    assert len(metas) == 2 and all(list(m.revisions) == [res.curve[0]["revision"]] for m in metas)
    ckpt = res.checkpoint
    assert json.loads((ckpt / "config.json").read_text())["type"] == "smolvla"
    assert json.loads((ckpt / LINEAGE_FILE).read_text())["lineage"]["algorithm"] == "awr-pi"
    vlm0, expert0 = _vlm_and_expert(bases["smolvla"])
    vlm1, expert1 = _vlm_and_expert(ckpt)
    assert not _changed(vlm0, vlm1) and _changed(expert0, expert1)


# ---------------------------------------------------------------------------- a round
def test_a_round_on_a_lerobot_base_pushes_a_lerobot_folder_the_server_swaps_to(
    store: Path,
    bases: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--base hub://fleet/vla@prod`` on a SmolVLA folder pushed to the registry: an AWR round trains it,
    evaluates both in the simulator through the contract on the same seeds, records the evaluation beside
    the folder, pushes ``round-N``, promotes it, and a policy server following ``prod`` swaps to it; the
    pushed folder loads in LeRobot's own ``from_pretrained`` and acts as ours."""
    import huggingface_hub.constants
    from vla_rl_client.policy_client import PolicyClient

    from fleet.db import MetadataDB
    from server.config import ServerConfig
    from server.policy_server import PolicyServer
    from vla_rl.hub.registry import configure_hub, push_folder, resolve
    from vla_rl.hub.server import HubServer
    from vla_rl.rounds import RoundConfig, start_round
    from vla_rl.train.algorithms import make_config

    # the registry is on this machine (loopback: the module's guard still refuses anything else)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    repo, token = "fleet/vla", "vla-token"
    hub = HubServer(tmp_path / "hub", token=token).start()
    server = None
    try:
        configure_hub(hub.url, token)
        base_commit = push_folder(bases["smolvla"], repo, message="base", tag="prod")
        prod = f"hub://{repo}@prod"
        config = ServerConfig(
            checkpoint=prod,
            model_id="vla",
            port=0,
            torch_threads=1,
            device="cpu",
            follow="self",
            follow_interval=0.3,
        )
        server = PolicyServer(config).start()
        assert server.slots["vla"].active.commit == base_commit
        train = make_config(
            "awr",
            base=prod,
            store=store,
            out=tmp_path / "rounds",
            steps=4,
            value_steps=10,
            batch_size=8,
            **QUICK,
        )
        rec = start_round(
            RoundConfig(
                train=train, eval_episodes=2, eval_envs=1, margin=-0.99, gate_alpha=1.0, report_episodes=0
            ),
            db=MetadataDB.for_store(store),
        )
        assert rec.status == "succeeded" and rec.promoted, rec.error
        assert rec.base_revision == base_commit and rec.metrics["base_success"] is not None
        assert rec.checkpoint_ref == f"hub://{repo}@round-{rec.id}"
        assert resolve(prod) == rec.checkpoint_revision != base_commit
        pulled = pull(rec.checkpoint_ref).path
        assert json.loads((Path(pulled) / "config.json").read_text())["type"] == "smolvla"
        record = json.loads((Path(pulled) / LINEAGE_FILE).read_text())
        assert record["lineage"]["algorithm"] == "awr" and record["lineage"]["round"] == rec.id
        assert record["lineage"]["parent_revision"] == base_commit
        assert (
            record["metrics"]["success_rate"] == rec.metrics["success"]
            and record["metrics"]["round"] == rec.id
        )
        assert "awr" in (Path(pulled) / "README.md").read_text()
        # the registry's client and `vla-rl eval` read it too
        from vla_rl.cli import main as cli_main

        capsys.readouterr()
        hub_args = ["--hub", hub.url, "--hub-token", token]
        assert cli_main([*hub_args, "hub", "pull", rec.checkpoint_ref]) == 0
        assert f"LeRobot smolvla policy folder, awr round {rec.id}" in capsys.readouterr().out
        assert (
            cli_main(
                [
                    *hub_args,
                    "eval",
                    "--checkpoint",
                    prod,
                    "--episodes",
                    "1",
                    "--num-envs",
                    "1",
                    "--no-progress",
                ]
            )
            == 0
        )
        assert f"{TASK}: success" in capsys.readouterr().out

        ours = load_flow_policy(rec.checkpoint_ref, algorithm="awr", device="cpu")
        obs = _observations(store, bases)
        x0 = torch.randn(3, *ours.event_shape, generator=torch.Generator().manual_seed(3))
        theirs = lerobot_actions(from_pretrained(Path(pulled)), Path(pulled), obs, x0, ours.camera_keys)
        with torch.no_grad():
            torch.testing.assert_close(
                ours.predict_action_chunk(obs, noise=x0), theirs, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL
            )

        deadline = time.monotonic() + 60
        while server.slots["vla"].active.commit != rec.checkpoint_revision:
            assert time.monotonic() < deadline, "the server following prod did not swap to the round"
            time.sleep(0.2)
        state = obs["state"][0].numpy()
        frame = {"state": state, "cameras": {k: v[0].numpy() for k, v in obs["cameras"].items()}}
        with PolicyClient(server.address, timeout_s=120, model_id="vla") as client:
            served = client.act(frame)
        assert served.commit == rec.checkpoint_revision and served.actions.shape == (ours.chunk_len, 4)

        # a hub base that is not a flow VLA: the round stops, naming the algorithm and the type
        act = tmp_path / "act"
        act.mkdir()
        (act / "config.json").write_text(json.dumps({"type": "act", "chunk_size": 4}))
        push_folder(act, "fleet/act", message="an ACT policy", tag="prod")
        act_round = RoundConfig(
            train=dataclasses.replace(train, base="hub://fleet/act@prod"), eval_episodes=2, eval_envs=1
        )
        with pytest.raises(ValueError, match="awr needs a flow-matching policy; act is not one — use sft"):
            start_round(act_round, db=MetadataDB.for_store(store))
        assert MetadataDB.for_store(store).rounds()[-1].status == "failed"
    finally:
        if server is not None:
            server.stop()
        hub.stop()


def test_sft_init_base_continues_our_flowvla_too(store: Path, tmp_path: Path) -> None:
    """The same continued fine-tuning on our checkpoint: the base's architecture (not the model knobs),
    its weights as the start, its commit as the parent; ``init auto`` keeps training ours from scratch."""
    from tiny_base import tiny_sft

    from vla_rl.hub.checkpoint import read_info

    base = tiny_sft(TASK, store, tmp_path / "base", steps=2, batch_size=8)
    cont = _sft(store, base, tmp_path / "cont", steps=2, init="base", d_model=64)
    info = read_info(cont)
    assert info.model_config["d_model"] == 32 and info.lineage.parent_revision == pull(str(base)).commit
    scratch = _sft(store, base, tmp_path / "scratch", steps=2, d_model=64, instruction_encoder="none")
    assert (
        read_info(scratch).model_config["d_model"] == 64
        and read_info(scratch).lineage.parent_revision is None
    )

"""`vla-rl up --policy smolvla` (and pi05) end to end at CI scale: the loop on a LeRobot flow VLA acting
from a camera.

Real processes (registry, policy server following prod, collector, round worker, dashboard, simulated
fleet) on the kinematic test bed's 32 px top camera, a tiny SmolVLA / π0.5 (built here, no download), smoke-test
budgets: the base is a LeRobot folder trained by SFT on camera demos, the fleet's episodes hold camera
frames that the dashboard plays as video, every round's candidate is a LeRobot folder on the registry, and
the server swaps to a promoted round (the next batch of the fleet is served by it). This checks the
machinery, not learning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_watching

from fleet.store import EpisodeStore
from vla_rl.cli.common import open_db
from vla_rl.up import UpConfig

CLI = [sys.executable, "-m", "vla_rl.cli"]
ROBOTS, EPISODES, IMAGE = 1, 2, 32
CAMERA = "top_camera"


def _up(work: Path, policy: str = "smolvla") -> list[str]:
    return [
        *CLI, "up", "--policy", policy, "--image-size", str(IMAGE), "--task", "kinematic/Reach-v0",
        "--robots", str(ROBOTS), "--episodes", str(EPISODES), "--rounds", "2", "--base-demos", "3",
        "--base-steps", "4", "--base-preset", "kinematic-sft", "--preset", "tiny-awr", "--round-steps", "4",
        "--eval-episodes", "2", "--margin", "-0.99", "--gate-alpha", "1", "--report-episodes", "0",
        "--workdir", str(work), "--no-progress", "--no-continuous",
    ]  # fmt: skip


def _dashboard_plays_a_camera(work: Path) -> bool:
    """The dashboard child answers a fleet episode's camera as an MP4 video (what its episode page plays)."""
    import httpx

    try:
        port = json.loads((work / "up.json").read_text())["ports"]["dashboard"]
        headers = {"Authorization": f"Bearer {(work / 'secrets' / 'dashboard').read_text().strip()}"}
        base = f"http://127.0.0.1:{port}/api/v1"
        listed = httpx.get(f"{base}/episodes?robot=sim-0&status=closed", headers=headers, timeout=2)
        if listed.status_code != 200 or not listed.json()["items"]:
            return False
        eid = listed.json()["items"][0]["id"]
        video = httpx.get(f"{base}/episodes/{eid}/video/{CAMERA}.mp4", headers=headers, timeout=30)
        return (
            video.status_code == 200
            and video.headers["content-type"] == "video/mp4"
            and len(video.content) > 0
        )
    except (OSError, KeyError, IndexError, ValueError, httpx.HTTPError):
        return False


def _folder_type(work: Path, ref: str) -> str:
    """The LeRobot ``type`` of ``ref`` on the workdir's registry (served here again, the loop being over)."""
    from vla_rl.hub.registry import configure_hub, pull
    from vla_rl.hub.server import HubServer

    token = (work / "secrets" / "hub").read_text().strip()
    hub = HubServer(work / "hub", token=token).start()
    try:
        configure_hub(hub.url, token)
        folder = Path(pull(ref).path)
        assert (folder / "model.safetensors").is_file()
        return json.loads((folder / "config.json").read_text())["type"]
    finally:
        hub.stop()


VLM_LAYERS = {"smolvla": 4, "pi0": 2, "pi05": 2}
"""Text layers of each policy's small VLM (what the report line names)."""


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["smolvla", "pi05"])
def test_up_runs_a_lerobot_loop_on_a_camera(policy: str, tmp_path: Path) -> None:
    work = tmp_path / "up"
    r, played = run_watching(_up(work, policy), tmp_path / "up", 900, lambda: _dashboard_plays_a_camera(work))
    stdout = r.stdout
    assert r.returncode == 0, stdout[-3000:] + r.stderr[-3000:]
    # the banner and the report say which policy ran, and its sizes
    sizes = f"M parameters: VLM text width 64 x {VLM_LAYERS[policy]} layers"
    assert f"  policy     {policy} (" in stdout and sizes in stdout
    assert f"from the {IMAGE} px camera" in stdout and f"\npolicy: {policy} (" in stdout
    rows = [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()]
    assert [row["policy"].split()[0] for row in rows] == [policy, policy]
    assert played, "the dashboard never played a fleet episode's camera"

    db = open_db(work / "store", None)
    recs = db.rounds()
    assert [r.status for r in recs] == ["succeeded", "succeeded"] and all(r.promoted for r in recs)
    assert _folder_type(work, "hub://up/policy@base") == policy
    assert _folder_type(work, "hub://up/policy@round-1") == policy

    store = EpisodeStore(work / "store")
    fleet = [store.read_episode(e) for e in store.episode_ids()]
    fleet = [ep for ep in fleet if ep.meta.robot_id.startswith("sim-")]
    assert len(fleet) == 2 * ROBOTS * EPISODES
    for ep in fleet:
        frames = ep.cameras[CAMERA]
        assert frames.shape == (ep.meta.length, IMAGE, IMAGE, 3) and frames.any(), ep.meta.episode_id
    # the server swapped to round 1 once it was promoted: the fleet's next batch was served by it
    served = {rev for ep in fleet for rev in ep.meta.revisions}
    assert recs[0].checkpoint_revision in served and recs[1].checkpoint_revision not in served


def test_up_refuses_a_policy_that_is_not_a_flow_vla_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="policy: up needs a flow-matching policy; act is not one"):
        UpConfig(policy="act", workdir=tmp_path)
    with pytest.raises(ValueError, match="image_size: expected a positive multiple of 32"):
        UpConfig(policy="smolvla", image_size=80, workdir=tmp_path)
    assert UpConfig(policy="flowvla", image_size=80, workdir=tmp_path).lerobot is False  # state: unused


def test_a_resumed_run_must_name_the_same_policy(tmp_path: Path) -> None:
    """A workdir's registry, store and rounds belong to the policy its first run improved (a workdir of a
    run before --policy existed ran flowvla): another is refused, from the CLI as one line, exit 2."""
    from vla_rl.up.loop import _check_same_policy

    _check_same_policy(UpConfig(policy="smolvla", workdir=tmp_path), {})  # a new workdir takes any
    _check_same_policy(UpConfig(workdir=tmp_path), {"ports": {}})  # before --policy: flowvla
    with pytest.raises(ValueError, match="policy: this workdir's earlier run improved flowvla, not smolvla"):
        _check_same_policy(UpConfig(policy="smolvla", workdir=tmp_path), {"ports": {}})
    work = tmp_path / "w"
    work.mkdir()
    (work / "up.json").write_text(json.dumps({"policy": "pi0", "ports": {}}))
    r = subprocess.run([*CLI, "up", "--workdir", str(work)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "up: policy: this workdir's earlier run improved pi0, not flowvla" in r.stderr


@pytest.mark.parametrize("policy", ["smolvla", "pi0"])
def test_the_base_starts_from_a_small_folder_of_the_architecture_on_the_camera(
    policy: str, tmp_path: Path
) -> None:
    """``init_folder``: a random LeRobot folder of ``--policy``'s type for the task's robot seen from its
    camera at ``--image-size`` (made once); the report line counts its parameters from the weights file."""
    from policies.lerobot_flow import LeRobotFlowPolicy
    from vla_rl.up.lerobot import init_folder, parameter_count, policy_line

    cfg = UpConfig(policy=policy, task="kinematic/Reach-v0", image_size=IMAGE, workdir=tmp_path)
    folder = init_folder(cfg, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["type"] == policy and config["chunk_size"] == 10 and config["n_action_steps"] == 5
    loaded = LeRobotFlowPolicy.load(folder)
    assert [(c.name, c.height, c.width) for c in loaded.spec.cameras] == [(CAMERA, IMAGE, IMAGE)]
    n = sum(p.numel() for p in loaded.policy.state_dict().values())
    assert parameter_count(folder) == n
    assert policy_line(cfg, tmp_path) == (
        f"{policy} ({n / 1e6:.2f}M parameters: VLM text width 64 x {VLM_LAYERS[policy]} layers, vision width "
        "32 x 2 layers) "
        f"from the {IMAGE} px camera"
    )
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert init_folder(cfg, tmp_path) == folder and (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert policy_line(UpConfig(workdir=tmp_path), tmp_path) == "flowvla (ours) from the task's state"

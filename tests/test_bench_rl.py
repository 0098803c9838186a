"""bench/rl.py's knob merging and its training cache (no training, no simulator; seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.rl import check_cached_knobs, knobs, preset_knobs
from vla_rl.train.algorithms import make_config
from vla_rl.train.presets import get_preset


def test_a_preset_in_the_bench_runs_on_the_benchs_env_step_budget() -> None:
    """The preset's env_steps (a round's 50,000) must not silently replace --env-steps, which the JSON
    reports as the budget; the other knobs come from the preset, and explicit overrides win over both."""
    preset = get_preset("pickcube-awr-pi-shaped").values
    assert preset["env_steps"] == 50_000
    knobs = preset_knobs("pickcube-awr-pi-shaped", {"advantage_lambda": 0.7})
    assert "env_steps" not in knobs
    assert (
        knobs["advantage_lambda"] == 0.7 and knobs["reward"] == "shaped" and knobs["beta"] == preset["beta"]
    )
    assert preset_knobs("pickcube-awr-pi-shaped", {"env_steps": 30_000})["env_steps"] == 30_000


def test_the_hindsight_preset_is_the_shaped_recipe_plus_hindsight_copies_at_half_the_steps() -> None:
    shaped, hindsight = (
        get_preset(n).values for n in ("pickcube-awr-pi-shaped", "pickcube-awr-pi-hindsight")
    )
    assert hindsight["hindsight_weight"] == 4.0 and shaped.get("hindsight_weight", 0.0) == 0.0
    assert hindsight["env_steps"] == 25_000
    rest = {k: v for k, v in hindsight.items() if k not in ("hindsight_weight", "env_steps")}
    assert rest == {k: v for k, v in shaped.items() if k != "env_steps"}


def test_a_cached_training_result_is_reused_only_with_the_same_knobs(tmp_path: Path) -> None:
    """A cached run of other knobs (here: a smaller budget) is refused with the knob named, never
    reported under the new settings; the same knobs, or a result cached before knobs were recorded, pass."""
    values = {"base": "b", "store": tmp_path / "s", "out": tmp_path / "o", "progress": False}
    cfg = make_config("awr-pi", **values, env_steps=25_000)
    cache = tmp_path / "awr-pi.train.json"
    check_cached_knobs(cache, {"config": knobs(cfg)}, cfg)
    check_cached_knobs(cache, {"checkpoint": "c"}, cfg)
    shown = make_config("awr-pi", **{**values, "progress": True}, env_steps=25_000)
    check_cached_knobs(cache, {"config": knobs(cfg)}, shown)  # the progress display is not a knob
    old = {"config": knobs(make_config("awr-pi", **values, env_steps=15_000))}
    with pytest.raises(
        SystemExit,
        match=r"awr-pi\.train\.json: cached training used other knobs \(env_steps 15000 -> 25000\)",
    ):
        check_cached_knobs(cache, old, cfg)
    # a knob added to the config since (here: hindsight_weight) matches at its default, not otherwise
    before = {"config": {k: v for k, v in knobs(cfg).items() if k != "hindsight_weight"}}
    check_cached_knobs(cache, before, cfg)
    with pytest.raises(SystemExit, match=r"other knobs \(hindsight_weight 0\.0 -> 2\.0\)"):
        check_cached_knobs(
            cache, before, make_config("awr-pi", **values, env_steps=25_000, hindsight_weight=2.0)
        )


def test_merge_joins_seeds_of_one_protocol_and_refuses_others(tmp_path: Path) -> None:
    """Seeds trained apart (other processes or sessions) become one table: rows joined by seed, the mean
    recomputed from them, each source's machine kept; another protocol or a repeated seed is refused."""
    import json

    from bench.common import write_results
    from bench.rl import merge

    def run(name: str, seed: int, base: float, after: float, **budgets: int) -> Path:
        row = {
            "seed": seed,
            "sft": {"success": base, "seconds": 60.0},
            "awr-pi": {"success": after, "seconds": 600.0},
        }
        results = {"task": "t", "obs": "state", "budgets": {"env_steps": 25_000, **budgets}, "overrides": {},
                   "per_seed": [row], "seconds": 700.0}  # fmt: skip
        return write_results("rl", results, out=tmp_path / name)

    a, b = run("a.json", 2, 0.30, 0.70), run("b.json", 0, 0.40, 0.60)
    out = merge([a, b], tmp_path / "ab.json")
    res = json.loads(out.read_text())["results"]
    assert [s["seed"] for s in res["per_seed"]] == [0, 2]
    assert res["table"]["rows"][1][:5] == ["awr-pi", "60%", "70%", "65%", "+30 pts"]
    assert [m["file"] for m in res["merged_from"]] == ["a.json", "b.json"] and res["seconds"] == 1400.0
    assert out.with_suffix(".png").exists()
    # a seed from a later session joins the merged table; the sources stay the per-seed files
    abe = json.loads(merge([out, run("e.json", 5, 0.50, 0.90)], tmp_path / "abe.json").read_text())["results"]
    assert [s["seed"] for s in abe["per_seed"]] == [0, 2, 5]
    assert abe["table"]["rows"][1][4:6] == ["73%", "+33 pts"]
    assert [m["file"] for m in abe["merged_from"]] == ["a.json", "b.json", "e.json"]
    with pytest.raises(SystemExit, match=r"c\.json's budgets differs"):
        merge([a, run("c.json", 1, 0.3, 0.5, eval_episodes=50)], tmp_path / "x.json")
    with pytest.raises(SystemExit, match=r"a seed appears twice"):
        merge([a, run("d.json", 2, 0.3, 0.5)], tmp_path / "y.json")


def test_base_band_takes_the_most_trained_checkpoint_inside_and_names_every_score_otherwise() -> None:
    """Scored from the last checkpoint back: a base that came out too strong gives way to the latest
    checkpoint inside the band, and the earlier ones are never scored; none inside is an error listing
    each checkpoint's score and what to change."""
    from bench.rl import BaseOutOfBand, select_base

    scores = {"step_000250": 0.10, "step_000500": 0.35, "step_000750": 0.50, "step_001000": 0.70}
    ckpts = [Path("sft/checkpoints") / n for n in scores]
    scored: list[str] = []

    def score(c: Path) -> float:
        scored.append(c.name)
        return scores[c.name]

    sel = select_base(ckpts[::-1], (0.3, 0.6), score)
    assert sel["checkpoint"] == str(Path("sft/checkpoints/step_000750")) and sel["success"] == 0.50
    assert scored == ["step_001000", "step_000750"]
    assert [p["success"] for p in sel["probed"]] == [0.70, 0.50] and sel["band"] == [0.3, 0.6]
    with pytest.raises(
        BaseOutOfBand, match=r"step_001000 70%, step_000750 50%, step_000500 35%, step_000250 10%"
    ):
        select_base(ckpts, (0.8, 0.9), lambda c: scores[c.name])
    with pytest.raises(BaseOutOfBand, match=r"no checkpoints"):
        select_base([], (0.3, 0.6), lambda c: 0.0)


def test_a_banded_run_starts_from_the_chosen_checkpoint_and_records_the_choice(tmp_path: Path) -> None:
    """bench/rl.py end to end on the kinematic bed (seconds): SFT saves sft-steps / 6 checkpoints, the
    chosen one is scored on the selection seeds (400000+) and is the base the held-out table reports;
    an inverted band is a usage error naming the flag, not a traceback."""
    import json
    import subprocess
    import sys

    from tiny_base import TINY_POLICY

    out = tmp_path / "rl.json"
    cmd = [
        sys.executable, "-m", "bench.rl", "--task", "kinematic/Reach-v0", "--seeds", "0", "--demos", "4",
        "--sft-steps", "12", "--sft", json.dumps({**TINY_POLICY, "batch_size": 16}), "--rollouts", "0",
        "--algos", "awr", "--awr", json.dumps({"steps": 4, "value_steps": 4, "batch_size": 16}),
        "--eval-episodes", "4", "--eval-seed", "200000", "--base-band", "0", "1", "--base-probe-episodes", "3",
        "--work", str(tmp_path / "work"), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert res["budgets"]["base_band"] == [0.0, 1.0] and res["overrides"]["sft"]["checkpoint_every"] == 2
    sft = res["per_seed"][0]["sft"]
    assert Path(sft["selection"]["checkpoint"]).name == "step_000012"  # band [0, 1]: the last one
    assert len(sft["selection"]["probed"]) == 1 and "success" in sft
    work = tmp_path / "work" / "seed0"
    assert len(list((work / "sft" / "checkpoints").glob("step_*"))) == 6
    assert (work / "sft.step_000012.eval-200000-4.json").exists()
    assert (work / "sft.step_000012.eval-400000-3.json").exists()  # the selection score, cached
    assert res["per_seed"][0]["awr"]["config"]["base"].endswith("step_000012")

    bad = subprocess.run(
        [*cmd[:-2], "--base-band", "0.6", "0.3"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--base-band: expected 0 <= LO <= HI <= 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_merge_refuses_runs_of_another_policy(tmp_path: Path) -> None:
    """A SmolVLA run and a FlowVLA run of the same budgets are two protocols; a file written before the
    policy was recorded is a FlowVLA run."""
    from bench.common import write_results
    from bench.rl import merge

    def run(name: str, seed: int, policy: dict[str, object] | None) -> Path:
        row = {
            "seed": seed,
            "sft": {"success": 0.4, "seconds": 1.0},
            "awr-pi": {"success": 0.6, "seconds": 1.0},
        }
        results = {"task": "t", "obs": "rgb 64 px + proprioception", "budgets": {}, "overrides": {},
                   "per_seed": [row], "seconds": 2.0, **({"policy": policy} if policy else {})}  # fmt: skip
        return write_results("rl", results, out=tmp_path / name)

    smol = {"name": "smolvla", "parameters": 440_000, "config": {"image_size": 64}}
    with pytest.raises(SystemExit, match=r"b\.json's policy differs"):
        merge([run("a.json", 0, smol), run("b.json", 1, None)], tmp_path / "x.json")
    old = json.loads(
        merge([run("c.json", 0, None), run("d.json", 1, None)], tmp_path / "cd.json").read_text()
    )
    assert old["results"]["policy"] == {"name": "flowvla"}
    both = json.loads(
        merge([run("e.json", 0, smol), run("f.json", 1, smol)], tmp_path / "ef.json").read_text()
    )
    assert both["results"]["policy"] == smol


def test_policy_flag_needs_the_camera_at_a_multiple_of_32_px(tmp_path: Path) -> None:
    """``--policy smolvla`` on a state task or at a resolution the small VLM cannot patch is a usage error
    naming the flag, before anything is recorded."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "bench.rl", "--policy", "smolvla", "--task", "kinematic/Reach-v0",
           "--seeds", "0", "--work", str(tmp_path / "work")]  # fmt: skip
    state = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert state.returncode == 2 and "--policy smolvla: a LeRobot VLA acts from the camera" in state.stderr
    odd = subprocess.run(
        [*cmd, "--obs", "rgb", "--image-size", "48"], capture_output=True, text=True, timeout=120
    )
    assert odd.returncode == 2 and "--image-size: expected a positive multiple of 32" in odd.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("policy", ["flowvla", "smolvla"])
def test_a_lerobot_policy_starts_sft_from_the_small_folder_up_builds(policy: str, tmp_path: Path) -> None:
    """``--policy smolvla``: SFT continues <work>/seedN/init, the random small SmolVLA ``vla-rl up`` builds
    (same sizes, same chunk), every part training; the JSON records the name, the parameter count of that
    folder and its config. FlowVLA keeps SFT from scratch and records only its name."""
    from argparse import Namespace

    from bench.rl import lerobot_start, policy_info
    from vla_rl.up.lerobot import UP_CHUNK, parameter_count

    args = Namespace(policy=policy, task="kinematic/Reach-v0", image_size=32, work=tmp_path, seeds=[3])
    start = lerobot_start(tmp_path / "seed3", 3, args)
    if policy == "flowvla":
        assert start == {} and policy_info(args) == {"name": "flowvla"}
        assert not (tmp_path / "seed3").exists()
        return
    folder = tmp_path / "seed3" / "init"
    assert start == {"base": str(folder), "init": "base", "trainable": "full"}
    config = json.loads((folder / "config.json").read_text())
    assert config["type"] == "smolvla"
    assert (config["chunk_size"], config["n_action_steps"]) == (
        UP_CHUNK["chunk_size"],
        UP_CHUNK["n_action_steps"],
    )
    info = policy_info(args)
    assert info["name"] == "smolvla" and info["parameters"] == parameter_count(folder) > 100_000
    assert (
        info["config"]["sizes"]["vision"]["image_size"] == 32
        and info["config"]["sizes"]["text"]["width"] == 64
    )
    assert info["config"]["chunk_size"] == 10 and info["config"]["trainable_in_sft"] == "full"
    json.dumps(info)  # the results JSON holds it as is


@pytest.mark.slow
def test_a_smolvla_run_trains_and_evaluates_the_lerobot_vla_at_every_stage(tmp_path: Path) -> None:
    """bench/rl.py --policy smolvla end to end on the kinematic bed's 32 px camera (smoke budgets): the
    SFT checkpoints are SmolVLA folders, the chosen one is scored on the selection seeds, the fleet's
    rollouts and awr-pi start from it, awr-pi ships a SmolVLA folder, both are evaluated on the held-out
    seeds, and the JSON records the policy; the cached base of one policy is not reused for another."""
    import subprocess
    import sys

    from vla_rl.up.lerobot import parameter_count

    out, work = tmp_path / "rl.json", tmp_path / "work"
    awr_pi = {"env_steps": 30, "episodes_per_iteration": 2, "num_envs": 1, "max_episode_steps": 10,
              "steps_per_iteration": 3, "value_steps": 4, "batch_size": 8}  # fmt: skip
    cmd = [
        sys.executable, "-m", "bench.rl", "--policy", "smolvla", "--task", "kinematic/Reach-v0", "--obs", "rgb",
        "--image-size", "32", "--seeds", "0", "--demos", "3", "--sft-steps", "6", "--sft", '{"batch_size": 8}',
        "--base-band", "0", "1", "--base-probe-episodes", "2", "--rollouts", "2", "--algos", "awr-pi",
        "--awr-pi", json.dumps(awr_pi), "--env-steps", "30", "--eval-episodes", "2", "--eval-seed", "200000",
        "--work", str(work), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert res["policy"]["name"] == "smolvla"
    assert res["policy"]["parameters"] == parameter_count(work / "seed0" / "init")
    seed = res["per_seed"][0]
    base = Path(seed["sft"]["selection"]["checkpoint"])
    assert base.name == "step_000006" and json.loads((base / "config.json").read_text())["type"] == "smolvla"
    assert seed["rollouts"]["base"] == str(base) and seed["rollouts"]["frames"] > 0
    assert seed["awr-pi"]["config"]["base"] == str(base)
    assert json.loads((Path(seed["awr-pi"]["checkpoint"]) / "config.json").read_text())["type"] == "smolvla"
    assert 0 <= seed["sft"]["success"] <= 1 and 0 <= seed["awr-pi"]["success"] <= 1

    flow = [*cmd[:4], "flowvla", *cmd[5:]]
    other = subprocess.run(flow, capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "the cached SFT base is a smolvla, not --policy flowvla" in other.stderr

"""LeRobot v3 interop: our exports read back by LeRobot itself, imports of ours and of LeRobot's own datasets.

Everything runs on real files with LeRobot 0.6.1 offline: HF_HOME points at a temporary folder and the Hub
is switched off, so a code path that tried to download would fail here instead of reaching the network.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants  # noqa: F401  (read HF_HUB_OFFLINE before the fixture sets it)
import numpy as np
import pytest
from vla_rl_client.meta import Controller, Segment, SegmentKind
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.db import MetadataDB
from fleet.store import EpisodeStore, EpisodeWriter, outcome_known
from vla_rl.cli.common import open_db

SPEC = RobotSpec(
    name="test-arm",
    state_dim=5,
    action_dim=3,
    control_hz=10.0,
    instruction="pick up the red cube",
    cameras=(CameraSpec("base", 32, 32), CameraSpec("wrist", 32, 32)),
    action_names=("dx", "dy", "grip"),
    state_names=("j0", "j1", "j2", "j3", "gripper"),
)
REPO_ID = "vla-rl/test_export"
T0 = 1_700_000_000.0


@pytest.fixture(scope="module", autouse=True)
def offline_hf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep LeRobot / datasets off the user's cache and off the network for this module."""
    env = {
        "HF_HOME": str(tmp_path_factory.mktemp("hf_home")),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def db_flag(url: str | None) -> list[str]:
    """The CLI's ``--db URL``, or nothing for the store's own SQLite file (the default)."""
    return ["--db", url] if url else []


# ---------------------------------------------------------------------- our store
def add(w: EpisodeWriter, rng: np.random.Generator, n: int, t: float, **kw: Any) -> float:
    """Append n random frames starting at time t; returns the next frame's time."""
    spec = w.spec
    w.add_frames(
        {
            "cameras": {c.name: rng.integers(0, 256, (n, *c.shape), dtype=np.uint8) for c in spec.cameras},
            "state": rng.standard_normal((n, spec.state_dim), dtype=np.float32),
            "action": rng.uniform(-1, 1, (n, spec.action_dim)).astype(np.float32),
            "reward": rng.standard_normal(n).astype(np.float32),
            "timestamp": t + np.arange(n) / spec.control_hz,
            **kw,
        }
    )
    return t + n / spec.control_hz


def build_store(root: Path) -> EpisodeStore:
    """Three closed "pick" episodes (policy + human intervention, human demo, scripted + reset), one
    open "pick" episode and one closed episode of another task."""
    store = EpisodeStore(root, create=True)
    rng = np.random.default_rng(0)

    w = store.create_episode(SPEC, robot_id="arm-1", task="pick", episode_id="a-mixed")
    t = add(w, rng, 6, T0)
    w.begin_segment("intervention", "human", reason="operator took over")
    t = add(w, rng, 5, t)
    w.begin_segment("autonomous", "policy")
    term = np.zeros(5, bool)
    term[-1] = True
    add(w, rng, 5, t, terminated=term)
    w.close("success")

    w = store.create_episode(
        SPEC, robot_id="arm-1", task="pick", episode_id="b-demo", instruction="pick up the blue cube"
    )
    w.begin_segment("autonomous", "human", reason="teleop demo")
    trunc = np.zeros(12, bool)
    trunc[-1] = True
    add(w, rng, 12, T0 + 100, truncated=trunc)
    w.close("timeout", success=False)

    w = store.create_episode(SPEC, robot_id="arm-2", task="pick", episode_id="c-scripted")
    w.begin_segment("autonomous", "scripted", reason="scripted expert")
    ctrl = np.full(8, int(Controller.SCRIPTED), np.uint8)
    ctrl[3] = Controller.HUMAN  # one nudged frame inside the scripted segment
    t = add(w, rng, 8, T0 + 200, controller=ctrl)
    w.begin_segment("reset", "scripted", reason="reset arm")
    add(w, rng, 4, t)
    w.close("success")

    w = store.create_episode(SPEC, robot_id="arm-1", task="pick", episode_id="d-open")
    add(w, rng, 3, T0 + 300)
    w.flush()  # left open: not exported by default

    w = store.create_episode(SPEC, robot_id="arm-1", task="other", episode_id="e-other")
    add(w, rng, 4, T0 + 400)
    w.close("success")
    return store


PICK_IDS = ["a-mixed", "b-demo", "c-scripted"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, offline_hf: None) -> tuple[EpisodeStore, Path]:
    base = tmp_path_factory.mktemp("export")
    store = build_store(base / "store")
    from fleet.lerobot import export_lerobot

    out = export_lerobot(store, base / "lerobot" / "ds", REPO_ID, task="pick", use_videos=False)
    return store, out


# ---------------------------------------------------------------------- LeRobot datasets made by hand
def make_lerobot(
    root: Path,
    features: dict[str, dict[str, Any]],
    episodes: list[tuple[str, int]],
    frame: Callable[[int, int], dict[str, Any]],
    fps: int = 30,
    robot_type: str | None = None,
) -> None:
    """A LeRobot dataset written with LeRobot's own API (not our exporter): episodes = [(task, length)]."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset.create(
        "someone/handmade", fps=fps, features=features, root=root, robot_type=robot_type, use_videos=False
    )
    for e, (task, n) in enumerate(episodes):
        for i in range(n):
            ds.add_frame({**frame(e, i), "task": task})
        ds.save_episode()
    ds.finalize()


def vec(n: int, dtype: str = "float32", names: list[str] | None = None) -> dict[str, Any]:
    return {"dtype": dtype, "shape": (n,), "names": names}


def img(h: int, w: int) -> dict[str, Any]:
    return {"dtype": "image", "shape": (h, w, 3), "names": ["height", "width", "channels"]}


def so100_value(e: int, i: int, key: str) -> np.ndarray:
    """Deterministic frame content of the hand-made so100-like dataset."""
    rng = np.random.default_rng(1000 * e + i)
    if key == "observation.state":
        return rng.standard_normal(6).astype(np.float32)
    if key == "action":
        return (rng.standard_normal(6) * 50).astype(np.float32)  # raw joint targets, not [-1, 1]
    h, w = (24, 40) if key.endswith("front") else (16, 16)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


SO100_KEYS = ["observation.state", "action", "observation.images.front", "observation.images.wrist"]
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]


@pytest.fixture(scope="module")
def so100(tmp_path_factory: pytest.TempPathFactory, offline_hf: None) -> Path:
    root = tmp_path_factory.mktemp("handmade") / "so100_stack"
    features = {
        "observation.state": vec(6, names=JOINTS),
        "action": vec(6, names=JOINTS),
        "observation.images.front": img(24, 40),
        "observation.images.wrist": img(16, 16),
    }
    make_lerobot(
        root,
        features,
        [("stack the blocks", 7), ("open the drawer", 9)],
        lambda e, i: {k: so100_value(e, i, k) for k in SO100_KEYS},
        robot_type="so100_follower",
    )
    return root


# ---------------------------------------------------------------------- export
def test_export_reads_back_in_lerobot(exported: tuple[EpisodeStore, Path]) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    store, out = exported
    originals = [store.read_episode(eid) for eid in PICK_IDS]
    ds = LeRobotDataset(REPO_ID, root=out)
    assert ds.num_episodes == 3
    assert ds.num_frames == sum(ep.length for ep in originals) == 40
    assert ds.fps == 10 and ds.meta.robot_type == "test-arm"
    assert ds.features["observation.state"]["names"] == list(SPEC.state_names)
    assert ds.features["action"]["names"] == list(SPEC.action_names)
    assert ds.meta.image_keys == ["observation.images.base", "observation.images.wrist"]
    assert ds.meta.video_keys == []

    keys = ["observation.state", "action", "next.reward", "next.done", "next.truncated", "next.success"]
    keys += ["controller", "intervention", "segment", "episode_index", "frame_index"]
    cols = ds.hf_dataset.select_columns(keys).with_format("numpy")[:]
    raw = ds.hf_dataset.with_format(None)
    for e, ep in enumerate(originals):
        rows = np.flatnonzero(cols["episode_index"] == e)
        assert (cols["frame_index"][rows] == np.arange(ep.length)).all()
        for key, mine in (("observation.state", ep.state), ("action", ep.action), ("next.reward", ep.reward)):
            got = cols[key][rows]
            assert got.dtype == np.float32 and np.array_equal(got, mine), key
        assert (cols["controller"][rows] == ep.controller).all()
        in_intervention = np.array([s.kind == SegmentKind.INTERVENTION for s in ep.meta.segments])[ep.segment]
        assert (cols["intervention"][rows] == in_intervention).all()  # what store info counts
        assert (cols["segment"][rows] == ep.segment).all()
        done = ep.terminated | ep.truncated
        assert cols["next.done"][rows][-1] and (cols["next.done"][rows][:-1] == done[:-1]).all()
        truncated = ep.truncated.copy()
        truncated[-1] |= not ep.terminated[-1]  # an episode that ended without a flag ended by truncation
        assert (cols["next.truncated"][rows] == truncated).all()
        success = cols["next.success"][rows]
        assert success[-1] == ep.meta.success and not success[:-1].any()
        for cam in SPEC.camera_names:
            pngs = raw.select_columns([f"observation.images.{cam}"])[rows.tolist()]
            stored = np.stack([np.asarray(p) for p in pngs[f"observation.images.{cam}"]])
            assert stored.dtype == np.uint8 and np.array_equal(stored, ep.cameras[cam]), cam
        # LeRobot's training access path: float CHW in [0, 1], task string per frame.
        item = ds[int(rows[3])]
        assert item["task"] == ep.meta.instruction
        chw = item["observation.images.wrist"]
        assert tuple(chw.shape) == (3, 32, 32)
        back = (chw.numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0)
        assert np.array_equal(back, ep.cameras["wrist"][3])

    assert set(ds.meta.tasks.index) == {"pick up the red cube", "pick up the blue cube"}
    interventions = cols["intervention"][cols["episode_index"] == 0]
    assert interventions.tolist() == [False] * 6 + [True] * 5 + [False] * 5
    sidecar = json.loads((out / "meta" / "vla_rl.json").read_text())
    assert [e["episode_id"] for e in sidecar["episodes"]] == PICK_IDS
    assert not (out / "images").exists()  # LeRobot's empty staging folders were tidied away
    assert [p.name for p in out.parent.iterdir()] == ["ds"]  # no partial folder left behind


# ---------------------------------------------------------------------- import
@pytest.mark.parametrize(  # the CLI round trip below covers an import's DB rows on PostgreSQL in CI
    "store_db_url", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)
def test_import_of_export_is_exact(
    exported: tuple[EpisodeStore, Path], tmp_path: Path, store_db_url: str | None
) -> None:
    from fleet.lerobot import import_lerobot

    store, out = exported
    store2 = EpisodeStore(tmp_path / "store2", create=True)
    db = open_db(store2.root, store_db_url)
    ids = import_lerobot(out, store2, robot_id="importer", db=db)
    assert len(ids) == 3 and ids == sorted(ids) == store2.episode_ids()
    for eid_orig, eid_new in zip(PICK_IDS, ids, strict=True):
        a, b = store.read_episode(eid_orig), store2.read_episode(eid_new)
        assert b.meta.spec == SPEC and b.meta.spec.name == "test-arm"
        for key in ("state", "action", "reward", "terminated", "truncated", "controller", "segment"):
            x, y = getattr(a, key), getattr(b, key)
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        for cam in SPEC.camera_names:
            assert b.cameras[cam].dtype == np.uint8 and np.array_equal(a.cameras[cam], b.cameras[cam])
        assert b.meta.segments == a.meta.segments  # kinds, controllers, bounds and reasons
        assert (b.meta.outcome, b.meta.success) == (a.meta.outcome, a.meta.success)
        assert (b.meta.task, b.meta.instruction, b.meta.robot_id) == (
            a.meta.task,
            a.meta.instruction,
            "importer",
        )
        assert b.timestamp[0] == a.timestamp[0]
        assert np.allclose(np.diff(b.timestamp), 1 / SPEC.control_hz)
        assert np.isnan(b.proposed_action).all()  # not carried by the export
    assert store2.verify(db) == []
    labels = db.labels(key="source")
    assert [lab.value["episode_index"] for lab in labels] == [0, 1, 2]
    assert labels[0].value["root"] == str(out)
    db.close()


def test_import_derives_segments_without_sidecar(exported: tuple[EpisodeStore, Path], tmp_path: Path) -> None:
    """Without our sidecar (e.g. the dataset went through other tools), segments come from the columns."""
    import shutil

    from fleet.lerobot import import_lerobot

    store, out = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "meta" / "vla_rl.json").unlink()
    store2 = EpisodeStore(tmp_path / "store2", create=True)
    ids = import_lerobot(copy, store2, task="pick/derived")
    a, b = store.read_episode("a-mixed"), store2.read_episode(ids[0])
    assert np.array_equal(a.state, b.state) and np.array_equal(a.cameras["base"], b.cameras["base"])
    got = [(s.kind, s.controller, s.start, s.end) for s in b.meta.segments]
    assert got == [
        (SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 6),
        (SegmentKind.INTERVENTION, Controller.HUMAN, 6, 11),
        (SegmentKind.AUTONOMOUS, Controller.POLICY, 11, 16),
    ]
    assert b.meta.task == "pick/derived" and (b.meta.outcome, b.meta.success) == ("success", True)
    demo = store2.read_episode(ids[1])  # human-only demo: one autonomous segment, ended by truncation
    assert [(s.kind, s.controller) for s in demo.meta.segments] == [
        (SegmentKind.AUTONOMOUS, Controller.HUMAN)
    ]
    assert demo.truncated[-1] and not demo.terminated.any() and demo.meta.outcome == "failure"
    scripted = store2.read_episode(ids[2])  # segment column keeps the nudged frame inside segment 0
    assert [(s.start, s.end) for s in scripted.meta.segments] == [(0, 8), (8, 12)]
    assert scripted.controller[3] == Controller.HUMAN
    assert b.meta.spec.name == "test-arm" and b.meta.spec.instruction == "pick up the red cube"
    assert store2.verify() == []


def test_import_handmade_lerobot_dataset(so100: Path, tmp_path: Path) -> None:
    from fleet.lerobot import import_lerobot

    store = EpisodeStore(tmp_path / "store", create=True)
    ids = import_lerobot(so100, store, robot_id="so100-7")
    assert len(ids) == 2
    spec = store.read_metadata(ids[0]).spec
    assert spec == RobotSpec(
        name="so100_follower",
        state_dim=6,
        action_dim=6,
        control_hz=30.0,
        instruction="stack the blocks",
        cameras=(CameraSpec("front", 24, 40), CameraSpec("wrist", 16, 16)),
        action_names=tuple(JOINTS),
        state_names=tuple(JOINTS),
    )
    for e, (eid, instruction, n) in enumerate(
        zip(ids, ["stack the blocks", "open the drawer"], [7, 9], strict=True)
    ):
        ep = store.read_episode(eid)
        assert ep.length == n and ep.meta.instruction == instruction
        assert ep.meta.task == "so100_follower" and ep.meta.robot_id == "so100-7"  # the robot type
        want = {k: np.stack([so100_value(e, i, k) for i in range(n)]) for k in SO100_KEYS}
        assert np.array_equal(ep.state, want["observation.state"])
        assert np.array_equal(ep.action, want["action"])
        assert np.array_equal(ep.cameras["front"], want["observation.images.front"])
        assert np.array_equal(ep.cameras["wrist"], want["observation.images.wrist"])
        assert (ep.controller == Controller.HUMAN).all()  # teleop data: a human produced every action
        assert ep.meta.segments == (Segment(0, SegmentKind.INTERVENTION, Controller.HUMAN, 0, n),)
        assert (ep.meta.outcome, ep.meta.success) == ("unknown", False)
        assert not ep.reward.any() and not ep.terminated.any()
        assert ep.truncated.tolist() == [False] * (n - 1) + [True]  # it ended, without a terminal state
        assert np.allclose(np.diff(ep.timestamp), 1 / 30)
    assert store.verify() == []

    # A subset of cameras, picked by name or key, and rollouts declared as policy-controlled.
    store2 = EpisodeStore(tmp_path / "store2", create=True)
    ids2 = import_lerobot(
        so100, store2, camera_keys=["wrist"], spec_name="so100", default_controller="policy"
    )
    ep = store2.read_episode(ids2[1])
    assert ep.meta.spec.name == "so100" and ep.meta.spec.camera_names == ("wrist",)
    assert (ep.controller == Controller.POLICY).all()
    assert [s.kind for s in ep.meta.segments] == [SegmentKind.AUTONOMOUS]


def test_import_dagger_style_dataset(tmp_path: Path) -> None:
    """An ``intervention`` column (LeRobot's DAgger recording) splits segments; float64 actions are cast."""
    from fleet.lerobot import import_lerobot

    flags = [False] * 3 + [True] * 3 + [False] * 4
    root = tmp_path / "dagger"
    features = {
        "observation.state": vec(3),
        "action": vec(2, "float64"),
        "intervention": {"dtype": "bool", "shape": (1,), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
        "next.done": {"dtype": "bool", "shape": (1,), "names": None},
        "next.success": {"dtype": "bool", "shape": (1,), "names": None},
    }

    def frame(e: int, i: int) -> dict[str, Any]:
        last = i == len(flags) - 1
        return {
            "observation.state": np.full(3, i, np.float32),
            "action": np.array([i / 3, -i / 7], np.float64),
            "intervention": np.array([flags[i]]),
            "next.reward": np.array([float(last)], np.float32),
            "next.done": np.array([last]),
            "next.success": np.array([last]),
        }

    make_lerobot(root, features, [("insert the peg", len(flags))], frame, fps=15)
    store = EpisodeStore(tmp_path / "store", create=True)
    (eid,) = import_lerobot(root, store)
    ep = store.read_episode(eid)
    assert ep.meta.spec.cameras == () and ep.meta.spec.control_hz == 15.0
    assert [(s.kind, s.controller, s.start, s.end) for s in ep.meta.segments] == [
        (SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 3),
        (SegmentKind.INTERVENTION, Controller.HUMAN, 3, 6),
        (SegmentKind.AUTONOMOUS, Controller.POLICY, 6, 10),
    ]
    assert ep.action.dtype == np.float32
    assert np.array_equal(ep.action, np.array([[i / 3, -i / 7] for i in range(10)]).astype(np.float32))
    assert ep.terminated.tolist() == [False] * 9 + [True] and ep.reward[-1] == 1.0
    assert (ep.meta.outcome, ep.meta.success) == ("success", True)
    assert store.verify() == []


# ---------------------------------------------------------------------- bad input
def _bad_dataset(root: Path, case: str) -> None:
    state, action = vec(3), vec(2)
    if case == "no_state":
        features = {"observation.environment_state": vec(3), "action": action}
    elif case == "no_action":
        features = {"observation.state": state, "actions": action}
    elif case == "int_action":
        features = {"observation.state": state, "action": vec(2, "int64")}
    elif case == "bool_state":
        features = {"observation.state": vec(3, "bool"), "action": action}
    else:
        features = {"observation.state": state, "action": action}

    def frame(e: int, i: int) -> dict[str, Any]:
        out = {}
        for key, ft in features.items():
            out[key] = np.full(ft["shape"], i, dtype=ft["dtype"])
        if case == "nan_state" and (e, i) == (1, 2):
            out["observation.state"][1] = np.nan
        return out

    make_lerobot(root, features, [("t", 4), ("t", 4)], frame)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_state", r"observation\.state: expected a float32 \[S\].*no such feature"),
        ("no_action", r"action: expected a float32 \[A\].*no such feature"),
        ("int_action", r"action: expected a float dtype.*got int64"),
        ("bool_state", r"observation\.state: expected a float dtype.*got bool"),
        ("nan_state", r"observation\.state: expected finite values, got NaN or inf at episode 1 frame 2"),
    ],
)
def test_import_rejects_bad_datasets(tmp_path: Path, case: str, match: str) -> None:
    from fleet.lerobot import import_lerobot

    _bad_dataset(tmp_path / "bad", case)
    store = EpisodeStore(tmp_path / "store", create=True)
    with pytest.raises(SpecError, match=match):
        import_lerobot(tmp_path / "bad", store)
    assert store.episode_ids() == [] and [p.name for p in store.episodes_dir.iterdir()] == ["zarr.json"]


def test_import_rejects_missing_or_incomplete(so100: Path, tmp_path: Path) -> None:
    import shutil

    from fleet.lerobot import import_lerobot

    store = EpisodeStore(tmp_path / "store", create=True)
    with pytest.raises(FileNotFoundError, match=r"no LeRobot dataset at .*nope.* does not exist"):
        import_lerobot(tmp_path / "nope", store)
    assert not (tmp_path / "nope").exists()  # LeRobot would have created it
    with pytest.raises(FileNotFoundError, match="nothing is cached at"):
        import_lerobot("someone/not_downloaded", store)
    broken = tmp_path / "broken"
    shutil.copytree(so100, broken)
    shutil.rmtree(broken / "data")  # LeRobot would try to download the missing files
    with pytest.raises(FileNotFoundError, match=r"incomplete, missing \['data/\*/\*\.parquet'\]"):
        import_lerobot(broken, store)
    with pytest.raises(SpecError, match=r"camera_keys\.top: expected one of the RGB camera features"):
        import_lerobot(so100, store, camera_keys=["top"])
    assert store.episode_ids() == []


def test_export_rejects_bad_requests(exported: tuple[EpisodeStore, Path], tmp_path: Path) -> None:
    from fleet.lerobot import export_lerobot

    store, out = exported
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_lerobot(store, out, REPO_ID)
    with pytest.raises(ValueError, match="nothing to export: no closed episodes with frames for task 'none'"):
        export_lerobot(store, tmp_path / "x", REPO_ID, task="none")
    with pytest.raises(KeyError, match="no episode 'zzz'"):
        export_lerobot(store, tmp_path / "x", REPO_ID, episode_ids=["a-mixed", "zzz"])

    odd = EpisodeStore(tmp_path / "odd", create=True)
    rng = np.random.default_rng(1)
    for eid, spec in (("a", SPEC), ("b", RobotSpec("small", 4, 3, 10.0, "x", SPEC.cameras))):
        w = odd.create_episode(spec, robot_id="r", task="t", episode_id=eid)
        add(w, rng, 2, T0)
        w.close()
    with pytest.raises(ValueError, match="episode b has state_dim 4, the first episode has 5"):
        export_lerobot(odd, tmp_path / "y", REPO_ID)
    w = odd.create_episode(RobotSpec("slow", 5, 3, 12.5, "x", SPEC.cameras), robot_id="r", task="u")
    add(w, rng, 2, T0)
    w.close()
    with pytest.raises(ValueError, match=r"control_hz is 12\.5, but LeRobot stores an integer fps"):
        export_lerobot(odd, tmp_path / "y", REPO_ID, task="u")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd"]  # no partial folders either


def test_video_export_round_trip(tmp_path: Path) -> None:
    """Cameras as AV1 video: LeRobot encodes and decodes them; lossy, so images are compared loosely."""
    av = pytest.importorskip("av")
    try:
        av.codec.Codec("libsvtav1", "w")
    except Exception:
        pytest.skip("PyAV has no libsvtav1 encoder")
    from fleet.lerobot import export_lerobot, import_lerobot

    store = EpisodeStore(tmp_path / "store", create=True)
    yy, xx = np.mgrid[0:32, 0:32]
    rng = np.random.default_rng(3)
    for e in range(2):
        w = store.create_episode(SPEC, robot_id="r", task="pick", episode_id=f"v{e}")
        n = 8
        smooth = np.stack(
            [np.stack([xx * 6 + i * 4, yy * 6 + e * 40, (xx + yy) * 3 + i], -1) for i in range(n)]
        ).astype(np.uint8)
        w.add_frames(
            {
                "cameras": {"base": smooth, "wrist": smooth[:, ::-1].copy()},
                "state": rng.standard_normal((n, 5), dtype=np.float32),
                "action": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
                "timestamp": T0 + np.arange(n) / 10,
            }
        )
        w.close()
    out = export_lerobot(store, tmp_path / "video_ds", REPO_ID, use_videos=True)
    assert sorted(p.name for p in (out / "videos").iterdir()) == [
        "observation.images.base",
        "observation.images.wrist",
    ]
    store2 = EpisodeStore(tmp_path / "store2", create=True)
    ids = import_lerobot(out, store2)
    for eid, new in zip(["v0", "v1"], ids, strict=True):
        a, b = store.read_episode(eid), store2.read_episode(new)
        assert np.array_equal(a.state, b.state) and np.array_equal(a.action, b.action)
        for cam in ("base", "wrist"):
            diff = np.abs(a.cameras[cam].astype(int) - b.cameras[cam].astype(int))
            assert b.cameras[cam].shape == a.cameras[cam].shape and diff.mean() < 6, (cam, diff.mean())


def test_video_export_leaves_the_thread_off_realtime(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Run as root, SVT-AV1's encoder init raises the encoding thread to SCHED_FIFO 99 (one camera: the
    caller's; 2026-12-01, docs/experiment-log.md): the export sets it back before it returns."""
    av = pytest.importorskip("av")
    try:
        av.codec.Codec("libsvtav1", "w")
    except Exception:
        pytest.skip("PyAV has no libsvtav1 encoder")
    from fleet.lerobot import export_lerobot
    from vla_rl.core.scheduling import realtime_policy

    spec = RobotSpec("one-cam", 5, 3, 10.0, "x", (CameraSpec("base", 32, 32),))
    store = EpisodeStore(tmp_path / "store", create=True)
    w = store.create_episode(spec, robot_id="r", task="pick", episode_id="v0")
    add(w, np.random.default_rng(0), 4, T0)
    w.close()
    with caplog.at_level(logging.DEBUG, "vla_rl.core.scheduling"):
        export_lerobot(store, tmp_path / "video_ds", REPO_ID, use_videos=True)
    assert all(realtime_policy(int(t)) is None for t in os.listdir("/proc/self/task"))
    if os.geteuid() == 0:  # where the encoder raises it: the reset saw it (the culprit, still there)
        assert any("SCHED_FIFO 99" in r.message for r in caplog.records), [r.message for r in caplog.records]


# ---------------------------------------------------------------------- fidelity both ways (issue 17)
KOCH_TASKS = ["fold the towel", "wipe the table"]
EPISODE_LEN = 20


def record_style_dataset(root: Path, intervention: list[bool] | None = None) -> None:
    """What ``lerobot-record`` writes (LeRobot's own API): 4 episodes x 20 frames, 2 tasks, one small
    camera, no next.done / next.success; the last episode switches task half-way. ``intervention``
    (per frame) adds DAgger's ``intervention`` column."""
    features = {"observation.state": vec(4), "action": vec(3), "observation.images.top": img(32, 32)}
    if intervention is not None:
        features["intervention"] = {"dtype": "bool", "shape": (1,), "names": None}

    def frame(e: int, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(100 * e + i)
        out: dict[str, Any] = {
            "observation.state": rng.standard_normal(4).astype(np.float32),
            "action": rng.standard_normal(3).astype(np.float32),
            "observation.images.top": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        }
        if intervention is not None:
            out["intervention"] = np.array([intervention[i]])
        return out

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset.create(
        "someone/koch_towels", fps=30, features=features, root=root, robot_type="koch", use_videos=False
    )
    for e in range(4):
        for i in range(EPISODE_LEN):
            task = KOCH_TASKS[0] if e == 3 and i >= 10 else KOCH_TASKS[e % 2]
            ds.add_frame({**frame(e, i), "task": task})
        ds.save_episode()
    ds.finalize()


def import_into(dataset: Path, root: Path, db_url: str | None = None) -> Path:
    """``dataset`` imported into a new store at ``root`` (HF_HOME is the caller's), its episodes and labels
    recorded in the metadata DB ``db_url`` (None: none, as ``import_lerobot`` without a DB)."""
    from fleet.lerobot import import_lerobot

    db = MetadataDB(db_url) if db_url else None
    import_lerobot(dataset, EpisodeStore(root, create=True, db=db), db=db)
    if db is not None:
        db.close()
    return root


def takeover_store(root: Path, spec: RobotSpec = SPEC) -> EpisodeStore:
    """Sim-fleet style: policy, an operator takeover, handback; one success, one failure."""
    store = EpisodeStore(root, create=True)
    rng = np.random.default_rng(5)
    for e, outcome in enumerate(["success", "failure"]):
        w = store.create_episode(spec, robot_id=f"sim-{e}", task="pick", episode_id=f"fleet-{e}")
        t = add(w, rng, 7, T0)
        w.begin_segment("intervention", "human", reason="no progress for 8 steps")
        t = add(w, rng, 4 + e, t)
        w.begin_segment("autonomous", "policy", reason="handback")
        add(w, rng, 5, t)
        w.close(outcome)
    return store


def read_columns(root: Path, *keys: str) -> dict[str, np.ndarray]:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("x/y", root=root)
    return ds.hf_dataset.select_columns([*keys, "episode_index"]).with_format("numpy")[:]


def assert_intervention_agrees(store: EpisodeStore, out: Path) -> float:
    """store info's intervention rate = frames of intervention segments = the export's intervention
    column = frames whose exported controller is human; returns that rate."""
    info = store.info()["robots"]
    frames = sum(r["frames"] for r in info.values())
    rate = sum(r["intervention_rate"] * r["frames"] for r in info.values()) / frames
    in_segments = sum(
        (s.end - s.start)
        for eid in store.episode_ids()
        for s in store.read_metadata(eid).segments
        if s.kind == SegmentKind.INTERVENTION
    )
    cols = read_columns(out, "intervention", "controller")
    assert len(cols["intervention"]) == frames
    assert rate == pytest.approx(in_segments / frames) == pytest.approx(cols["intervention"].mean())
    assert (cols["intervention"] == (cols["controller"] == int(Controller.HUMAN))).all()
    return rate


def test_record_style_dataset_round_trip_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store_db_url: str | None
) -> None:
    import zarr

    from fleet.lerobot import DuplicateImportError, import_lerobot
    from vla_rl.cli import main

    data = tmp_path / "koch_towels"
    record_style_dataset(data)
    store_dir = tmp_path / "store"
    flag = db_flag(store_db_url)
    assert main(["store", "import-lerobot", str(data), str(store_dir), *flag]) == 0
    store = EpisodeStore(store_dir)
    db = open_db(store_dir, store_db_url)
    ids = store.episode_ids()
    assert len(ids) == 4
    for e, eid in enumerate(ids):
        ep = store.read_episode(eid)
        assert ep.meta.task == "koch"  # info.json robot_type, as --help says
        assert ep.meta.instruction == KOCH_TASKS[e % 2]  # each episode's own LeRobot task
        assert (ep.meta.outcome, outcome_known(ep.meta)) == ("unknown", False)
        # teleoperated: a human drives every frame, so it is all one intervention segment
        assert (ep.controller == Controller.HUMAN).all()
        assert [(s.kind, s.controller) for s in ep.meta.segments] == [
            (SegmentKind.INTERVENTION, Controller.HUMAN)
        ]
        assert ep.truncated.tolist() == [False] * (EPISODE_LEN - 1) + [True] and not ep.terminated.any()
        # one Zarr hierarchy: generic tools reach every episode's arrays from the root
        assert np.array_equal(zarr.open_group(store_dir, mode="r")["episodes"][eid]["action"][:], ep.action)
    runs = db.labels(episode_id=ids[3], key="lerobot_tasks")
    assert [lab.value for lab in runs] == [[[0, 10, KOCH_TASKS[1]], [10, 20, KOCH_TASKS[0]]]]
    assert db.labels(episode_id=ids[0], key="lerobot_tasks") == []  # one task: the instruction says it
    assert store.verify(db) == []

    info = store.info()
    task = info["tasks"]["koch"]
    assert (task["closed"], task["known"], task["unknown"], task["successes"]) == (4, 0, 4, 0)
    assert task["success_rate"] is None and info["robots"]["lerobot"]["intervention_rate"] == 1.0
    capsys.readouterr()
    assert main(["store", "info", str(store_dir), *flag]) == 0
    shown = capsys.readouterr().out
    assert "n/a (4 unknown)" in shown and "0/4" not in shown and "100.0%" in shown

    # The same dataset again (here, a copy elsewhere) is refused, naming it and the existing episodes.
    copy = tmp_path / "copy_of_towels"
    import shutil

    shutil.copytree(data, copy)
    assert main(["store", "import-lerobot", str(copy), str(store_dir), *flag]) == 2
    err = capsys.readouterr().err
    assert "already imported" in err and str(copy) in err and ids[0] in err and "--allow-duplicate" in err
    assert store.episode_ids() == ids
    with pytest.raises(DuplicateImportError):
        import_lerobot(data, store, db=db)
    assert len(import_lerobot(copy, store, db=db, allow_duplicate=True)) == 4
    db.close()

    # Export: video by default, next.done on every last frame, no next.success (no outcome is known).
    # (the duplicates by name, not by sort position: an import in the same second sorts between the first's)
    for eid in set(store.episode_ids()) - set(ids):
        shutil.rmtree(store.episodes_dir / eid)
    out = tmp_path / "export"
    export = ["store", "export-lerobot", str(store_dir), str(out), "--repo-id", "fleet/towels", *flag]
    assert main(export) == 0
    features = json.loads((out / "meta" / "info.json").read_text())["features"]
    assert features["observation.images.top"]["dtype"] == "video"
    assert "next.success" not in features and "outcome_known" not in features
    cols = read_columns(out, "next.done", "next.truncated", "intervention", "controller")
    for e in range(4):
        done = cols["next.done"][cols["episode_index"] == e]
        assert done.tolist() == [False] * (EPISODE_LEN - 1) + [True]
    assert cols["intervention"].all() and (cols["controller"] == int(Controller.HUMAN)).all()
    assert_intervention_agrees(store, out)
    sidecar = json.loads((out / "meta" / "vla_rl.json").read_text())
    assert {(e["outcome"], e["success"]) for e in sidecar["episodes"]} == {("unknown", None)}

    # ...and back: still unknown, still the same tasks, instructions and segments.
    back = EpisodeStore(tmp_path / "back", create=True)
    new = import_lerobot(out, back)
    for old_id, new_id in zip(ids, new, strict=True):
        a, b = store.read_metadata(old_id), back.read_metadata(new_id)
        assert (b.task, b.instruction, b.outcome, outcome_known(b)) == (
            a.task,
            a.instruction,
            "unknown",
            False,
        )
        assert b.segments == a.segments
        assert np.array_equal(back.read_episode(new_id).truncated, store.read_episode(old_id).truncated)


@pytest.mark.parametrize("case", ["no_intervention_column", "mixed_intervention", "sim_fleet_takeovers"])
def test_intervention_agrees_in_store_info_segments_and_export(tmp_path: Path, case: str) -> None:
    from fleet.lerobot import export_lerobot, import_lerobot

    if case == "sim_fleet_takeovers":
        store = takeover_store(tmp_path / "store")
        want = (4 + 5) / (16 + 17)
    else:
        flags = [False] * 5 + [True] * 8 + [False] * 7 if case == "mixed_intervention" else None
        record_style_dataset(tmp_path / "ds", intervention=flags)
        store = EpisodeStore(tmp_path / "store", create=True)
        import_lerobot(tmp_path / "ds", store)
        want = 8 / 20 if flags else 1.0
        ep = store.read_episode(store.episode_ids()[0])
        assert (ep.controller == Controller.HUMAN).tolist() == (flags or [True] * EPISODE_LEN)
    out = export_lerobot(store, tmp_path / "out", REPO_ID, use_videos=False)
    assert assert_intervention_agrees(store, out) == pytest.approx(want)
    # and the same again after the round trip, with and without our sidecar
    for sidecar in (True, False):
        if not sidecar:
            (out / "meta" / "vla_rl.json").unlink()
        back = EpisodeStore(tmp_path / f"back-{sidecar}", create=True)
        import_lerobot(out, back)
        info = back.info()["robots"]
        rate = sum(r["intervention_rate"] * r["frames"] for r in info.values()) / sum(
            r["frames"] for r in info.values()
        )
        assert rate == pytest.approx(want), sidecar


def test_unknown_outcomes_next_to_known_ones_stay_unknown(tmp_path: Path) -> None:
    from fleet.lerobot import export_lerobot, import_lerobot

    record_style_dataset(tmp_path / "ds")
    store = EpisodeStore(tmp_path / "store", create=True)
    unknown = import_lerobot(tmp_path / "ds", store)[:2]
    spec = store.read_metadata(unknown[0]).spec
    w = store.create_episode(spec, robot_id="koch-2", task="koch", episode_id="zz-known-failure")
    add(w, np.random.default_rng(0), 6, T0)
    w.close("failure")
    task = store.info()["tasks"]["koch"]
    assert (task["known"], task["unknown"], task["successes"], task["success_rate"]) == (1, 4, 0, 0.0)

    out = export_lerobot(store, tmp_path / "out", REPO_ID, episode_ids=[*unknown, "zz-known-failure"])
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset(REPO_ID, root=out)
    assert ds[0]["outcome_known"].item() is False and ds[len(ds) - 1]["outcome_known"].item() is True
    cols = read_columns(out, "next.success", "outcome_known", "next.done")
    assert not cols["next.success"].any()
    assert cols["outcome_known"].tolist() == [False] * 40 + [True] * 6
    assert cols["next.done"].sum() == 3
    for sidecar in (True, False):
        if not sidecar:
            (out / "meta" / "vla_rl.json").unlink()
        back = EpisodeStore(tmp_path / f"back-{sidecar}", create=True)
        metas = [back.read_metadata(e) for e in import_lerobot(out, back)]
        assert [m.outcome for m in metas] == ["unknown", "unknown", "failure"], sidecar
        assert back.info()["tasks"][metas[0].task]["unknown"] == 2


def test_a_failed_import_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_db_url: str | None
) -> None:
    import fleet.lerobot.importer as lio
    from vla_rl.cli import main

    record_style_dataset(tmp_path / "ds")
    real = lio.read_images
    calls = []

    def failing(ds: Any, plan: Any, cameras: Any, fps: float) -> dict[str, np.ndarray]:
        calls.append(plan.episode_index)
        if len(calls) == 3:
            raise OSError("disk went away")
        return real(ds, plan, cameras, fps)

    monkeypatch.setattr(lio, "read_images", failing)
    with pytest.raises(OSError, match="disk went away"):
        main(
            [
                "store",
                "import-lerobot",
                str(tmp_path / "ds"),
                str(tmp_path / "new" / "store"),
                *db_flag(store_db_url),
            ]
        )
    assert not (tmp_path / "new").exists()  # no store folder, no DB
    if store_db_url:  # the DB elsewhere: no row in it
        db = MetadataDB(store_db_url)
        assert db.episodes() == [] and db.labels() == []
        db.close()

    store = takeover_store(tmp_path / "old")  # an existing store keeps exactly what it had
    db = open_db(store.root, store_db_url)
    before = store.episode_ids()
    calls.clear()
    with pytest.raises(OSError, match="disk went away"):
        lio.import_lerobot(tmp_path / "ds", EpisodeStore(store.root, db=db))
    assert store.episode_ids() == before and sorted(store.episodes_dir.iterdir()) == sorted(
        [store.episodes_dir / e for e in before] + [store.episodes_dir / "zarr.json"]
    )
    assert db.episodes() == [] and db.labels() == []  # the two written episodes never reached the DB
    db.close()
    (tmp_path / "empty").mkdir()
    calls.clear()
    with pytest.raises(OSError):
        main(["store", "import-lerobot", str(tmp_path / "ds"), str(tmp_path / "empty")])
    assert list((tmp_path / "empty").iterdir()) == []


def test_cli_help_matches_behaviour(capsys: pytest.CaptureFixture[str]) -> None:
    from vla_rl.cli import main

    for cmd in ("import-lerobot", "export-lerobot"):
        try:
            main(["store", cmd, "--help"])
        except SystemExit as e:
            assert e.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--videos, --no-videos" in text and "--allow-duplicate" in text
    assert "robot_type in meta/info.json" in text and "--default-controller" in text


def test_import_and_export_with_a_jpeg_camera(exported: tuple[EpisodeStore, Path], tmp_path: Path) -> None:
    """--camera-codec on import: base as JPEG (each frame exactly its JPEG round trip), wrist lossless;
    exporting that store (PNG) and importing it again gives back the JPEG store's pixels bit for bit."""
    from fleet.codecs import array_codec, decode_jpeg, encode_jpeg
    from fleet.lerobot import export_lerobot, import_lerobot

    store, out = exported
    jstore = EpisodeStore(tmp_path / "jpeg", create=True)
    ids = import_lerobot(
        out, jstore, db=MetadataDB.for_store(jstore.root), camera_codec="jpeg:90,wrist=lossless"
    )
    assert array_codec(jstore.read_array(ids[0], "cameras/base")) == "jpeg:90"
    a, b = store.read_episode(PICK_IDS[0]), jstore.read_episode(ids[0])
    want = np.stack([decode_jpeg(encode_jpeg(f, 90), f.shape) for f in a.cameras["base"]])
    np.testing.assert_array_equal(b.cameras["base"], want)
    np.testing.assert_array_equal(b.cameras["wrist"], a.cameras["wrist"])
    assert jstore.verify() == []
    again = export_lerobot(
        jstore, tmp_path / "re" / "ds", "vla-rl/jpeg_export", task="pick", use_videos=False
    )
    back = EpisodeStore(tmp_path / "back", create=True)
    ids2 = import_lerobot(again, back, db=MetadataDB.for_store(back.root))
    for x, y in zip(ids, ids2, strict=True):
        for cam in SPEC.camera_names:
            np.testing.assert_array_equal(
                back.read_episode(y).cameras[cam], jstore.read_episode(x).cameras[cam]
            )


def test_an_episode_whose_task_changes_conditions_each_frame_on_its_own_task(
    tmp_path: Path, store_db_url: str | None
) -> None:
    """The last record-style episode switches task half-way: SFT's dataset and the RL trainers' buffer
    give each frame its run's task (the import's ``lerobot_tasks`` label), not the episode's first one."""
    from vla_rl_client.meta import frame_instructions

    from fleet.dataset import ChunkDataset, labelled_instructions
    from fleet.selection import Selection
    from vla_rl.cli import main
    from vla_rl.train.transitions import load_transitions

    data, store_dir = tmp_path / "koch", tmp_path / "store"
    record_style_dataset(data)
    assert main(["store", "import-lerobot", str(data), str(store_dir), *db_flag(store_db_url)]) == 0
    store, db = EpisodeStore(store_dir), open_db(store_dir, store_db_url)
    ids = store.episode_ids()

    def expected(e: int, t: int) -> str:
        return KOCH_TASKS[0] if e == 3 and t >= 10 else KOCH_TASKS[e % 2]

    ds = ChunkDataset(store, 4, instructions=labelled_instructions(db.current_labels(ids)))
    plain = ChunkDataset(store, 4)  # without the labels: the episode's (first) task for all its frames
    assert len(ds) == len(plain) == 4 * EPISODE_LEN
    b = ds.batch(np.arange(len(ds)))
    got = [
        (ids.index(ds.episode_ids[e]), int(t))
        for e, t in zip(b["episode_index"], b["frame_index"], strict=True)
    ]
    assert [ds.instruction(i) for i in range(len(ds))] == [expected(e, t) for e, t in got]
    assert {plain.instruction(i) for i, (e, _) in enumerate(got) if e == 3} == {KOCH_TASKS[1]}

    buf = load_transitions(store, Selection.parse(None, task="koch"), db=db, cameras=False)
    codes = buf.array("instruction")
    eps, frames = buf.array("episode"), buf.array("frame")
    texts = [buf.instructions[c] for c in codes]
    assert texts == [
        expected(ids.index(buf.episode_ids[e]), int(t)) for e, t in zip(eps, frames, strict=True)
    ]

    assert frame_instructions(3, "a", [[1, 3, "b"]]) == ["a", "b", "b"]
    for bad in ([[0, 4, "b"]], [[2, 1, "b"]], [[0, 1]], [["0", 1, "b"]], [[0, 1, 2]]):
        with pytest.raises(ValueError, match=r"^lerobot_tasks: expected runs \[start, end, task\]"):
            frame_instructions(3, "a", bad)

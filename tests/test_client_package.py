"""The slim robot-side distribution, ``vla-rl-client``, installed into a bare venv without torch, drives a
robot loop against a real policy server and a real fleet collector started here (from the full venv).

Built from ``packages/vla-rl-client`` with ``pip wheel`` (as ``make client`` does); the venv (``python -m venv``, no system site packages) gets the
wheel and its dependencies from pip, pinned to requirements/lock.txt. Built once per test session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import numpy as np
import pytest
from test_server import SPEC, TOKEN, make_checkpoint, start_server

from fleet.collector import Collector, CollectorConfig
from scripts.import_graph import ROOT

ROBOT_LOOP = dedent(
    """
    import json, sys
    import numpy as np

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        sys.exit("torch is importable in the bare venv")
    import vla_rl_client.robot_client
    import vla_rl_client.policy_client
    from vla_rl_client.spec import RobotSpec

    args = json.loads(sys.argv[1])
    spec = RobotSpec.from_json(args["spec"])
    rng = np.random.default_rng(0)
    state = rng.normal(size=spec.state_dim).astype(np.float32)
    actions, commits = [], set()
    robot = vla_rl_client.robot_client.RobotClient(
        args["collector"], "bare-arm", spec, "test/task", token=args["token"], max_batch_frames=4
    )
    with vla_rl_client.policy_client.PolicyClient(args["policy"], token=args["token"], timeout_s=30) as policy:
        eid = robot.start_episode()
        for k in range(args["chunks"]):
            cams = {c.name: rng.integers(0, 256, c.shape, dtype=np.uint8) for c in spec.cameras}
            chunk = policy.act({"state": state, "cameras": cams}, seed=k)
            commits.add(chunk.commit)
            for a in chunk.actions[: chunk.n_exec]:
                robot.add_frame(cameras=cams, state=state, action=a, revision=chunk.commit)
                actions.append(a.tolist())
                state = state + 0.01
    robot.end_episode("success")
    assert robot.close(60), robot.errors
    heavy = sorted(m for m in ("torch", "zarr", "sqlalchemy", "lerobot", "grpc_health") if m in sys.modules)
    files = [m.__file__ for m in (vla_rl_client.policy_client, vla_rl_client.robot_client)]
    out = {"episode": eid, "actions": actions, "commits": sorted(commits), "heavy": heavy, "files": files}
    print(json.dumps(out))
    """
)


def build_wheel(out: Path) -> Path:
    """``make client``: the vla-rl-client wheel built from (a copy of: setuptools builds in the source
    folder) its own folder into ``out``; its path."""
    src = out.parent / "vla-rl-client-src"
    shutil.copytree(
        ROOT / "packages" / "vla-rl-client", src, ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([*cmd, str(src)], check=True, capture_output=True)
    [wheel] = out.glob("vla_rl_client-*.whl")
    return wheel


def test_the_wheel_holds_the_client_package_and_nothing_else(tmp_path: Path) -> None:
    """Every module and the .proto contracts, and no file of the full distribution (quick: no install)."""
    import zipfile

    names = zipfile.ZipFile(build_wheel(tmp_path / "dist")).namelist()
    src = ROOT / "packages" / "vla-rl-client"
    want = {p.relative_to(src).as_posix() for p in (src / "vla_rl_client").rglob("*") if p.is_file()}
    want = {w for w in want if "__pycache__" not in w}
    assert {n for n in names if not n.startswith("vla_rl_client-")} == want
    assert {"vla_rl_client/proto/policy_service.proto", "vla_rl_client/robot_client.py"} <= want


def _bare_env() -> dict[str, str]:
    """The environment without this venv's traces (PYTHONPATH would put the source tree first)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only vla-rl-client and its dependencies (built once per session)."""
    root = tmp_path_factory.mktemp("client-venv")
    wheel = build_wheel(root / "dist")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_bare_env())
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-input", "-c", str(ROOT / "requirements/lock.txt")]
    subprocess.run([*pip, str(wheel)], check=True, env=_bare_env(), timeout=600)
    return py


# slow: kept out of CI's short run for time (make test <= 15 min on 2 cores); run with -m slow
@pytest.mark.slow
def test_bare_venv_has_the_client_and_no_torch(bare_python: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('torch', 'zarr', 'sqlalchemy', 'lerobot') if u.find_spec(m)])"
    out = subprocess.run(
        [str(bare_python), "-I", "-c", probe], capture_output=True, text=True, check=True, env=_bare_env()
    )
    assert out.stdout.strip() == "[]"
    dists = subprocess.run(
        [str(bare_python), "-I", "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        env=_bare_env(),
    )
    versions = {d["name"].lower(): d["version"] for d in json.loads(dists.stdout)}
    assert not versions.keys() & {"torch", "vla-rl", "zarr", "sqlalchemy", "lerobot", "mani-skill"}
    lock = dict(
        line.lower().split("==")
        for line in (ROOT / "requirements/lock.txt").read_text().splitlines()
        if "==" in line
    )
    for dist in ("numpy", "grpcio", "protobuf", "pillow"):
        assert versions[dist] == lock[dist], dist  # the versions the full venv is tested with
    assert "vla-rl-client" in versions


# slow: kept out of CI's short run for time (make test <= 15 min on 2 cores); run with -m slow
@pytest.mark.slow
def test_robot_loop_from_the_bare_venv(bare_python: Path, tmp_path: Path) -> None:
    script = tmp_path / "robot_loop.py"
    script.write_text(ROBOT_LOOP)
    policy_server = start_server({"arm": make_checkpoint(tmp_path / "ckpt", 0)})
    try:
        with Collector(
            CollectorConfig(store=tmp_path / "store", port=0, idle_flush_s=0.5), token=TOKEN
        ) as collector:
            args = {
                "policy": policy_server.address,
                "collector": collector.address,
                "token": TOKEN,
                "spec": SPEC.to_json(),
                "chunks": 3,
            }
            run = subprocess.run(
                [str(bare_python), "-I", str(script), json.dumps(args)],
                capture_output=True,
                text=True,
                timeout=180,
                cwd=tmp_path,
                env=_bare_env(),
            )
            assert run.returncode == 0, run.stderr[-4000:]
            got = json.loads(run.stdout.strip().splitlines()[-1])
            assert collector.drain(30)
            meta = collector.store.read_metadata(got["episode"])
            ep = collector.store.read_episode(got["episode"])
            rec = collector.db.episode(got["episode"])
    finally:
        policy_server.stop()
    venv = bare_python.parents[1]
    assert all(Path(f).is_relative_to(venv) for f in got["files"]), got["files"]  # the wheel's, not ours
    assert got["heavy"] == []
    actions = np.array(got["actions"], np.float32)
    assert len(actions) >= 3 and len(got["commits"]) == 1
    # the episode landed in the store with every frame, closed, and in the metadata DB
    assert meta.is_closed and meta.outcome == "success" and meta.robot_id == "bare-arm"
    assert meta.length == len(actions) and set(meta.revisions) == set(got["commits"])
    np.testing.assert_array_equal(ep.action, actions)
    assert rec is not None and rec.status == "closed" and rec.length == len(actions)

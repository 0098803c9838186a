"""Offline evaluation (no simulator): action error of a policy against recorded episodes, checked against an
independent per-frame computation; rounds on imported real data gate on it; `vla-rl eval --store` and
`vla-rl client act --from-store`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from imported_base import imported_base, on_backend, on_postgresql
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.spec import RobotSpec

from fleet.store import EpisodeStore
from vla_rl.evaluation_offline import evaluate_offline, held_out_episodes

SPEC = RobotSpec(name="toy-arm", state_dim=3, action_dim=2, control_hz=10.0, instruction="reach")
H = 4


def toy_store(root: Path) -> EpisodeStore:
    """Three episodes (lengths 5, 7, 3; two tasks, two instructions) with random states and actions."""
    store = EpisodeStore(root, create=True)
    rng = np.random.default_rng(0)
    for k, (n, task, instr) in enumerate([(5, "a", "reach"), (7, "b", "push"), (3, "a", "push")]):
        w = store.create_episode(SPEC, robot_id="r", task=task, instruction=instr, episode_id=f"ep-{k}")
        w.begin_segment("autonomous", "policy")
        w.add_frames(
            {
                "state": rng.standard_normal((n, 3)).astype(np.float32),
                "action": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
                "reward": np.zeros(n, np.float32),
                "terminated": np.zeros(n, bool),
                "truncated": np.zeros(n, bool),
                "controller": np.zeros(n, np.uint8),
                "timestamp": np.arange(n, dtype=np.float64),
            }
        )
        w.close(outcome="success")
    return store


class KnownPolicy:
    """chunk[h, a] = state[a] * (h + 1) + 0.1 * (instruction == 'push'), with an affine action normaliser."""

    spec = SPEC
    chunk_len = H

    def __init__(self) -> None:
        norm = SimpleNamespace(action_offset=torch.tensor([0.5, -0.5]), action_scale=torch.tensor([2.0, 0.5]))
        self.policy = SimpleNamespace(normalizer=norm)
        self.seeds: list[int] = []

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        self.seeds.append(seed)
        s = np.asarray(obs["state"])[:, :2]
        bias = np.array([0.1 if i == "push" else 0.0 for i in obs["instruction"]])[:, None, None]
        return (s[:, None, :] * np.arange(1, H + 1)[None, :, None] + bias).astype(np.float32)


def independent(store: EpisodeStore, ids: list[str]) -> dict[str, Any]:
    off, scale = np.array([0.5, -0.5]), np.array([2.0, 0.5])
    rows: list[tuple[str, str, int, np.ndarray]] = []  # task, instruction, step, squared error [A]
    for eid in ids:
        ep = store.read_episode(eid)
        for t in range(ep.length):
            for h in range(H):
                if t + h >= ep.length:
                    continue  # padded past the end: not counted
                pred = ep.state[t, :2] * (h + 1) + (0.1 if ep.meta.instruction == "push" else 0.0)
                err = ((pred - off) / scale - (ep.action[t + h] - off) / scale) ** 2
                rows.append((ep.meta.task, ep.meta.instruction, h, err))
    errs = np.array([r[3] for r in rows])
    return {
        "overall": errs.mean(),
        "per_dim": errs.mean(0),
        "per_step": [np.mean([r[3] for r in rows if r[2] == h]) for h in range(H)],
        "per_task": {k: np.mean([r[3] for r in rows if r[0] == k]) for k in ("a", "b")},
        "per_instruction": {k: np.mean([r[3] for r in rows if r[1] == k]) for k in ("push", "reach")},
    }


def test_offline_mse_matches_an_independent_computation(tmp_path: Path) -> None:
    store = toy_store(tmp_path / "store")
    ids = store.episode_ids()
    policy = KnownPolicy()
    r = evaluate_offline(policy, store, ids, seed=7, batch_size=4)
    want = independent(store, ids)
    assert r.frames == 15 and r.chunk_len == H and r.episode_ids == ids
    assert r.action_mse == pytest.approx(want["overall"], rel=1e-6)
    np.testing.assert_allclose(r.per_dim, want["per_dim"], rtol=1e-6)
    np.testing.assert_allclose(r.per_step, want["per_step"], rtol=1e-6)
    assert r.per_task == pytest.approx(want["per_task"], rel=1e-6)
    assert r.per_instruction == pytest.approx(want["per_instruction"], rel=1e-6)
    assert r.val_loss is None  # not a flow VLA
    assert policy.seeds == [7, 8, 9, 10]  # one seed per batch of 4 frames, from the given seed
    assert "a[1]" in r.table() and "push" in r.table()


def test_offline_subsample_is_seeded_and_held_out_is_the_most_recent(tmp_path: Path) -> None:
    store = toy_store(tmp_path / "store")
    ids = store.episode_ids()
    a = evaluate_offline(KnownPolicy(), store, ids, seed=3, max_frames=6)
    b = evaluate_offline(KnownPolicy(), store, ids, seed=3, max_frames=6)
    c = evaluate_offline(KnownPolicy(), store, ids, seed=4, max_frames=6)
    assert a.frames == 6 and a.action_mse == b.action_mse and a.per_dim == b.per_dim
    assert c.action_mse != a.action_mse
    assert held_out_episodes(ids, 2) == ids[-2:] and held_out_episodes(ids, 0) == ids[-1:]
    with pytest.raises(ValueError, match="episode_ids"):
        evaluate_offline(KnownPolicy(), store, [])


@pytest.fixture(scope="module")
def koch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An imported LeRobot dataset (LeRobot's own API; task "koch", no simulator) and an SFT base on it."""
    return imported_base(tmp_path_factory.mktemp("koch"))


@pytest.fixture(scope="module")
def koch_pg(
    koch: tuple[Path, Path], pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str]:
    """The same dataset imported into a store whose metadata DB is a PostgreSQL database (episodes and
    labels recorded there), with the same base."""
    return on_postgresql(koch, pg, tmp_path_factory.mktemp("koch-pg"))


@pytest.fixture(params=["sqlite", "postgresql"])
def koch_db(request: pytest.FixtureRequest) -> tuple[Path, Path, str | None]:
    """(store, base, metadata DB URL): koch with the store's SQLite (None), or koch_pg."""
    return on_backend(request, "koch")


@pytest.mark.parametrize(
    "algo",
    ["sft"],
)
def test_round_on_imported_real_data_gates_on_offline_action_mse(koch_db, tmp_path: Path, algo: str) -> None:
    from vla_rl.cli.common import open_db
    from vla_rl.hub.checkpoint import read_info
    from vla_rl.rounds import RoundConfig, start_round
    from vla_rl.train.algorithms import make_config

    store, base, db_url = koch_db
    knobs: dict[str, Any] = {"steps": 20, "batch_size": 16} | ({"value_steps": 20} if algo == "awr" else {})
    train = make_config(algo, base=str(base), store=store, out=tmp_path / "rounds", db_url=db_url, **knobs)
    train.progress = False
    rec = start_round(RoundConfig(train=train, push=False, eval_episodes=50, margin=0.0, gate_alpha=1.0))
    m = rec.metrics
    ids = EpisodeStore(store).episode_ids()
    assert rec.status == "succeeded" and rec.task == "koch"
    assert m["eval"] == "offline" and m["success"] is None and m["base_success"] is None
    assert m["eval_episode_ids"] == ids[-1:]  # 4 episodes: the most recent fifth (at least one)
    # ... and the candidate never trained on them: 3 of the 4 episodes, the held-out one excluded
    assert m["held_out_excluded_from_training"] is True
    assert rec.data["selection"]["exclude"] == ids[-1:] and rec.data["episodes"] == len(ids) - 1
    assert m["action_mse"] > 0 and m["base_action_mse"] > 0 and len(m["action_mse_per_dim"]) == 3
    assert set(m["action_mse_per_task"]) == {"koch"} and m["val_loss"] is not None
    passed = m["base_action_mse"] - m["action_mse"] > 0.0 * m["base_action_mse"]
    assert m["gate"]["passed"] is passed and rec.promoted is False  # push=False: nothing to move
    assert "offline action MSE" in m["gate"]["reason"]
    info = read_info(rec.checkpoint_ref)
    assert info.metrics["offline_action_mse"] == pytest.approx(m["action_mse"])
    assert info.metrics["offline_eval_episode_ids"] == ids[-1:] and "success_rate" not in info.metrics
    assert open_db(store, db_url).rounds(task="koch")[-1].metrics["gate"] == m["gate"]
    assert (store / "metadata.db").exists() is (db_url is None)  # a round on PostgreSQL writes nothing beside


@pytest.mark.parametrize(
    "koch_db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)
def test_an_awr_round_on_teleoperated_data_fails_naming_the_reason(koch_db, tmp_path: Path) -> None:
    """A LeRobot recording is all teleoperation (intervention segments): AWR has no autonomous frames to
    weight, and the round says so (recorded as failed) rather than training on nothing."""
    from vla_rl.cli.common import open_db
    from vla_rl.rounds import RoundConfig, start_round
    from vla_rl.train.algorithms import make_config

    store, base, db_url = koch_db
    train = make_config(
        "awr",
        base=str(base),
        store=store,
        out=tmp_path / "r",
        db_url=db_url,
        steps=5,
        value_steps=5,
        batch_size=16,
    )
    train.progress = False
    with pytest.raises(ValueError, match="no autonomous frames"):
        start_round(RoundConfig(train=train, push=False, eval_episodes=50))
    last = open_db(store, db_url).rounds()[-1]
    assert last.status == "failed" and "no autonomous frames" in (last.error or "")


def test_eval_cli_offline_on_a_store(koch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from policies.loading import load_policy
    from vla_rl.cli import main

    store, base = koch
    out = tmp_path / "eval.json"
    argv = ["eval", "--checkpoint", str(base), "--store", str(store), "--episodes", "2", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "action dim" in text and "a[2]" in text and "koch" in text
    res = json.loads(out.read_text())
    ids = EpisodeStore(store).episode_ids()
    assert res["episode_ids"] == ids[-2:] and res["frames"] == 40 and res["tasks"] == ["koch"]
    direct = evaluate_offline(load_policy(base), EpisodeStore(store), ids[-2:], seed=100_000)
    assert res["action_mse"] == pytest.approx(direct.action_mse, rel=RECOMPUTED_RTOL, abs=RECOMPUTED_ATOL)
    # not a simulator task and no store: the error names --store
    assert main(["eval", "--checkpoint", str(base)]) == 2
    assert "--store" in capsys.readouterr().err


def test_client_act_sends_a_recorded_observation(
    koch, cli_server, capsys: pytest.CaptureFixture[str]
) -> None:
    from vla_rl_client.policy_client import PolicyClient

    from vla_rl.cli import main

    store, base = koch
    addr = cli_server("--checkpoint", str(base))
    argv = ["client", "act", "--server", addr, "--from-store", str(store), "--timeout", "60"]
    assert main([*argv, "--episode", "1", "--frame", "5", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert "chunk [4 x 3]" in text and "recorded observation" in text
    ep = EpisodeStore(store).read_episode(EpisodeStore(store).episode_ids()[1])
    obs = {"state": ep.state[5], "cameras": {k: v[5] for k, v in ep.cameras.items()}}
    with PolicyClient(addr, timeout_s=60) as client:
        want = client.act({**obs, "instruction": ep.meta.instruction}, seed=3).actions
    with np.printoptions(precision=3, suppress=True):
        assert str(want) in text  # the same observation as sent directly
    eid = ep.meta.episode_id
    assert main([*argv, "--episode", eid, "--frame", "0"]) == 0
    capsys.readouterr()
    assert main([*argv, "--episode", "nope"]) == 2
    assert "--episode nope" in capsys.readouterr().err
    assert main([*argv, "--episode", eid, "--frame", "20"]) == 2
    assert "--frame 20" in capsys.readouterr().err

"""Few-step distillation (vla_rl/train/fewstep.py): its losses against independent computations, the
config's checks, and a short run end to end whose student is an ordinary checkpoint served with its K."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_base import tiny_base

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.loading import load_policy
from vla_rl.hub.checkpoint import read_info
from vla_rl.train.algorithms import ALGORITHMS, make_config, train
from vla_rl.train.contract import PolicyInputs, load_base, trainable_copy
from vla_rl.train.fewstep import (
    DistillConfig,
    OnPolicyFrames,
    TeacherPairs,
    check_grids,
    distill_losses,
    flow_map_loss,
    rollout_loss,
    teacher_grid_points,
)
from vla_rl.train.fql import distillation_loss, one_step_actions
from vla_rl.train.transitions import load_transitions

torch.set_num_threads(1)  # small nets on a shared machine: extra threads only contend

TASK = "kinematic/Reach-v0"


def _velocity() -> Any:
    """A field that depends on x and t: v(x, t) = x A + c + t d (per chunk step, over the last dim)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 3, generator=g) * 0.3
    c, d = torch.randn(3, generator=g), torch.randn(3, generator=g)

    def v(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return x @ a + c + t * d

    return v


def test_flow_map_and_rollout_losses_hand_computed_over_the_robot_dims() -> None:
    v = _velocity()
    torch.manual_seed(0)
    iterates = torch.randn(4, 5, 2, 3)  # K_T = 4 teacher iterates of [H = 2, D = 3] chunks
    points = teacher_grid_points(iterates, 2)
    torch.testing.assert_close(points, iterates[:, [0, 2, 4]])
    dims = 2  # the last dim is padding: no action to distil
    x0, xm, x1 = iterates[:, 0], iterates[:, 2], iterates[:, 4]
    by_hand_map = 0.5 * (
        (x0 + 0.5 * v(x0, 0.0) - xm)[..., :2].square().mean()
        + (xm + 0.5 * v(xm, 0.5) - x1)[..., :2].square().mean()
    )
    torch.testing.assert_close(flow_map_loss(v, points, dims), by_hand_map)
    mid = x0 + 0.5 * v(x0, 0.0)  # the student's own midpoint, not the teacher's
    end = mid + 0.5 * v(mid, 0.5)
    by_hand_roll = (end - x1)[..., :2].square().mean()
    torch.testing.assert_close(rollout_loss(v, x0, x1, 2, dims), by_hand_roll)
    out = distill_losses(v, points, dims, map_weight=0.5, rollout_weight=2.0)
    torch.testing.assert_close(out["loss"], 0.5 * by_hand_map + 2.0 * by_hand_roll)
    # with a field acting dim by dim, what the padding dim holds changes nothing
    diagonal = lambda x, t: 0.5 * x + 1.0  # noqa: E731
    padded = iterates.clone()
    padded[..., 2] += 10.0
    losses = [
        distill_losses(diagonal, teacher_grid_points(x, 2), dims, map_weight=1.0, rollout_weight=1.0)
        for x in (iterates, padded)
    ]
    torch.testing.assert_close(losses[0]["loss"], losses[1]["loss"])


def test_one_student_step_is_fqls_distillation_of_the_teachers_chunk() -> None:
    v = _velocity()
    torch.manual_seed(1)
    iterates = torch.randn(3, 11, 2, 3)  # K_T = 10
    out = distill_losses(v, teacher_grid_points(iterates, 1), 3, map_weight=1.0, rollout_weight=1.0)
    z, chunk = iterates[:, 0], iterates[:, -1]
    expected = distillation_loss(one_step_actions(v, z), chunk)
    torch.testing.assert_close(out["loss_map"], expected)
    torch.testing.assert_close(out["loss_rollout"], expected)
    torch.testing.assert_close(out["loss"], 2 * expected)


def test_the_teacher_side_carries_no_gradient() -> None:
    w = torch.tensor(0.7, requires_grad=True)
    iterates = torch.randn(2, 5, 2, 3, requires_grad=True)
    out = distill_losses(
        lambda x, t: w * x, teacher_grid_points(iterates, 2), 3, map_weight=1.0, rollout_weight=1.0
    )
    out["loss"].backward()
    assert w.grad is not None and float(w.grad.abs()) > 0
    # only the student's inputs (z = x_0 and X_1 = x_2) reach the teacher's iterates; the chunk X_2 = x_4 is
    # only ever a target, and the iterates between the student's grid points are not read
    grad = iterates.grad
    assert grad is not None and bool(grad[:, 0].abs().sum() > 0) and bool(grad[:, 2].abs().sum() > 0)
    torch.testing.assert_close(grad[:, [1, 3, 4]], torch.zeros_like(grad[:, [1, 3, 4]]))


def test_grids_and_config_checks_name_the_field(tmp_path: Path) -> None:
    check_grids(10, 1)
    check_grids(10, 2)
    for teacher, student in [(10, 3), (10, 10), (4, 8)]:
        with pytest.raises(ValueError, match="student_steps: expected a divisor of the teacher's K"):
            check_grids(teacher, student)
    common = dict(base="b", store=tmp_path, out=tmp_path)
    for bad, message in [
        ({"student_steps": 3, "teacher_steps": 10}, "student_steps: expected a divisor"),
        ({"student_steps": 0}, "student_steps: expected a positive integer"),
        ({"fm_weight": -1.0}, "fm_weight: expected >= 0"),
        ({"pairs_per_frame": 10**6}, r"pairs_per_frame: expected 0\.\.1024"),
        ({"map_weight": 0.0, "rollout_weight": 0.0}, "map_weight: the student learns from the teacher only"),
        ({"steps": 50}, r"warmup_steps: expected fewer than steps \(50\)"),
        ({"lr": 0.0}, "lr: expected > 0"),
        ({"max_seconds": -1.0}, "max_seconds: expected a number of seconds > 0"),
        ({"dagger_rounds": -1}, r"dagger_rounds: expected 0 \(off\) \.\. steps - 1 \(1999\)"),
        ({"dagger_rounds": 3, "steps": 3, "warmup_steps": 1}, r"dagger_rounds: expected 0 \(off\)"),
        ({"dagger_episodes": 0}, "dagger_episodes: expected a positive integer"),
        ({"num_envs": 0}, "num_envs: expected a positive integer"),
        ({"online_seed": 200_000}, "online_seed: expected >= 1000000"),
        ({"dagger_rounds": 1, "fm_weight": 0.5}, "fm_weight: the on-policy episodes' actions"),
    ]:
        with pytest.raises(ValueError) as e:
            DistillConfig(**common, **bad)  # type: ignore[arg-type]
        assert e.match(message), str(e.value)
    cfg = make_config("distill", **common, student_steps=2)
    assert isinstance(cfg, DistillConfig) and cfg.algorithm == "distill" and "distill" in ALGORITHMS
    assert cfg.collection_starts() == [] and len(cfg.collection_seeds()) == 0
    cfg = DistillConfig(**common, steps=100, warmup_steps=10, dagger_rounds=3, dagger_episodes=5, num_envs=2)
    assert cfg.collection_starts() == [25, 50, 75]
    assert cfg.collection_seeds() == range(1_000_000, 1_000_021)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    store, ckpt = tiny_base(
        tmp_path_factory.mktemp("distill"), TASK, episodes=4, noise=0.5, steps=60, batch_size=32
    )
    return store.root, ckpt


@torch.no_grad()
def _gap(policy: Any, teacher: Any, obs: dict[str, Any], z: torch.Tensor, k: int | None = None) -> float:
    """Mean squared distance of ``policy``'s chunk on ``z`` (its own K, or ``k``) from the teacher's K = 10
    chunk on the same noise."""
    mine = policy.sample(obs, num_steps=k, noise=z[:, None]).actions[:, 0]
    ref = teacher.sample(obs, num_steps=10, noise=z[:, None]).actions[:, 0]
    return float((mine - ref).square().mean())


@pytest.mark.parametrize(("k", "pairs_per_frame"), [(2, 0), (1, 4)])
def test_distill_ships_an_ordinary_checkpoint_closer_to_the_teacher(
    base: tuple[Path, Path], tmp_path: Path, k: int, pairs_per_frame: int
) -> None:
    """Fresh pairs every update (K = 2) or a pool labelled once (K = 1): the student's K steps land nearer
    the teacher's ten than the parent's own K steps do, and it ships as an ordinary checkpoint."""
    store, parent = base
    cfg = make_config(
        "distill", base=str(parent), store=str(store), out=str(tmp_path / "run"), student_steps=k, steps=150,
        warmup_steps=10, batch_size=32, lr=1e-3, threads=1, progress=False, round_index=3,
        pairs_per_frame=pairs_per_frame,
    )  # fmt: skip
    res = train(cfg)
    assert res.metrics["loss_rollout"] < res.metrics["first_loss_rollout"]
    info = read_info(res.checkpoint)
    assert info.model_config["num_inference_steps"] == k
    teacher = load_policy(parent)
    assert info.lineage.algorithm == "distill" and info.lineage.parent_revision == teacher.commit
    assert info.lineage.round == 3
    assert (info.lineage.data["teacher_steps"], info.lineage.data["student_steps"]) == (10, k)
    student = load_policy(res.checkpoint)  # the ordinary loader: K from its config, nothing else
    assert student.policy.config.num_inference_steps == k
    assert json.loads((tmp_path / "run" / "curve.json").read_text())
    torch.manual_seed(7)
    c = student.policy.config
    obs = {"state": torch.randn(64, c.state_dim), "cameras": {}}
    z = torch.randn(64, c.chunk_len, c.action_dim)
    distilled, naive = (
        _gap(student.policy, teacher.policy, obs, z),
        _gap(teacher.policy, teacher.policy, obs, z, k),
    )
    assert distilled < naive


def test_on_policy_episodes_join_what_the_teacher_labels(base: tuple[Path, Path], tmp_path: Path) -> None:
    """``dagger_rounds``: the student's own episodes (its K, the online seeds) are recorded and their
    frames appended to the buffer; a pool labels them too, every frame ``pairs_per_frame`` times."""
    store, parent = base
    cfg = DistillConfig(
        base=str(parent), store=store, out=tmp_path / "run", steps=20, warmup_steps=2, batch_size=8,
        dagger_rounds=1, dagger_episodes=3, num_envs=1, pairs_per_frame=2, threads=1,
    )  # fmt: skip
    device = torch.device("cpu")
    loaded = load_base(cfg, device)
    student = trainable_copy(loaded.policy, num_inference_steps=1)
    buf = load_transitions(EpisodeStore(store), Selection.parse(None, task=TASK), cameras=False)
    demo_frames = len(buf)
    pairs = TeacherPairs(loaded.policy, buf, PolicyInputs(student, buf, device), cfg, 10)
    assert pairs.pool_rows is not None and len(pairs.pool_rows) == 2 * demo_frames
    frames = OnPolicyFrames(cfg, loaded, TASK, buf)
    try:
        frames.collect(student)
    finally:
        frames.close()
    assert len(frames.episode_ids) == 3 and len(frames.success) == 1 and len(buf) > demo_frames
    recorded = EpisodeStore(tmp_path / "run" / "dagger_store")
    for e in frames.episode_ids:
        ep = recorded.read_episode(e, cameras=False)
        assert ep.length > 0 and (
            ep.meta.episode_seed is None or ep.meta.episode_seed in cfg.collection_seeds()
        )
    pairs.frames_added(PolicyInputs(student, buf, device))
    assert pairs.pool_points is not None and len(pairs.pool_points) == len(pairs.pool_rows) == 2 * len(buf)
    assert sorted(set(pairs.pool_rows.tolist())) == list(range(len(buf)))
    batch, points = pairs(0)
    assert batch["state"].shape[0] == 8 and points.shape == (8, 2, *student.event_shape)


def test_distill_with_on_policy_episodes_records_them(base: tuple[Path, Path], tmp_path: Path) -> None:
    store, parent = base
    res = train(
        make_config(
            "distill", base=str(parent), store=str(store), out=str(tmp_path / "run"), student_steps=1,
            steps=30, warmup_steps=2, batch_size=16, threads=1, progress=False, dagger_rounds=2,
            dagger_episodes=2, num_envs=1,
        )
    )  # fmt: skip
    assert res.metrics["dagger_episodes"] == 4 and len(res.metrics["dagger_success"]) == 2
    assert read_info(res.checkpoint).lineage.data["dagger_episodes"] == 4
    assert len(EpisodeStore(tmp_path / "run" / "dagger_store").episode_ids()) == 4

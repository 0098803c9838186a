"""The training loop every trainer runs (vla_rl/train/loop.py): its pieces against hand computations.

The trainers' own tests (and the resume tests of SFT, AWR, QAM, awr-pi and tests/test_distributed.py)
check the loop inside real runs; these pin each piece down on its own: what one gradient step clips and
steps, that every update is reseeded from (seed, step) so a resumed loop replays an uninterrupted one,
when logs and checkpoints fall, the train state's round trip, and the online iteration loop's stops."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from vla_rl.train.common import RunClock, load_train_state
from vla_rl.train.distributed import SINGLE
from vla_rl.train.loop import (
    Beat,
    IterationLoop,
    Optimiser,
    TrainLog,
    TrainState,
    UpdateLoop,
    fit_minibatches,
    gradient_step,
    publish_last,
    time_budget,
    warmup_cosine_schedule,
)
from vla_rl.train.sft import SFTConfig

torch.set_num_threads(1)


def _two_modules() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(3, 2), nn.Linear(3, 1)


def test_gradient_step_clips_each_group_on_its_own_and_steps_only_what_is_asked() -> None:
    a, b = _two_modules()
    a_before = [p.detach().clone() for p in a.parameters()]
    b_before = [p.detach().clone() for p in b.parameters()]
    opt_a = Optimiser(torch.optim.SGD(a.parameters(), lr=1.0), {"a": list(a.parameters())}, clip=0.5)
    opt_b = Optimiser(torch.optim.SGD(b.parameters(), lr=1.0), {"b": list(b.parameters())}, clip=1e6)
    x = torch.randn(8, 3)
    loss = 100.0 * a(x).square().mean() + b(x).square().mean()
    # the expected gradients, by hand: autograd on a copy of the same loss
    ga = torch.autograd.grad(100.0 * a(x).square().mean(), list(a.parameters()))
    gb = torch.autograd.grad(b(x).square().mean(), list(b.parameters()))
    norm_a = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in ga])))
    norm_b = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in gb])))

    norms = gradient_step(loss, [opt_a, opt_b], SINGLE, stepping=[True, False])

    assert norms == pytest.approx({"a": norm_a, "b": norm_b}, rel=1e-5)
    assert norm_a > 0.5  # a's gradient was clipped to norm 0.5, b's large clip left b's alone
    for p, p0, g in zip(a.parameters(), a_before, ga, strict=True):
        torch.testing.assert_close(p.detach(), p0 - g * (0.5 / norm_a), rtol=1e-4, atol=1e-6)
    for p, p0 in zip(b.parameters(), b_before, strict=True):
        assert torch.equal(p.detach(), p0)  # not stepped


def test_gradient_step_steps_the_schedule_with_its_optimiser() -> None:
    a, _ = _two_modules()
    sgd = torch.optim.SGD(a.parameters(), lr=1.0)
    opt = Optimiser(
        sgd, {"a": list(a.parameters())}, clip=1.0, scheduler=warmup_cosine_schedule(sgd, 4, 10, 0.1)
    )
    lrs = []
    for _ in range(3):
        lrs.append(sgd.param_groups[0]["lr"])
        gradient_step(a(torch.randn(2, 3)).sum(), [opt], SINGLE)
    assert lrs == pytest.approx([0.25, 0.5, 0.75])  # linear warm-up over 4 updates


def test_an_optimiser_needs_a_positive_clip() -> None:
    a, _ = _two_modules()
    with pytest.raises(ValueError, match="clip: expected"):
        Optimiser(torch.optim.SGD(a.parameters(), lr=1.0), {"a": list(a.parameters())}, clip=0.0)


def test_beat() -> None:
    assert [s for s in range(1, 12) if Beat(4, also=11)(s)] == [4, 8, 11]
    assert not any(Beat()(s) for s in range(1, 12))
    assert [s for s in range(1, 12) if Beat(also=7)(s)] == [7]


def _draws(seed: int, start: int, end: int, **loop_kw: object) -> tuple[list[float], UpdateLoop]:
    """Each update's first torch draw, from a loop over [start, end)."""
    draws: list[float] = []

    def update(step: int) -> dict[str, float]:
        draws.append(float(torch.rand(())))
        return {"x": float(step), "t": torch.tensor(2.0 * step)}

    loop = UpdateLoop(update, seed=seed, dist=SINGLE, step=start, **loop_kw)  # type: ignore[arg-type]
    loop.run(end)
    return draws, loop


def test_every_update_is_reseeded_so_a_resumed_loop_replays_an_uninterrupted_one() -> None:
    whole, loop = _draws(7, 0, 6)
    first, _ = _draws(7, 0, 2)
    torch.manual_seed(123)  # whatever ran in between (a restart, an evaluation) does not matter
    torch.rand(5)
    rest, _ = _draws(7, 2, 6)
    assert first + rest == whole
    assert len(set(whole)) == 6  # each step its own draws
    assert _draws(8, 0, 6)[0] != whole  # and the run's seed matters
    assert loop.step == 6 and loop.metrics == {"x": 5.0, "t": 10.0} and loop.first == {"x": 0.0, "t": 0.0}


def test_logs_and_checkpoints_fall_on_their_beats_and_keep_going_stops_the_loop() -> None:
    logged: list[tuple[int, float]] = []
    saved: list[int] = []
    _draws(
        0,
        0,
        10,
        log=Beat(3, also=10),
        on_log=lambda step, m: logged.append((step, m["x"])),
        checkpoint=Beat(4),
        on_checkpoint=saved.append,
    )
    assert logged == [(3, 2.0), (6, 5.0), (9, 8.0), (10, 9.0)] and saved == [4, 8]
    budget = iter([True, True, True, False])
    stopped = UpdateLoop(lambda step: {}, seed=0, dist=SINGLE)
    assert stopped.run(10, keep_going=lambda: next(budget)) == 3


def test_time_budget() -> None:
    clock = RunClock()
    assert time_budget(clock, None, SINGLE)()
    assert time_budget(clock, 3600.0, SINGLE)()
    assert not time_budget(clock, 1e-9, SINGLE)()


def test_train_state_round_trip(tmp_path: Path) -> None:
    a, _ = _two_modules()
    b = nn.Linear(3, 2)  # another model of the same shape, other weights
    clock = RunClock()
    clock.before = 100.0
    state = TrainState(tmp_path, clock, {"a": a, "missing": None})
    assert state.read(resume=True) is None  # nothing saved yet
    state.save(step=5, note="x")
    saved = load_train_state(tmp_path / "train_state.pt")
    assert (
        saved["step"] == 5 and saved["note"] == "x" and saved["missing"] == {} and saved["seconds"] >= 100.0
    )
    assert state.read(resume=False) is None  # a run that does not resume starts over

    fresh_clock = RunClock()
    other = TrainState(tmp_path, fresh_clock, {"a": b, "missing": None})
    st = other.load(resume=True)
    assert st is not None and st["step"] == 5
    assert fresh_clock.before == pytest.approx(saved["seconds"])  # the run's wall time carries on
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fit_minibatches_steps_and_returns_every_loss() -> None:
    a, _ = _two_modules()
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    x = torch.randn(16, 3)
    losses = fit_minibatches(opt, lambda: a(x).square().mean(), 20)
    assert len(losses) == 20 and losses[-1] < losses[0]


def test_publish_last_replaces_the_previous_last(tmp_path: Path) -> None:
    for step in (1, 2):
        ckpt = tmp_path / "checkpoints" / f"step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / f"w{step}").write_text("x")
        last = publish_last(ckpt)
    assert last == tmp_path / "checkpoints" / "last" and sorted(p.name for p in last.iterdir()) == ["w2"]


def _iterations(
    tmp_path: Path, stop_after: int | None = None, **kw: object
) -> tuple[IterationLoop, list[int], list[int]]:
    """An IterationLoop whose iterations each collect 10 env steps (``stop_after``: the iteration that
    calls :meth:`IterationLoop.stop`)."""
    cfg = SFTConfig(store=tmp_path, out=tmp_path / "out", progress=False)
    tlog = TrainLog(cfg, SINGLE, purge_step=None, config_step=None, finite_only=True)
    snapshots: list[int] = []
    ends: list[int] = []
    values: dict[str, object] = dict(
        budget=25, checkpoint_every=2, on_checkpoint=snapshots.append, on_iteration=ends.append
    )
    values.update(kw)
    loop = IterationLoop("test", "test", tlog, RunClock(), **values)  # type: ignore[arg-type]

    def iterate() -> dict[str, object]:
        loop.collected(10)
        if loop.iteration + 1 == stop_after:
            loop.stop()
        return {"iteration": loop.iteration, "env_steps": loop.env_steps, "loss": float("nan")}

    loop.run(iterate)
    tlog.close()
    return loop, snapshots, ends


def test_the_iteration_loop_spends_its_budget_and_snapshots_on_its_beat(tmp_path: Path) -> None:
    loop, snapshots, ends = _iterations(tmp_path)
    assert loop.iteration == 3 and loop.env_steps == 30 and not loop.stopped_by_time
    assert [r["env_steps"] for r in loop.log.curve] == [10, 20, 30]
    assert all(r["seconds"] >= 0 for r in loop.log.curve)
    assert snapshots == [2] and ends == [1, 2, 3]


def test_the_iteration_loop_stops_at_stop_at_a_time_budget_and_when_told(tmp_path: Path) -> None:
    loop, _, _ = _iterations(tmp_path / "a", stop_at=2)
    assert loop.iteration == 2
    loop, _, ends = _iterations(tmp_path / "b", max_minutes=1e-9)
    assert loop.iteration == 0 and loop.stopped_by_time and ends == []
    loop, _, ends = _iterations(tmp_path / "c", stop_after=1)
    assert loop.iteration == 1 and ends == [1]  # the stopping iteration still finishes
    assert math.isnan(loop.log.curve[0]["loss"])  # NaNs stay in the curve (not in TensorBoard)

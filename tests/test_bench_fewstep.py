"""bench/fewstep.py's paired difference of a student against its parent, on hand-made outcomes (the slow
bench itself is not run), its variants' knobs, and the chunk gap on a tiny base."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from tiny_base import tiny_base

from bench.fewstep import (
    DISTILL,
    chunk_gaps,
    eval_path,
    gap_stores,
    paired_difference,
    pooled,
    student_tag,
    variants,
)


def test_paired_difference_in_points_with_its_interval_and_discordant_counts() -> None:
    parent = {str(s): s < 8 for s in range(10)}  # 80%
    student = {str(s): s < 8 for s in range(10)}
    student["0"], student["9"], student["1"] = False, True, False  # parent-only 0 and 1, student-only 9: 70%
    d = paired_difference(student, parent)
    assert d["points"] == pytest.approx(-10.0)
    assert (d["student_only"], d["parent_only"]) == (1, 2)
    diffs = [-1.0, -1.0, 1.0] + [0.0] * 7
    mean = sum(diffs) / 10
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 9)
    lo, hi = d["ci95_points"]
    assert lo == pytest.approx(100 * (mean - 1.96 * sd / math.sqrt(10)))
    assert hi == pytest.approx(100 * (mean + 1.96 * sd / math.sqrt(10)))
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference({"1": True}, {"2": True})


def test_variants_lay_their_knobs_over_the_plain_students() -> None:
    args = argparse.Namespace(
        distill={"steps": 1200, "pairs_per_frame": 0}, variant=['dagger={"dagger_rounds": 2, "steps": 900}']
    )
    out = variants(args)
    assert list(out) == ["", "dagger"]
    assert out[""] == DISTILL | {"steps": 1200, "pairs_per_frame": 0}
    assert out["dagger"] == out[""] | {"dagger_rounds": 2, "steps": 900}
    assert (student_tag(1, ""), student_tag(2, "dagger")) == ("K=1", "K=2 dagger")
    with pytest.raises(SystemExit, match="expected NAME=JSON"):
        variants(argparse.Namespace(distill={}, variant=['{"steps": 5}']))


def test_chunk_gaps_measure_the_distance_from_the_parents_chunk(tmp_path: Path) -> None:
    task = "kinematic/Reach-v0"
    store, ckpt = tiny_base(tmp_path, task, episodes=2, noise=0.5, steps=10, batch_size=16)
    stores = gap_stores(tmp_path, {"same": ckpt})
    assert stores == {"demos": tmp_path / "store"}
    (ckpt.parents[1] / "dagger_store").mkdir()
    assert gap_stores(tmp_path, {"same": ckpt})["same's own episodes"] == ckpt.parents[1] / "dagger_store"
    gaps = chunk_gaps(ckpt, {"same": ckpt}, {"demos": store.root}, task, frames=64)
    assert gaps["demos"]["frames"] > 0
    assert gaps["demos"]["same"] == pytest.approx(0.0, abs=1e-12)  # the parent is its own K-step chunk
    assert gaps["demos"]["parent K=1"] > 1e-4  # one Euler step is not ten


def test_pooled_evaluations_pair_every_seed_of_the_runs(tmp_path: Path) -> None:
    outcomes = {  # (first seed, episodes) -> tag -> per-seed outcomes
        (10, 2): {"parent": {"10": True, "11": False}, "K=1": {"10": True, "11": True}},
        (20, 2): {"parent": {"20": True, "21": True}, "K=1": {"20": False, "21": True}},
    }
    for (seed, n), per_tag in outcomes.items():
        for tag, per_seed in per_tag.items():
            eval_path(tmp_path, tag, seed, n).write_text(json.dumps({"per_seed": per_seed}))
    parent, student = pooled(tmp_path, ["parent", "K=1"], [(10, 2), (20, 2)])
    assert (parent["episodes"], parent["success"], student["success"]) == (4, 0.75, 0.75)
    assert student["vs_parent"]["points"] == pytest.approx(0.0)
    assert (student["vs_parent"]["student_only"], student["vs_parent"]["parent_only"]) == (1, 1)
    assert parent["ci95"][0] < 0.75 < parent["ci95"][1]
    with pytest.raises(ValueError, match="overlap"):
        pooled(tmp_path, ["parent"], [(10, 2), (10, 2)])

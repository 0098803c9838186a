"""A round that fits the learned failure predictor (``RoundOptions.failure_predictor``) end to end on a
tiny fleet: a Hub registry with a tiny Reach base at ``prod``, a policy server following ``prod`` on
loopback gRPC, a collector and a store the simulated fleet (operator takeovers) recorded through them.
The round trains, is promoted, fits the predictor for its candidate on the fleet's episodes, pushes it
inside ``round-N`` with its lineage, and the following server swaps to it and returns its score with
every chunk (the same number the pulled artefact gives locally), where it returned none before."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from dashboard_world import FleetWorld, record_fleet, serve_prod, start_registry, stop_world
from tiny_base import tiny_base
from vla_rl_client.policy_client import PolicyClient

from fleet.collector import Collector, CollectorConfig
from fleet.db import MetadataDB
from policies.failure import FAILURE_DIR, policy_weights_sha256
from policies.loading import load_policy
from server.slots import ServedVersion
from sim.operator import OperatorRules
from vla_rl.hub.registry import pull, push_folder, resolve
from vla_rl.rounds import (
    RoundConfig,
    config_from_json,
    config_to_json,
    fit_round_predictor,
    start_round,
)
from vla_rl.train.algorithms import make_config

torch.set_num_threads(1)
TASK = "kinematic/Reach-v0"
REPO = "fleet/reach-failure"
HUB_TOKEN = "hub-token-for-failure-rounds"
COLLECTOR_TOKEN = "collector-token-for-failure-rounds"
ATOL = 1e-5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetWorld]:
    """Hub with a tiny SFT base at prod (24 scripted demos, 200 updates), a server that follows prod,
    and 2 x 12 sim-fleet episodes with spot-check takeovers recorded through the collector. The tiny base
    rarely succeeds alone, so the clean successes that calibrate the alarm are mostly the demos (half the
    store): the 14-episode calibration split holds the 2 that alpha 0.4 needs all but
    never short."""
    root = tmp_path_factory.mktemp("round-failure")
    hub = start_registry(root, HUB_TOKEN)
    store, base = tiny_base(root, TASK, episodes=24, noise=0.3, steps=200, batch_size=32)
    push_folder(base, REPO, message="base", tag="prod")
    server = serve_prod(REPO, follow="self", follow_interval=0.2)
    collector = Collector(
        CollectorConfig(store=store.root, port=0, chunk_len=16), token=COLLECTOR_TOKEN
    ).start()
    w = FleetWorld(root, store.root, hub, server, collector, resolve(f"hub://{REPO}@prod"))
    try:
        rules = OperatorRules(
            stall_steps=0, drift_radius=0.0, spot_check_prob=0.05, drive_steps=4, max_takeovers=1
        )
        record_fleet(w, 2, 12, rules, COLLECTOR_TOKEN)
        yield w
    finally:
        stop_world(w)


def _act(address: str, state_dim: int) -> tuple[float, bool, float, str]:
    """One chunk for a fixed observation: (failure score, alarm, accel, commit)."""
    obs = {"state": np.linspace(-0.5, 0.5, state_dim).astype(np.float32), "cameras": {}}
    with PolicyClient(address, timeout_s=30, model_id="reach") as c:
        r = c.act(obs, seed=3)
    return r.failure, r.failure_alarm, r.uncertainty, r.commit


def test_a_round_fits_ships_and_serves_the_failure_predictor(fleet: FleetWorld, tmp_path: Path) -> None:
    w = fleet
    db = MetadataDB.for_store(w.store)
    state_dim = load_policy(pull(f"hub://{REPO}@prod").path, device="cpu").spec.state_dim
    before, alarm, _, commit = _act(w.server.address, state_dim)
    assert np.isnan(before) and not alarm and commit == w.base_commit  # prod serves no predictor yet

    train = make_config(
        "awr", base=f"hub://{REPO}@prod", store=w.store, out=tmp_path, progress=False,
        value_steps=20, steps=20, batch_size=32,
    )  # fmt: skip
    cfg = RoundConfig(
        train=train, eval_episodes=4, eval_envs=1, report_episodes=0, margin=-0.99, gate_alpha=1.0,
        failure_predictor=True, failure_steps=100, failure_alpha=0.4,
    )  # fmt: skip
    rec = start_round(cfg, db=db)
    fit = rec.metrics["failure_predictor"]
    assert rec.status == "succeeded" and rec.promoted, rec.metrics["gate"]
    assert fit["fitted"], fit
    assert fit["positive_rows"] > 0 and fit["rows"] > fit["positive_rows"] and 0 < fit["threshold"] <= 1

    # shipped: inside the pushed round-N, tied to its weights, with the round in its lineage
    pulled = Path(pull(rec.checkpoint_ref).path)
    meta = json.loads((pulled / FAILURE_DIR / "failure.json").read_text())
    assert meta["threshold"] == pytest.approx(fit["threshold"]) and meta["alpha"] == 0.4
    assert meta["lineage"]["policy_weights_sha256"] == policy_weights_sha256(pulled)
    assert meta["lineage"]["round"] == rec.id and meta["lineage"]["summary"]["rows"] == fit["rows"]
    assert meta["head"]["hidden"] == [16]
    assert not (Path(pull(f"hub://{REPO}@{w.base_commit}").path) / FAILURE_DIR).exists()

    # loaded: the server that follows prod swaps to round-N and scores every chunk with its predictor
    deadline = time.monotonic() + 60
    while (got := _act(w.server.address, state_dim))[3] != rec.checkpoint_revision:
        assert time.monotonic() < deadline, "the following server did not swap to the promoted round"
        time.sleep(0.2)
    score, alarm, accel, _ = got
    local = ServedVersion(load_policy(pulled, device="cpu"))
    assert local.failure is not None and local.failure.threshold == pytest.approx(fit["threshold"])
    obs_state = np.linspace(-0.5, 0.5, state_dim).astype(np.float32)[None]
    feats = local.model.features(obs_state, {}, [local.spec.instruction])  # type: ignore[attr-defined]
    want = float(local.failure.score(feats, np.array([accel]))[0])
    assert np.isfinite(score) and score == pytest.approx(want, abs=ATOL)
    assert alarm == (want > local.failure.threshold)


def test_a_fleet_that_cannot_calibrate_one_gets_the_round_without_it(
    fleet: FleetWorld, tmp_path: Path
) -> None:
    """alpha 0.01 needs 99 held-out clean successes: the fit says so and writes nothing."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pull(f"hub://{REPO}@{fleet.base_commit}").path, ckpt)
    train = make_config("awr", base=str(ckpt), store=fleet.store, out=tmp_path, progress=False)
    cfg = RoundConfig(train=train, push=False, failure_predictor=True, failure_alpha=0.01)
    got = fit_round_predictor(cfg, dataclasses.replace(train, task=TASK), ckpt)
    assert got["fitted"] is False and "needs at least 99" in got["error"]
    assert not (ckpt / FAILURE_DIR).exists()


def test_the_round_options_name_a_bad_predictor_setting(tmp_path: Path) -> None:
    train = make_config("awr", base="hub://org/arm@prod", store=tmp_path, out=tmp_path, progress=False)
    for field, value, said in (
        ("failure_alpha", 1.5, "failure_alpha: expected"),
        ("failure_steps", 0, "failure_steps: expected"),
        ("failure_hidden", (0,), "failure_hidden: expected"),
    ):
        with pytest.raises(ValueError, match=said):
            RoundConfig(train=train, push=False, **{field: value})  # type: ignore[arg-type]
    # a queued round's row carries the options to the worker that runs it (JSON: the widths as a list)
    cfg = RoundConfig(train=train, failure_predictor=True, failure_hidden=(8, 4), failure_alpha=0.1)
    back = config_from_json(json.loads(json.dumps(config_to_json(cfg))))
    assert (back.failure_predictor, back.failure_hidden, back.failure_alpha) == (True, (8, 4), 0.1)


def test_up_passes_the_failure_predictor_knob_to_its_rounds(tmp_path: Path) -> None:
    from vla_rl.up.config import UpConfig
    from vla_rl.up.loop import _round_config

    for on in (False, True):
        cfg = UpConfig(failure_predictor=on, workdir=tmp_path)
        rc = _round_config(cfg, 1, "hub://up/policy@prod", tmp_path / "s", tmp_path, "sqlite:///x.db", None)
        assert rc.failure_predictor is on

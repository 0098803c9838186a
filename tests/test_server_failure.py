"""The failure predictor served next to ``accel`` (server/slots.py, policies/failure.py): a real server on
loopback hosting a tiny FlowVLA checkpoint whose folder holds a ``failure/`` artefact replies to every
chunk with the predictor's score (the same number as scoring the request's features and accel here) and
its alarm; a checkpoint without one replies with the field unset; an artefact fit on other weights is
not served (the policy still is), saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from test_server import SPEC, make_checkpoint, make_obs, start_server
from vla_rl_client.policy_client import PolicyClient, build_request
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc

from policies.failure import (
    FAILURE_DIR,
    FailureHead,
    FailureHeadConfig,
    FailurePredictor,
    failure_lineage,
    policy_weights_sha256,
)
from policies.loading import load_policy
from server.slots import ServedVersion
from server.stage_timing import timed_prefix

torch.set_num_threads(1)
ATOL = 1e-5


def _with_predictor(folder: Path, threshold: float = 0.5) -> FailurePredictor:
    """A randomly initialised head over the checkpoint's 32 features, saved into ``folder/failure``."""
    torch.manual_seed(7)
    head = FailureHead(FailureHeadConfig(feature_dim=32, hidden=(8,)))
    lineage = failure_lineage(
        policy_ref=str(folder), policy_commit="local", policy_weights=policy_weights_sha256(folder)
    )
    pred = FailurePredictor(head, threshold, 0.05, lineage)
    pred.save(folder / FAILURE_DIR)
    return pred


def _local_score(version: ServedVersion, pred: FailurePredictor, obs: dict, uncertainty: float) -> float:
    cams = {k: v[None] for k, v in obs["cameras"].items()}
    feats = version.model.features(obs["state"][None], cams, [SPEC.instruction])  # type: ignore[attr-defined]
    return float(pred.score(feats, np.array([uncertainty]))[0])


def test_every_chunk_carries_the_failure_score_and_alarm(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "a", 0)
    plain = make_checkpoint(tmp_path / "b", 1)
    rng = np.random.default_rng(3)
    work = [(make_obs(rng), int(rng.integers(1 << 31))) for _ in range(8)]
    local = ServedVersion(load_policy(folder, device="cpu"))
    pred = _with_predictor(folder)
    # the threshold between the requests' scores, so that some alarm and some do not
    acc = [
        local.infer_scored(
            o["state"][None],
            {k: v[None] for k, v in o["cameras"].items()},
            [SPEC.instruction],
            local.initial_noise(s)[None],
        )[1][0]
        for o, s in work
    ]
    want = [_local_score(local, pred, o, u) for (o, _), u in zip(work, acc, strict=True)]
    pred = _with_predictor(folder, threshold=float(np.median(want)))
    srv = start_server({"arm": folder, "plain": plain}, max_batch=4, max_wait_us=2000)
    try:
        with PolicyClient(srv.address, timeout_s=30, model_id="arm") as c:
            got = [c.act(o, seed=s) for o, s in work[:4]]
            with c.stream() as st:
                got += [st.act(o, seed=s) for o, s in work[4:]]
        with PolicyClient(srv.address, timeout_s=30, model_id="plain") as c:
            bare = c.act(work[0][0], seed=work[0][1])
        with grpc.insecure_channel(srv.address) as channel:
            raw = pb_grpc.PolicyServiceStub(channel).Act(
                build_request(work[0][0], model_id="plain", seed=1), timeout=30
            )
    finally:
        srv.stop()
    for r, w, u in zip(got, want, acc, strict=True):
        np.testing.assert_allclose(r.uncertainty, u, atol=ATOL)
        np.testing.assert_allclose(r.failure, w, atol=ATOL)
        assert r.failure_alarm == (w > pred.threshold)
    assert 0 < sum(r.failure_alarm for r in got) < len(got)
    assert np.isnan(bare.failure) and not bare.failure_alarm and np.isfinite(bare.uncertainty)
    assert not raw.HasField("failure") and raw.HasField("uncertainty")


def test_an_artefact_fit_on_other_weights_is_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = make_checkpoint(tmp_path / "a", 0)
    other = make_checkpoint(tmp_path / "other", 5)
    _with_predictor(other)
    shutil.copytree(other / FAILURE_DIR, folder / FAILURE_DIR)
    version = ServedVersion(load_policy(folder, device="cpu"))
    assert version.failure is None and "other policy weights" in version.failure_note
    assert "other policy weights" in caplog.text
    # a head of the wrong width for these features: named, not served
    meta_path = other / FAILURE_DIR / "failure.json"
    torch.manual_seed(0)
    FailurePredictor(FailureHead(FailureHeadConfig(feature_dim=16)), 0.5, 0.05, {}).save(folder / FAILURE_DIR)
    version = ServedVersion(load_policy(folder, device="cpu"))
    assert version.failure is None and version.failure_note.endswith("the policy gives 32")
    assert json.loads(meta_path.read_text())["lineage"]["policy_weights_sha256"] == policy_weights_sha256(
        other
    )
    srv = start_server({"arm": folder})
    try:
        with PolicyClient(srv.address, timeout_s=30) as c:
            r = c.act(make_obs(np.random.default_rng(0)), seed=1)
    finally:
        srv.stop()
    assert r.actions.shape[0] > 0 and np.isnan(r.failure) and not r.failure_alarm


def test_the_score_reuses_the_forward_prefix(tmp_path: Path) -> None:
    """The batcher scores failure from the prefix the forward encoded (one prefix pass per batch, not two),
    and that score equals the one from a fresh pass."""
    folder = make_checkpoint(tmp_path / "a", 0)
    _with_predictor(folder)
    version = ServedVersion(load_policy(folder, device="cpu"))
    rng = np.random.default_rng(4)
    obs = [make_obs(rng) for _ in range(3)]
    states = np.stack([o["state"] for o in obs])
    cams = {k: np.stack([o["cameras"][k] for o in obs]) for k in obs[0]["cameras"]}
    instructions = [SPEC.instruction] * 3
    noise = np.stack([version.initial_noise(s) for s in (1, 2, 3)])
    with timed_prefix(version.model) as clock:
        _, scores = version.infer_scored(states, cams, instructions, noise)
        prefix = clock.sole_prefix()
        reused = version.failure_scores(states, cams, instructions, scores, prefix)
    assert prefix is not None and clock.calls == 1
    fresh = version.failure_scores(states, cams, instructions, scores)
    assert reused is not None and fresh is not None
    np.testing.assert_allclose(reused[0], fresh[0], atol=ATOL)
    np.testing.assert_array_equal(reused[1], fresh[1])

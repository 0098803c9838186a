"""The dashboard over an ``s3://`` episode store: moto's S3 server on 127.0.0.1 (the fixtures of
tests/test_s3_store.py), a SQLite metadata DB given with ``db`` (an object store has no file beside
it), the real app under uvicorn. The episode list, an episode's detail and its JPEG frames (read from
the Zarr arrays on S3), and labelling (an episode label and a span) work as on a local store.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from dashboard_world import Dashboard, serve_dashboard
from PIL import Image
from test_s3_store import new_bucket, s3, server  # noqa: F401  (moto S3 fixtures)
from test_store import SPEC, TASK, make_frames

from bench.store_s3 import MotoS3
from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from vla_rl.cli import main
from vla_rl.dashboard import DashboardConfig

LENGTH = 12


def smooth_frames(seed: int) -> dict:
    """make_frames with camera images that survive JPEG: a gradient plus a per-frame brightness."""
    frames = make_frames(LENGTH, seed)
    for name, arr in frames["cameras"].items():
        h, w = arr.shape[1:3]
        ramp = np.add.outer(np.arange(h) * 3, np.arange(w) * 2)[None, :, :, None]
        level = (np.arange(LENGTH) * 10 + seed * 20 + (name == "hand_camera") * 40)[:, None, None, None]
        frames["cameras"][name] = np.clip(ramp + level + np.array([0, 30, 60]), 0, 255).astype(np.uint8)
    return frames


def test_dashboard_on_an_s3_store_lists_shows_frames_and_labels(
    s3: MotoS3,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"s3://{new_bucket(s3)}/fleet/store"
    db_url = f"sqlite:///{tmp_path / 'meta.db'}"
    store = EpisodeStore(url, create=True, db=MetadataDB(db_url))
    sent = {}
    for seed, outcome in ((1, "success"), (2, "failure")):
        frames = smooth_frames(seed)
        # chunk_len > LENGTH: one chunk an array, fewer S3 PUTs
        with store.create_episode(SPEC, robot_id=f"arm-{seed}", task=TASK, chunk_len=16) as w:
            w.add_frames(frames)
            meta = w.close(outcome)
        sent[meta.episode_id] = frames

    # an object store has no SQLite file beside it: the DB must be named (a clear error, CLI exit 2)
    with pytest.raises(ValueError, match=r"^db: .*--db"):
        DashboardConfig(store=url)
    assert main(["dashboard", "--store", url, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--db" in err and url in err and "Traceback" not in err

    cfg = DashboardConfig(store=url, db=db_url, workdir=tmp_path / "dash", sync_db=False)
    assert cfg.store == url  # the URL is kept as text (a Path would collapse s3:// to s3:/)
    dash: Dashboard
    for dash in serve_dashboard(cfg):
        anon, viewer, ana = dash.client(None), dash.client("viewer"), dash.client("labeller")
        health = anon.get("/api/v1/health").json()
        assert health["store"] == {"ok": True, "error": None, "path": url} and health["db"]["ok"], health

        listed = viewer.get("/api/v1/episodes", params={"sort": "robot_id"}).json()
        assert listed["total"] == 2 and {e["id"] for e in listed["items"]} == set(sent)
        assert [(e["robot_id"], e["outcome"], e["length"]) for e in listed["items"]] == [
            ("arm-1", "success", LENGTH),
            ("arm-2", "failure", LENGTH),
        ]
        eid = listed["items"][0]["id"]
        detail = viewer.get(f"/api/v1/episodes/{eid}").json()
        assert detail["length"] == LENGTH and [c["name"] for c in detail["cameras"]] == [
            c.name for c in SPEC.cameras
        ]

        for camera, t in (("base_camera", 0), ("hand_camera", 9)):
            r = viewer.get(f"/api/v1/episodes/{eid}/frames/{camera}/{t}.jpg", params={"quality": 95})
            assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg", r.text
            got = np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB"), dtype=np.float32)
            want = sent[eid]["cameras"][camera][t].astype(np.float32)
            assert got.shape == want.shape and np.abs(got - want).mean() < 4.0
        r = viewer.get(f"/api/v1/episodes/{eid}/frames/base_camera/{LENGTH}.jpg")
        assert r.status_code == 404 and r.json()["detail"]["field"] == "t"

        r = ana.post("/api/v1/labels", json={"episode_ids": [eid], "key": "quality", "value": "good"})
        assert r.status_code == 201, r.text
        r = ana.post(
            "/api/v1/labels",
            json={"episode_ids": [eid], "key": "segment", "value": "idle", "start": 2, "end": 6},
        )
        assert r.status_code == 201, r.text
        detail = viewer.get(f"/api/v1/episodes/{eid}").json()
        assert detail["labels"]["quality"] == "good"
        assert [(s["value"], s["start"], s["end"], s["author"]) for s in detail["spans"]] == [
            ("idle", 2, 6, "ana")
        ]
        filtered = viewer.get("/api/v1/episodes", params={"label": "quality:good"}).json()
        assert [e["id"] for e in filtered["items"]] == [eid]
    labels = MetadataDB(db_url).labels(eid)
    assert {(x.key, x.value, x.author) for x in labels} == {
        ("quality", "good", "ana"),
        ("segment", "idle", "ana"),
    }

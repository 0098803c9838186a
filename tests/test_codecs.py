"""Camera codecs of the episode store (fleet/codecs.py): JPEG per frame in a Zarr v3 codec, lossless zstd.

Real Zarr arrays and stores in tmp_path, a real collector (gRPC on loopback, its store writer process),
the real CLI entry point for bad values. Frames are smooth synthetic camera frames (gradient + moving
boxes, as rendered scenes), where JPEG is near-lossless and much smaller than zstd.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from vla_rl_client.spec import CameraSpec, RobotSpec

from fleet.codecs import (
    CameraCodec,
    CameraCodecs,
    CodecError,
    JpegCodec,
    array_codec,
    encode_jpeg,
    stored_jpeg,
    unpack,
)
from fleet.dataset import ChunkDataset
from fleet.store import EpisodeStore
from sim.synthetic_robot import smooth_image_pool
from vla_rl.cli import main

REPO = Path(__file__).resolve().parents[1]
SPEC = RobotSpec("arm", 4, 2, 30.0, "push", (CameraSpec("front", 48, 64), CameraSpec("wrist", 48, 64)))
PSNR_Q85 = (
    28.0  # dB at quality 85 on these small frames with saturated box edges (4:2:0 chroma; ~30.6 measured)
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """10 log10(255^2 / MSE) over all pixels."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def frames(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {c.name: smooth_image_pool(n, c.height, c.width, seed + k) for k, c in enumerate(SPEC.cameras)}


def batch(cams: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, object]:
    k = hi - lo
    return {
        "cameras": {c: a[lo:hi] for c, a in cams.items()},
        "state": np.full((k, 4), lo, np.float32),
        "action": np.zeros((k, 2), np.float32),
    }


def test_parse_codec_choices() -> None:
    c = CameraCodecs.parse("lossless,wrist=jpeg:80")
    assert c.of("front") == CameraCodec("lossless") and c.of("wrist") == CameraCodec("jpeg", 80)
    assert str(CameraCodecs.parse("jpeg")) == "jpeg:90" and CameraCodecs.parse(None).lossless
    assert CameraCodecs.parse("jpeg:70,x=lossless").restrict(["front"]).per_camera == ()
    for bad, words in (
        ("webp", "expected lossless, jpeg or jpeg:QUALITY, got 'webp'"),
        ("jpeg:0", "quality must be an integer 1..100, got 0"),
        ("jpeg:high", "got 'high'"),
        ("jpeg,lossless", "more than one default"),
        ("wrist=jpeg,wrist=lossless", "camera 'wrist' given twice"),
        ("=jpeg", "CAMERA=CODEC"),
        ("", "expected e.g."),
    ):
        with pytest.raises(CodecError, match=r"^--camera-codec: ") as e:
            CameraCodecs.parse(bad)
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CodecError, match="no camera 'hand'"):
        CameraCodecs.parse("hand=jpeg").check(SPEC.camera_names)


def test_jpeg_zarr_array_round_trip_partial_last_chunk(tmp_path: Path) -> None:
    """A plain zarr array with our codec: shape and dtype exact, PSNR bounded, the last chunk partial, and
    the rows past the end stored as empty entries; a fresh interpreter opens it once fleet.codecs is in."""
    x = frames(21)["front"]
    path = tmp_path / "a.zarr"
    arr = zarr.create_array(
        path,
        shape=x.shape,
        chunks=(8, 48, 64, 3),
        dtype=np.uint8,
        serializer=JpegCodec(quality=85),
        compressors=None,
    )
    arr[:] = x
    back = zarr.open_array(path)[:]
    assert back.shape == x.shape and back.dtype == np.uint8
    assert psnr(back, x) > PSNR_Q85
    last = unpack((path / "c" / "2" / "0" / "0" / "0").read_bytes(), 8)
    assert [len(p) > 0 for p in last] == [True] * 5 + [False] * 3  # rows 21..23 are fill: 0 bytes
    assert json.loads((path / "zarr.json").read_text())["codecs"] == [
        {"name": "vla_rl.jpeg", "configuration": {"quality": 85}}
    ]
    probe = (
        "import sys, zarr\n"
        "try:\n    zarr.open_array(sys.argv[1])\nexcept Exception as e:\n    print('without:', type(e).__name__)\n"
        "import fleet.codecs\nprint('with:', zarr.open_array(sys.argv[1])[:].shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "without: UnknownCodecError" in out and "with: (21, 48, 64, 3)" in out, out


def test_store_jpeg_camera_read_by_store_dataset_and_verify(tmp_path: Path) -> None:
    """One JPEG and one lossless camera through EpisodeWriter (batches across chunk boundaries, a flush
    mid-chunk, a partial last chunk): EpisodeStore and ChunkDataset read them back, the lossless one bit
    exact; frames written before the mid-chunk flush keep their first encoding byte for byte."""
    cams = frames(45)
    store = EpisodeStore(tmp_path / "store", create=True)
    w = store.create_episode(
        SPEC, robot_id="r", task="t", chunk_len=16, camera_codec="jpeg:85,wrist=lossless"
    )
    for lo in range(0, 45, 7):
        w.add_frames(batch(cams, lo, min(lo + 7, 45)))
        if lo == 14:
            w.flush()  # commits 21 frames: chunk 1 gets rows 16..20, then is completed by the next write
    w.close()
    eid = w.episode_id
    ep = store.read_episode(eid)
    assert ep.cameras["front"].shape == (45, 48, 64, 3) and ep.cameras["front"].dtype == np.uint8
    assert psnr(ep.cameras["front"], cams["front"]) > PSNR_Q85
    np.testing.assert_array_equal(ep.cameras["wrist"], cams["wrist"])
    np.testing.assert_array_equal(ep.state[:, 0], np.repeat(np.arange(0, 45, 7), 7)[:45])
    front = store.read_array(eid, "cameras/front")
    assert (
        array_codec(front) == "jpeg:85" and array_codec(store.read_array(eid, "cameras/wrist")) == "lossless"
    )
    for t in (16, 20, 21, 44):  # rows of the re-opened chunk, and of the partial last one
        assert stored_jpeg(front, t) == encode_jpeg(cams["front"][t], 85)
    assert stored_jpeg(front, 3, max_quality=50) is None  # stored better than asked: caller re-encodes
    assert store.verify() == []
    ds = ChunkDataset(store, horizon=4)
    got = ds.batch(np.array([0, 17, 44]))["observation.images.front"].numpy()
    np.testing.assert_array_equal(got, ep.cameras["front"][[0, 17, 44]])


def test_default_stays_lossless_zstd(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path / "s", create=True)
    w = store.create_episode(SPEC, robot_id="r", task="t", chunk_len=8)
    w.add_frames(batch(frames(10), 0, 10))
    w.close()
    doc = json.loads((store.episodes_dir / w.episode_id / "cameras" / "front" / "zarr.json").read_text())
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "zstd"]
    np.testing.assert_array_equal(store.read_episode(w.episode_id).cameras["front"], frames(10)["front"])


def test_collector_writes_a_jpeg_camera_end_to_end(tmp_path: Path) -> None:
    """A robot streams two cameras over gRPC to a collector with --camera-codec jpeg:90,wrist=lossless
    (a camera of another robot named too); its store writer, resuming the episode the collector created,
    writes front as JPEG from the array's metadata alone."""
    from vla_rl_client.robot_client import RobotClient

    from fleet.collector import Collector, CollectorConfig

    token = "codec-test"
    c = Collector(
        CollectorConfig(
            store=tmp_path / "store",
            port=0,
            chunk_len=16,
            camera_codec="jpeg:90,wrist=lossless,hand=jpeg:50",
            store_writers=0,  # its StoreWriter in a thread: the same code as the process, without a start-up
        ),
        token=token,
    ).start()
    try:
        client = RobotClient(c.address, "arm-1", SPEC, "test/task", token=token, max_batch_frames=4)
        cams = frames(40, seed=3)
        client.start_episode()
        for i in range(40):
            client.add_frame(
                {k: v[i] for k, v in cams.items()}, np.zeros(4, np.float32), np.zeros(2, np.float32)
            )
        client.end_episode("success")
        assert client.close(30)
        assert c.drain(30)
        store = c.store
        (eid,) = store.episode_ids()
        ep = store.read_episode(eid)
        assert ep.meta.is_closed and ep.length == 40
        assert array_codec(store.read_array(eid, "cameras/front")) == "jpeg:90"
        assert psnr(ep.cameras["front"], cams["front"]) > PSNR_Q85
        np.testing.assert_array_equal(ep.cameras["wrist"], cams["wrist"])
        assert store.verify(db=c.db) == []
    finally:
        c.stop()


def test_dashboard_passes_stored_jpeg_through(tmp_path: Path) -> None:
    from vla_rl.dashboard.frames import FrameReader, JpegCache

    cams = frames(10)
    store = EpisodeStore(tmp_path / "s", create=True)
    w = store.create_episode(SPEC, robot_id="r", task="t", chunk_len=8, camera_codec="jpeg:80,wrist=lossless")
    w.add_frames(batch(cams, 0, 10))
    meta = w.close()
    reader, cache = FrameReader(store), JpegCache()
    # the public accessor: the stored bytes of a JPEG camera, None for a lossless one or a lower quality
    assert reader.stored_jpeg(meta, "front", 3) == encode_jpeg(cams["front"][3], 80)
    assert reader.stored_jpeg(meta, "front", 3, max_quality=50) is None
    assert reader.stored_jpeg(meta, "wrist", 3) is None
    with pytest.raises(IndexError, match=r"t: expected a frame in 0\.\.9"):
        reader.stored_jpeg(meta, "front", 10)
    np.testing.assert_array_equal(reader.frame(meta, "wrist", 3), cams["wrist"][3])  # lossless: decoded
    reader = FrameReader(store)
    assert cache.get(reader, meta, "front", 9, 85) == encode_jpeg(cams["front"][9], 80)  # as stored
    assert reader.misses == 0  # no chunk was decoded
    smaller = cache.get(reader, meta, "front", 9, 40)  # asked below the stored quality: re-encoded
    assert len(smaller) < len(encode_jpeg(cams["front"][9], 80)) and reader.misses == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["collect", "--store", "{tmp}/s", "--port", "0", "--camera-codec", "jpeg:101"],
        ["sim", "demos", "--task", "kinematic/Reach-v0", "--store", "{tmp}/d", "--camera-codec", "webp"],
        [
            "sim",
            "demos",
            "--task",
            "kinematic/Reach-v0",
            "--store",
            "{tmp}/d",
            "--camera-codec",
            "wrist=jpeg",
        ],
        ["store", "import-lerobot", "{tmp}/nothing", "{tmp}/i", "--camera-codec", "jpeg:abc"],
    ],
)
def test_bad_camera_codec_is_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--camera-codec: " in err, err
    assert not (tmp_path / "i").exists()

"""Episode store throughput: write frames/s and MB/s, compared with raw disk writes, and read speed.

Configurations: (a) images: two 128x128x3 cameras + state + action, (b) vectors only; both with
chunk_len 64, written one frame at a time (``add_frame``, what a robot's control loop does) and in
batches (``add_frames``, also with ``fsync=True``: every commit durable against power loss). MB/s counts the uncompressed frame payload. The raw-disk baseline writes
the same number of bytes with plain file writes and one fsync at the end, on the same filesystem
and in the same run, so the store/raw ratio is comparable across machines. Reads go through
:class:`fleet.dataset.ChunkDataset` (load into memory, then iterate with a DataLoader).

Images are synthetic (gradients that move frame to frame plus sensor-like noise), so they compress
roughly like simulator renders; random noise would not compress at all.

Camera codecs (``--only codecs``, or after the runs above): the rendered 224 px ManiSkill StackCube
frames of ``bench/collect.py`` (base + hand camera, cached) written through ``add_frames`` in 128-frame
chunks as the collector's store writer does, once per codec (lossless zstd at the collector's -3 and at
the store default, JPEG at three qualities; and, for comparison only, H.264 per chunk through PyAV, the
video alternative that was not built): bytes per camera-frame, ingest camera-frames/s and CPU ms per
camera-frame (all threads: the encode runs in the store's write pool), training decode (``ChunkDataset``
loading every frame) camera-frames/s and CPU ms, and PSNR against the original frames.

    python bench/store_speed.py --out bench/results/store_speed.json --frames 2000
    python bench/store_speed.py --only codecs --out bench/results/store_codecs.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import LoadSampler, loadavg
from fleet.dataset import ChunkDataset
from fleet.store import EpisodeStore

STATE_DIM, ACTION_DIM, CHUNK_LEN, POOL = 9, 8, 64, 128


def make_spec(images: bool) -> RobotSpec:
    cams = (CameraSpec("base_camera", 128, 128), CameraSpec("hand_camera", 128, 128)) if images else ()
    return RobotSpec("bench", STATE_DIM, ACTION_DIM, 30.0, "bench", cams)


def make_pool(spec: RobotSpec, rng: np.random.Generator) -> dict[str, Any]:
    """POOL frames that the benchmark cycles through (generating frames must not be what we time)."""
    out: dict[str, Any] = {"cameras": {}}
    for k, cam in enumerate(spec.cameras):
        y, x = np.mgrid[: cam.height, : cam.width]
        t = np.arange(POOL)[:, None, None, None]
        base = (x[None, ..., None] * 2 + y[None, ..., None] + t * (3 + k) + np.array([0, 60, 120])) % 256
        noise = rng.integers(0, 6, (POOL, cam.height, cam.width, 3))
        out["cameras"][cam.name] = (base + noise).astype(np.uint8)
    out["state"] = rng.standard_normal((POOL, spec.state_dim), dtype=np.float32)
    out["action"] = rng.uniform(-1, 1, (POOL, spec.action_dim)).astype(np.float32)
    return out


def frame_bytes(spec: RobotSpec) -> int:
    """Uncompressed bytes per stored frame (all arrays)."""
    img = sum(c.height * c.width * 3 for c in spec.cameras)
    # state, action, proposed_action (float32), reward (4), flags (2), controller (1), segment (4),
    # revision (2), timestamp (8)
    return img + 4 * (spec.state_dim + 2 * spec.action_dim) + 4 + 2 + 1 + 4 + 2 + 8


def bench_write(
    root: Path, spec: RobotSpec, pool: dict[str, Any], frames: int, seconds: float, batched: bool, fsync: bool
) -> dict[str, Any]:
    store = EpisodeStore(root, create=True, fsync=fsync)
    w = store.create_episode(spec, robot_id="bench", task="bench/write", chunk_len=CHUNK_LEN)
    t0 = time.perf_counter()
    n = 0
    while n < frames and time.perf_counter() - t0 < seconds:
        if batched:
            k = min(CHUNK_LEN, frames - n)
            idx = np.arange(n, n + k) % POOL
            w.add_frames(
                {
                    "cameras": {c: a[idx] for c, a in pool["cameras"].items()},
                    "state": pool["state"][idx],
                    "action": pool["action"][idx],
                    "proposed_action": pool["action"][idx],
                }
            )
            n += k
        else:
            i = n % POOL
            w.add_frame(
                cameras={c: a[i] for c, a in pool["cameras"].items()},
                state=pool["state"][i],
                action=pool["action"][i],
                proposed_action=pool["action"][i],
            )
            n += 1
    w.close()
    dt = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in (store.episodes_dir / w.episode_id).rglob("*") if f.is_file())
    nbytes = n * frame_bytes(spec)
    return {
        "frames": n,
        "seconds": dt,
        "frames_per_s": n / dt,
        "mb_per_s": nbytes / dt / 1e6,
        "payload_bytes": nbytes,
        "disk_bytes": disk,
        "compression_ratio": nbytes / disk,
        "episode_id": w.episode_id,
    }


def bench_raw_disk(path: Path, nbytes: int) -> dict[str, Any]:
    """Plain sequential writes of ``nbytes`` (4 MiB blocks, incompressible) and one fsync at the end."""
    block = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return {"bytes": nbytes, "seconds": dt, "mb_per_s": nbytes / dt / 1e6}


def bench_read(root: Path, spec: RobotSpec, horizon: int = 16) -> dict[str, Any]:
    store = EpisodeStore(root)
    t0 = time.perf_counter()
    ds = ChunkDataset(store, horizon=horizon)
    load_s = time.perf_counter() - t0
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=0)
    for _ in zip(range(10), loader, strict=False):  # warm up: the first batches pay for page faults
        pass
    t0 = time.perf_counter()
    seen = sum(len(batch["action"]) for batch in loader)
    iter_s = time.perf_counter() - t0
    nbytes = len(ds) * frame_bytes(spec)
    return {
        "frames": len(ds),
        "load_seconds": load_s,
        "load_frames_per_s": len(ds) / load_s,
        "load_mb_per_s": nbytes / load_s / 1e6,
        "samples": seen,
        "horizon": horizon,
        "samples_per_s": seen / iter_s,
    }


CODECS = (("lossless (zstd -3)", "lossless", -3), ("lossless (zstd 3)", "lossless", None))
JPEG_QUALITIES = (90, 75, 60)
H264 = ((23, "ultrafast"), (23, "veryfast"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB: 10 log10(255^2 / MSE) over every pixel (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _best(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two passes of one codec: the higher rates and the lower CPU times."""
    out = dict(a)
    for k in a:
        if k.endswith("_per_s"):
            out[k] = max(a[k], b[k])
        elif k.endswith("cpu_ms_per_camera_frame"):
            out[k] = min(a[k], b[k])
    return out


def bench_codecs(workdir: Path, frames: int, size: int = 224, repeats: int = 2) -> dict[str, Any]:
    """Every codec on the same rendered frames (see the module docstring); one result per codec."""
    from bench.collect import CAMERAS, frame_pool

    pool = dict(np.load(frame_pool("rendered", size)))
    spec = RobotSpec(
        "bench", STATE_DIM, ACTION_DIM, 30.0, "bench", tuple(CameraSpec(c, size, size) for c in CAMERAS)
    )
    idx = np.arange(frames) % len(pool[CAMERAS[0]])
    originals = {c: pool[c][idx] for c in CAMERAS}
    runs = [*CODECS, *((f"jpeg:{q}", f"jpeg:{q}", None) for q in JPEG_QUALITIES)]
    out: dict[str, Any] = {}
    for _ in range(repeats):  # codecs interleaved, best of the passes (the machine's load varies)
        for name, codec, level in runs:
            root = workdir / f"codec-{codec}-{level}"
            store = EpisodeStore(root, create=True)
            w = store.create_episode(
                spec,
                robot_id="bench",
                task="bench/codecs",
                chunk_len=128,
                camera_zstd_level=level,
                camera_codec=codec,
            )
            t0, c0 = time.perf_counter(), time.process_time()
            for lo in range(0, frames, 8):  # the store writer gets the collector's batches of 8 frames
                hi = min(lo + 8, frames)
                w.add_frames(
                    {
                        "cameras": {c: originals[c][lo:hi] for c in CAMERAS},
                        "state": np.zeros((hi - lo, STATE_DIM), np.float32),
                        "action": np.zeros((hi - lo, ACTION_DIM), np.float32),
                    }
                )
            w.close()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            cam_frames = frames * len(CAMERAS)
            cam_bytes = {
                c: sum(
                    f.stat().st_size
                    for f in (store.episodes_dir / w.episode_id / "cameras" / c).rglob("*")
                    if f.is_file()
                )
                for c in CAMERAS
            }
            t0, c0 = time.perf_counter(), time.process_time()
            ds = ChunkDataset(EpisodeStore(root), horizon=1)
            rwall, rcpu = time.perf_counter() - t0, time.process_time() - c0
            back = ds.batch(np.arange(frames))
            res = {
                "codec": codec,
                "zstd_level": level,
                "frames": frames,
                "bytes_per_camera_frame": sum(cam_bytes.values()) / cam_frames,
                "bytes_per_camera_frame_by_camera": {c: b / frames for c, b in cam_bytes.items()},
                "raw_bytes_per_camera_frame": size * size * 3,
                "ingest_camera_frames_per_s": cam_frames / wall,
                "ingest_cpu_ms_per_camera_frame": 1e3 * cpu / cam_frames,
                "decode_camera_frames_per_s": cam_frames / rwall,
                "decode_cpu_ms_per_camera_frame": 1e3 * rcpu / cam_frames,
                "psnr_db": {c: psnr(back[f"observation.images.{c}"].numpy(), originals[c]) for c in CAMERAS},
            }
            out[name] = res if name not in out else _best(out[name], res)
            shutil.rmtree(root, ignore_errors=True)
    for crf, preset in H264:
        out[f"h264 {preset} crf {crf}"] = bench_h264(originals, crf, preset)
    base = out[CODECS[0][0]]["bytes_per_camera_frame"]
    for r in out.values():
        r["smaller_than_lossless_zstd_m3"] = base / r["bytes_per_camera_frame"]
        r["smaller_than_raw"] = r["raw_bytes_per_camera_frame"] / r["bytes_per_camera_frame"]
    return out


def bench_h264(originals: dict[str, np.ndarray], crf: int, preset: str, chunk: int = 128) -> dict[str, Any]:
    """The alternative not built: each 128-frame chunk of each camera as an H.264 stream (libx264 through
    PyAV, yuv420p, one thread), encoded and decoded in memory; measured like the store's codecs."""
    import io

    import av

    enc_cpu = dec_cpu = 0.0
    nbytes, back = 0, {}
    for cam, x in originals.items():
        out_frames = []
        for lo in range(0, len(x), chunk):
            c0 = time.process_time()
            buf = io.BytesIO()
            with av.open(buf, "w", format="mp4") as box:
                stream = box.add_stream("libx264", rate=30)
                stream.width, stream.height, stream.pix_fmt = x.shape[2], x.shape[1], "yuv420p"
                stream.options = {"preset": preset, "crf": str(crf)}
                stream.thread_count = 1
                for f in x[lo : lo + chunk]:
                    box.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
                box.mux(stream.encode())
            enc_cpu += time.process_time() - c0
            nbytes += buf.tell()
            c0 = time.process_time()
            with av.open(io.BytesIO(buf.getvalue())) as box:
                box.streams.video[0].thread_count = 1
                out_frames += [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
            dec_cpu += time.process_time() - c0
        back[cam] = np.stack(out_frames)
    n = sum(len(x) for x in originals.values())
    return {
        "codec": f"h264 {preset} crf {crf} (PyAV, per chunk; not a store codec)",
        "bytes_per_camera_frame": nbytes / n,
        "raw_bytes_per_camera_frame": int(np.prod(next(iter(originals.values())).shape[1:])),
        "ingest_cpu_ms_per_camera_frame": 1e3 * enc_cpu / n,
        "decode_cpu_ms_per_camera_frame": 1e3 * dec_cpu / n,
        "psnr_db": {c: psnr(back[c], x) for c, x in originals.items()},
    }


def print_codecs(res: dict[str, Any]) -> None:
    print(
        f"\n{'codec':<20}{'B/cam-frame':>12}{'x smaller':>10}{'ingest fr/s':>12}{'CPU ms':>8}"
        f"{'decode fr/s':>12}{'CPU ms':>8}{'PSNR base/hand dB':>19}"
    )
    for name, r in res.items():
        p = "/".join("lossless" if math.isinf(v) else f"{v:.1f}" for v in r["psnr_db"].values())
        ingest, decode = r.get("ingest_camera_frames_per_s"), r.get("decode_camera_frames_per_s")
        print(
            f"{name:<20}{r['bytes_per_camera_frame']:>12.0f}{r['smaller_than_lossless_zstd_m3']:>10.1f}"
            f"{'-' if ingest is None else f'{ingest:.0f}':>12}{r['ingest_cpu_ms_per_camera_frame']:>8.2f}"
            f"{'-' if decode is None else f'{decode:.0f}':>12}{r['decode_cpu_ms_per_camera_frame']:>8.2f}{p:>19}"
        )


def machine_info(workdir: Path) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "torch": torch.__version__,
        "workdir": str(workdir),
        "workdir_free_gb": shutil.disk_usage(workdir).free / 1e9,
        "load_avg_1m_at_start": loadavg()[0],  # other work on the machine skews every number
    }


def bench_store(
    results: dict[str, Any], workdir: Path, args: argparse.Namespace, rng: np.random.Generator
) -> list[tuple[Any, ...]]:
    """The write runs (each API, images and vectors, against the raw disk) and the read runs, into
    ``results["runs"]``; the write table's rows."""
    rows = []
    for config, images, frames in (("images", True, args.frames), ("vectors", False, 10 * args.frames)):
        spec = make_spec(images)
        pool = make_pool(spec, rng)
        root = workdir / config
        for api, batched, fsync in (
            ("add_frame", False, False),
            ("add_frames", True, False),
            ("add_frames+fsync", True, True),
        ):
            wr = bench_write(root, spec, pool, frames, args.seconds, batched, fsync)
            raw = bench_raw_disk(workdir / "raw.bin", wr["payload_bytes"])
            wr["raw_disk"] = raw
            wr["store_over_raw"] = wr["mb_per_s"] / raw["mb_per_s"]
            results["runs"][f"{config}/{api}"] = wr
            rows.append(
                (
                    f"{config}/{api}",
                    wr["frames"],
                    wr["frames_per_s"],
                    wr["mb_per_s"],
                    raw["mb_per_s"],
                    wr["store_over_raw"],
                    wr["compression_ratio"],
                )
            )
        results["runs"][f"{config}/read"] = bench_read(root, spec)
    return rows


def print_store(results: dict[str, Any], rows: list[tuple[Any, ...]]) -> None:
    """The write and read tables."""
    print(
        f"{'write run':<26}{'frames':>8}{'frames/s':>11}{'MB/s':>9}{'raw MB/s':>10}{'store/raw':>11}{'compr.':>8}"
    )
    for name, n, fps, mbs, raw_mbs, ratio, comp in rows:
        print(f"{name:<26}{n:>8}{fps:>11.0f}{mbs:>9.1f}{raw_mbs:>10.1f}{ratio:>11.2f}{comp:>8.2f}")
    print(f"\n{'read run':<26}{'frames':>8}{'load fr/s':>11}{'load MB/s':>11}{'samples/s':>11}")
    for config in ("images", "vectors"):
        rd = results["runs"][f"{config}/read"]
        print(
            f"{config + '/ChunkDataset':<26}{rd['frames']:>8}{rd['load_frames_per_s']:>11.0f}"
            f"{rd['load_mb_per_s']:>11.1f}{rd['samples_per_s']:>11.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/store_speed.json"))
    ap.add_argument(
        "--frames", type=int, default=2048, help="frames per image run (vector runs write 10x more)"
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="stop a write run after this long")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--only", choices=["codecs"], default=None, help="only the camera codec comparison")
    ap.add_argument(
        "--codec-frames",
        type=int,
        default=None,
        help="frames (x 2 cameras) per codec run (default min(768, --frames))",
    )
    ap.add_argument("--codec-repeats", type=int, default=2, help="passes per codec (best is kept)")
    args = ap.parse_args(argv)
    if args.codec_frames is None:
        args.codec_frames = min(768, args.frames)
    torch.set_num_threads(1)

    workdir = Path(tempfile.mkdtemp(prefix="store_speed_", dir=args.workdir))
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"machine": machine_info(workdir), "chunk_len": CHUNK_LEN, "runs": {}}
    rows: list[tuple[Any, ...]] = []
    try:
        with LoadSampler() as load:
            if args.only != "codecs":
                rows = bench_store(results, workdir, args, rng)
            results["codecs"] = bench_codecs(workdir, args.codec_frames, repeats=args.codec_repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["load"] = load.summary()

    if args.only != "codecs":
        print_store(results, rows)
    print_codecs(results["codecs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Episode store throughput: write frames/s and MB/s, compared with raw disk writes, and read speed.

Configurations: (a) images: two 128x128x3 cameras + state + action, (b) vectors only; both with
chunk_len 64, written one frame at a time (``add_frame``, what a robot's control loop does) and in
batches (``add_frames``, also with ``fsync=True``: every commit durable against power loss). MB/s counts the uncompressed frame payload. The raw-disk baseline writes
the same number of bytes with plain file writes and one fsync at the end, on the same filesystem
and in the same run, so the store/raw ratio is comparable across machines. Reads go through
:class:`fleet.dataset.ChunkDataset` (load into memory, then iterate with a DataLoader).

Images are synthetic (gradients that move frame to frame plus sensor-like noise), so they compress
roughly like simulator renders; random noise would not compress at all.

    python bench/store_speed.py --out bench/results/store_speed.json --frames 2000
"""

from __future__ import annotations

import argparse
import json
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

from fleet.dataset import ChunkDataset
from fleet.store import EpisodeStore
from vla_rl.spec import CameraSpec, RobotSpec

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
        "load_avg_1m_at_start": os.getloadavg()[0],  # other work on the machine skews every number
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/store_speed.json"))
    ap.add_argument(
        "--frames", type=int, default=2048, help="frames per image run (vector runs write 10x more)"
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="stop a write run after this long")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="store_speed_", dir=args.workdir))
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"machine": machine_info(workdir), "chunk_len": CHUNK_LEN, "runs": {}}
    rows = []
    try:
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
            rd = bench_read(root, spec)
            results["runs"][f"{config}/read"] = rd
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a fleet frame's CPU goes: each stage of the robot -> collector -> store path, timed alone.

Runs every stage in this one process, single-threaded, on the same rendered frames as ``bench/collect.py``
(two 224 px cameras + state + action, batches of 8), and reports CPU ms per robot-frame
(``time.process_time``, so other jobs on the machine do not count). The gRPC transport itself is not in
here (it is what ``bench/collect.py`` adds on top). Also compares camera codecs: speed and size.

    nice python bench/collect_stages.py               # 480 frames, all codecs
    python bench/collect_stages.py --frames 240 --codecs zstd1
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.robot_client import RobotClient
from vla_rl_client.spec import CameraSpec, RobotSpec
from vla_rl_client.wire import keep_freed_memory
from zarr.codecs import BloscCodec, ZstdCodec

from bench.collect import CAMERAS, frame_pool, free_port
from bench.common import LoadSampler, loadavg, table, write_results
from fleet.store import EpisodeStore
from fleet.wal import WriteAheadLog, decode_frames, parse_message


def cpu_ms(fn: Callable[[], Any], frames: int) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1000 / frames


CODECS: dict[str, Any] = {
    "none": None,
    "zstd 3 (zarr default)": ZstdCodec(level=3),
    "zstd 1": ZstdCodec(level=1),
    "zstd -1": ZstdCodec(level=-1),
    "zstd -3": ZstdCodec(level=-3),
    "zstd -5": ZstdCodec(level=-5),
    "blosc lz4": BloscCodec(cname="lz4", clevel=1, shuffle="noshuffle"),
    "blosc lz4 + shuffle": BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),
}


def codec_table(work: Path, imgs: list[dict[str, np.ndarray]], chunk_len: int) -> list[list[str]]:
    """Each codec on the camera arrays alone: CPU per camera pair (compress + write) and size."""
    n = len(imgs) - len(imgs) % chunk_len
    rows = []
    for name, comp in CODECS.items():
        cpu = 0.0
        size = 0
        for c in CAMERAS:
            path = work / f"codec-{c}"
            a = zarr.create_array(
                path,
                shape=(n, *imgs[0][c].shape),
                chunks=(chunk_len, *imgs[0][c].shape),
                dtype="uint8",
                compressors=comp,
                config={"write_empty_chunks": True},
            )
            block = np.stack([f[c] for f in imgs[:n]])
            t = time.process_time()
            for k in range(0, n, chunk_len):
                a[k : k + chunk_len] = block[k : k + chunk_len]
            cpu += time.process_time() - t
            size += sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "zarr.json")
            shutil.rmtree(path)
        raw = n * sum(x.nbytes for x in imgs[0].values())
        rows.append([name, f"{cpu * 1000 / n:.3f}", f"{size / raw:.3f}"])
    return rows


def stages(args: argparse.Namespace) -> dict[str, Any]:
    """Each stage's CPU ms per robot-frame, the codec table and fsync's wall time per batch (printed as
    tables too)."""
    keep_freed_memory()  # as the collector and the synthetic robots do
    size = 224
    pools = np.load(frame_pool("rendered", size))
    pools = {c: np.asarray(pools[c]) for c in CAMERAS}
    spec = RobotSpec(
        "bench",
        state_dim=25,
        action_dim=4,
        control_hz=30,
        instruction="bench",
        cameras=tuple(CameraSpec(c, size, size) for c in CAMERAS),
    )
    n = args.frames - args.frames % args.batch
    rng = np.random.default_rng(0)
    states = rng.standard_normal((n, 25)).astype(np.float32)
    actions = rng.uniform(-1, 1, (n, 4)).astype(np.float32)
    rows: list[list[Any]] = []
    res: dict[str, float] = {}

    # --- robot side
    imgs: list[dict[str, np.ndarray]] = []

    buf = {c: np.empty_like(pool[0]) for c, pool in pools.items()}

    def gen(keep: bool) -> None:  # as synthetic robots do: into a reused buffer, stamped
        for i in range(n):
            for c, pool in pools.items():
                np.copyto(buf[c], pool[i % len(pool)])
                buf[c][0, :4, 0] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)
            if keep:
                imgs.append({c: b.copy() for c, b in buf.items()})

    res["robot: make frame (bench only)"] = cpu_ms(lambda: gen(False), n)
    gen(True)  # the frames for the later stages (not timed)
    # Nothing listens there: the client buffers and never sends, so only its own work is timed.
    client = RobotClient(f"127.0.0.1:{free_port()}", "stage", spec, "t", max_batch_frames=args.batch)
    client.start_episode("stage-ep")

    def add() -> None:
        for i in range(n):
            client.add_frame(imgs[i], states[i], actions[i], actions[i], 0.0, False, False, 0, "r", 1.0 + i)

    res["robot: add_frame + seal (client)"] = cpu_ms(add, n)
    raws = [x.data for x in client._unsent if x.kind == "frames"]
    client.close(0)

    # --- collector intake
    parsed: list[tuple[pb.RobotMessage, Any]] = []
    res["collector: parse"] = cpu_ms(lambda: parsed.extend(parse_message(r) for r in raws), n)
    batches: list[dict[str, Any]] = []
    res["collector: validate (decode_frames)"] = cpu_ms(
        lambda: batches.extend(decode_frames(m.frames, spec, 64, -math.inf, c) for m, c in parsed), n
    )
    work = Path(tempfile.mkdtemp(prefix="vla-rl-stages-"))
    wal = WriteAheadLog(work / "a.wal", fsync=False)
    res["collector: log append (write)"] = cpu_ms(lambda: [wal.append(r) for r in raws], n)
    wal.close()
    wal = WriteAheadLog(work / "b.wal", fsync=True)  # --fsync: one fdatasync per batch
    t = time.perf_counter()
    res["collector: log append + fsync per batch"] = cpu_ms(lambda: [wal.append(r) for r in raws], n)
    fsync_wall = (time.perf_counter() - t) * 1000 / len(raws)
    wal.close()

    # --- store writes (the collector's settings)
    store = EpisodeStore(work / "store", create=True)
    w = store.create_episode(
        spec, robot_id="r", task="t", chunk_len=args.chunk_len, camera_zstd_level=args.zstd_level
    )
    w.begin_segment()
    t0 = time.perf_counter()
    res[f"store: add_frames + write (zstd {args.zstd_level})"] = cpu_ms(
        lambda: [w.add_frames(b) for b in batches] and w.flush(), n
    )
    store_wall = (time.perf_counter() - t0) * 1000 / n
    codec_rows = codec_table(work, imgs, args.chunk_len) if args.codecs else []
    shutil.rmtree(work, ignore_errors=True)
    for k, v in res.items():
        rows.append([k, f"{v:.3f}"])
    print(table(rows, ["stage", "CPU ms per robot-frame"]))
    print(f"\nfsync per batch of {args.batch}: {fsync_wall:.2f} ms wall per batch")
    print()
    print(f"store writes: {store_wall:.3f} ms wall per frame (write threads overlap)")
    if codec_rows:
        print(table(codec_rows, ["camera codec", "CPU ms per camera pair", "bytes / raw (both cameras)"]))
    return {"stages_cpu_ms_per_frame": res, "codecs": codec_rows, "fsync_ms_per_batch": fsync_wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=480)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--chunk-len", type=int, default=128, help="frames per Zarr chunk (the collector's default)"
    )
    ap.add_argument("--zstd-level", type=int, default=-3, help="camera zstd level of the store stage")
    ap.add_argument("--codecs", action=argparse.BooleanOptionalAction, default=True, help="codec table")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with LoadSampler() as load:
        out = stages(args)
    print(f"\nload average: {loadavg()}")
    write_results(
        "collect_stages",
        {**out, "load_avg": loadavg(), "load": load.summary(), "args": vars(args)},
        args.out,
    )


if __name__ == "__main__":
    main()

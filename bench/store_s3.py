"""The episode store on S3 (moto on loopback) vs a local directory: training reads and collector writes.

Two measurements, each on the same synthetic episodes in a local store and in ``s3://`` (a moto S3
server in this process, on 127.0.0.1), reported as frames/s and the S3/local ratio:

* **collector writes**: what the collector's store writer does per episode: create it, feed frames
  in batches (chunk-aligned blocks go out as whole chunks, one PUT each), close it. The write-ahead
  log and gRPC are left out: they are the same local work for both stores.
* **training reads**: :class:`fleet.dataset.ChunkDataset` loading every closed episode (what a trainer
  does at start-up), cold (empty read cache: everything is downloaded) and warm (the read cache in a
  local folder, as a second training run on the same machine finds it: no chunk is downloaded).

moto is a Python server sharing this process's cores, so the ratios are a pessimistic bound on the
client's overhead, not a prediction for a real object store (which adds network latency but not the
server's CPU). Requests are counted by HTTP method on the server.

    python bench/store_s3.py --out bench/results/store_s3.json --episodes 6 --frames 256
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import table, write_results

TASK = "bench/store-s3"


class MotoS3:
    """An S3-compatible server (moto's, threaded) on 127.0.0.1 with a free port, counting requests.

    ``counts`` is a Counter of HTTP methods seen since :meth:`reset_counts`; ``env`` the environment a
    client needs (endpoint, region, throwaway credentials). moto keeps buckets in this process, so a
    server stopped and started again on the same port still has them.
    """

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.counts: collections.Counter[str] = collections.Counter()
        self.gets: collections.Counter[str] = collections.Counter()  # GET requests by path
        self.puts: collections.Counter[str] = collections.Counter()  # PUT requests by path
        self._lock = threading.Lock()
        self._server: Any = None

    def start(self) -> MotoS3:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        outer = self

        class _Counting(ThreadedMotoServer):
            def _server_entry(self) -> None:
                app = DomainDispatcherApplication(create_backend_app)

                def counting(environ: dict[str, Any], start_response: Any) -> Any:
                    method = environ["REQUEST_METHOD"]
                    with outer._lock:
                        outer.counts[method] += 1
                        if method in ("GET", "PUT"):
                            by_path = outer.gets if method == "GET" else outer.puts
                            by_path[environ.get("PATH_INFO", "")] += 1
                    return app(environ, start_response)

                self._server = make_server(
                    self._ip_address, self._port, counting, True, request_handler=MotoRequestHandler
                )
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = _Counting(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.gets.clear()
            self.puts.clear()

    def create_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            skip_instance_cache=True,
        )
        fs.call_s3("create_bucket", Bucket=name)

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_spec(size: int) -> RobotSpec:
    cams = (CameraSpec("base_camera", size, size), CameraSpec("hand_camera", size, size))
    return RobotSpec("bench", 9, 8, 30.0, "bench", cams)


def make_frames(spec: RobotSpec, n: int, seed: int) -> dict[str, Any]:
    """Frames that compress like renders (moving gradients plus a little noise)."""
    rng = np.random.default_rng(seed)
    cams = {}
    for k, cam in enumerate(spec.cameras):
        y, x = np.mgrid[: cam.height, : cam.width]
        t = np.arange(n)[:, None, None, None]
        base = (x[None, ..., None] * 2 + y[None, ..., None] + t * (3 + k) + np.array([0, 60, 120])) % 256
        cams[cam.name] = (base + rng.integers(0, 6, (n, cam.height, cam.width, 3))).astype(np.uint8)
    return {
        "cameras": cams,
        "state": rng.standard_normal((n, spec.state_dim), dtype=np.float32),
        "action": rng.uniform(-1, 1, (n, spec.action_dim)).astype(np.float32),
        "timestamp": 1.7e9 + np.arange(n) / 30.0,
    }


def write_episodes(root: str, spec: RobotSpec, episodes: int, frames: int, batch: int) -> dict[str, Any]:
    """Create, fill (``batch`` frames per call) and close episodes, timed; frames/s over all of it."""
    from fleet.store import EpisodeStore

    store = EpisodeStore(root, create=True)
    data = [make_frames(spec, frames, seed) for seed in range(episodes)]
    t0 = time.perf_counter()
    for i, d in enumerate(data):
        w = store.create_episode(spec, robot_id=f"r{i}", task=TASK, chunk_len=64, camera_zstd_level=-3)
        for s in range(0, frames, batch):
            w.add_frames(
                {
                    k: {c: a[s : s + batch] for c, a in v.items()} if k == "cameras" else v[s : s + batch]
                    for k, v in d.items()
                }
            )
        w.close()
    dt = time.perf_counter() - t0
    return {"frames": episodes * frames, "seconds": dt, "frames_per_s": episodes * frames / dt}


def read_all(root: str, cache_dir: Path | None, horizon: int = 16) -> dict[str, Any]:
    """Load every closed episode into a ChunkDataset (a trainer's start-up), timed."""
    from fleet.dataset import ChunkDataset
    from fleet.store import EpisodeStore

    t0 = time.perf_counter()
    store = EpisodeStore(root, cache_dir="off" if cache_dir is None else cache_dir)
    ds = ChunkDataset(store, horizon=horizon)
    dt = time.perf_counter() - t0
    return {"frames": len(ds), "seconds": dt, "frames_per_s": len(ds) / dt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=6, help="episodes per store")
    ap.add_argument("--frames", type=int, default=256, help="frames per episode")
    ap.add_argument("--camera-size", type=int, default=128, help="two square RGB cameras of this side")
    ap.add_argument("--batch", type=int, default=8, help="frames per add_frames call (a collector batch)")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs of each measurement")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON results (default bench/results/store_s3.json)"
    )
    a = ap.parse_args(argv)
    for name in ("episodes", "frames", "camera_size", "batch", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive number, got {getattr(a, name)}")
    spec = make_spec(a.camera_size)
    work = Path(tempfile.mkdtemp(prefix="store_s3_"))
    results: dict[str, Any] = {
        "config": {k: getattr(a, k) for k in ("episodes", "frames", "camera_size", "batch", "repeats")},
        "server": "moto ThreadedMotoServer on 127.0.0.1 (same process)",
    }
    try:
        with MotoS3() as s3, env_vars(s3.env):
            s3.create_bucket("bench")
            runs: dict[str, dict[str, Any]] = {}
            for rep in range(a.repeats):
                local = str(work / f"local-{rep}")
                remote = f"s3://bench/store-{rep}"
                for name, root in (("local", local), ("s3", remote)):
                    s3.reset_counts()
                    r = write_episodes(root, spec, a.episodes, a.frames, a.batch)
                    r["requests"] = dict(s3.counts)
                    if r["frames_per_s"] > runs.get(f"write/{name}", {}).get("frames_per_s", 0):
                        runs[f"write/{name}"] = r
                cache = work / f"cache-{rep}"
                for name, root, cdir in (
                    ("local", local, None),
                    ("s3 cold", remote, cache),
                    ("s3 warm", remote, cache),
                    ("s3 no cache", remote, None),
                ):
                    s3.reset_counts()
                    r = read_all(root, cdir)
                    r["requests"] = dict(s3.counts)
                    if r["frames_per_s"] > runs.get(f"read/{name}", {}).get("frames_per_s", 0):
                        runs[f"read/{name}"] = r
        for k, r in runs.items():
            base = runs["write/local" if k.startswith("write") else "read/local"]["frames_per_s"]
            r["ratio_vs_local"] = r["frames_per_s"] / base
        results["runs"] = runs
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        [
            k,
            r["frames"],
            f"{r['seconds']:.2f}",
            f"{r['frames_per_s']:.0f}",
            f"{r['ratio_vs_local']:.2f}",
            r["requests"].get("GET", 0),
            r["requests"].get("PUT", 0),
        ]
        for k, r in runs.items()
    ]
    print(table(rows, ["run", "frames", "s", "frames/s", "vs local", "GETs", "PUTs"]))
    path = write_results("store_s3", results, a.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

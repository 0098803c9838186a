"""Compiled vs eager inference through the policy server's batch (``ServedVersion.infer_scored``, the call
the batcher makes), on this machine's CPU (or CUDA): chunks/s and p50 per batch size, and the warm-up's
compile time.

Models, random weights (the compute is what matters; ``--models`` picks): our FlowVLA at the default size
with one 64 px camera + state and state-only (K = 10), and a small LeRobot SmolVLA (4 VLM layers, 64 px
camera, K = 10) through the flow-policy contract.
Each model is loaded twice: one version serves eager, the other compiles with ``ServerConfig.compile="on"``
(:mod:`server.compiled`: the denoising step, one static graph per batch bucket). The two are timed
interleaved, call by call (A, B, A, B, ...), so load from other processes on a shared machine falls on both
alike; the load average is recorded before and after. Every timed pair also checks that both give the same
chunks for the same noise. Prints a markdown table and writes bench/results/compile.json.

    python -m bench.compile [--models flowvla-camera smolvla] [--batches 1 8 16] [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.spec import RobotSpec

from bench.common import LoadSampler, loadavg, table, write_results
from bench.inference import default_models
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from policies.loading import load_servable, pick_device
from server.slots import ServedVersion
from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint

INSTRUCTION = "push the cube"


def save_flowvla(folder: Path, cfg: FlowVLAConfig) -> tuple[Path, RobotSpec]:
    """A randomly initialised FlowVLA checkpoint of ``cfg`` (instruction-free: the camera and state)."""
    spec = RobotSpec("arm", cfg.state_dim, cfg.action_dim, 10.0, INSTRUCTION, cameras=cfg.cameras)
    cfg = FlowVLAConfig.from_robot_spec(spec, instruction_encoder="none")
    torch.manual_seed(0)
    info = CheckpointInfo("flow_vla", cfg.to_dict(), spec, {}, Lineage("bench"))
    save_checkpoint(folder, FlowVLAPolicy(cfg).state_dict(), info)
    return folder, spec


def save_smolvla(folder: Path) -> tuple[Path, RobotSpec]:
    """A small SmolVLA (the test-suite's builder) for a one-camera arm."""
    from vla_rl_client.spec import CameraSpec

    from policies.lerobot_tiny import save_tiny_policy

    spec = RobotSpec("arm", 8, 4, 10.0, INSTRUCTION, cameras=(CameraSpec("front", 64, 64),))
    save_tiny_policy(
        folder, "smolvla", spec, words=INSTRUCTION.split(), seed=0, chunk_size=10, n_action_steps=5
    )
    return folder, spec


MODELS: dict[str, tuple[str, Callable[[Path], tuple[Path, RobotSpec]]]] = {
    "flowvla-camera": (
        "FlowVLA 64px camera + state",
        lambda folder: save_flowvla(folder, default_models()["64px camera + state"]),
    ),
    "flowvla-state": (
        "FlowVLA state-only",
        lambda folder: save_flowvla(folder, default_models()["state-only"]),
    ),
    "smolvla": ("SmolVLA (small)", save_smolvla),
}
"""``--models``: name -> (the table's label, a builder that saves the model to a folder)."""


def batch(version: ServedVersion, rows: int, seed: int) -> tuple[Any, ...]:
    """``rows`` random observations and their seeds' initial noise, as the batcher stacks them."""
    rng = np.random.default_rng(seed)
    spec = version.spec
    states = rng.standard_normal((rows, spec.state_dim)).astype(np.float32)
    cams = {c.name: rng.integers(0, 256, (rows, *c.shape), dtype=np.uint8) for c in spec.cameras}
    noise = np.stack([version.initial_noise(seed + i) for i in range(rows)])
    return states, cams, [spec.instruction] * rows, noise


def measure(name: str, ref: Path, device: str, batches: list[int], repeats: int) -> dict[str, Any]:
    """Compile one version (all buckets up to the largest batch), then time it against an eager one."""
    eager = ServedVersion(load_servable(str(ref), device=device))
    compiled_version = ServedVersion(load_servable(str(ref), device=device))
    t0 = time.perf_counter()
    compiled = compiled_version.start_compiled("on", max(batches))
    if compiled is None:
        raise SystemExit(f"{name}: nothing to compile on {device}")
    compiled.join()
    compile_s = time.perf_counter() - t0
    print(f"{name}: warm-up compiled buckets {sorted(compiled.ready)} in {compile_s:.1f} s {compiled.failed}")
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        diff = 0.0
        for r in range(repeats + 2):  # the first two pairs warm caches and are not counted
            args = batch(eager, b, seed=r)
            out = {}
            for label, version in (("eager", eager), ("compiled", compiled_version)):
                start = time.perf_counter()
                out[label] = version.infer_scored(*args)[0]
                if r >= 2:
                    times[label].append((time.perf_counter() - start) * 1e3)
            diff = max(diff, float(np.abs(out["eager"] - out["compiled"]).max()))
        p50 = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "model": name,
                "batch": b,
                "eager_p50_ms": round(p50["eager"], 2),
                "compiled_p50_ms": round(p50["compiled"], 2),
                "eager_chunks_per_s": round(b * 1e3 / p50["eager"], 1),
                "compiled_chunks_per_s": round(b * 1e3 / p50["compiled"], 1),
                "speedup": round(p50["eager"] / p50["compiled"], 3),
                "max_abs_diff": diff,
                "compiled_used": compiled.usable(b),
            }
        )
        print(rows[-1], flush=True)
    return {"model": name, "compile_s": round(compile_s, 1), "failed": compiled.failed, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = str(pick_device(args.device))
    load_before = loadavg()
    results = []
    with LoadSampler() as load, tempfile.TemporaryDirectory() as tmp:
        models = {MODELS[m][0]: MODELS[m][1](Path(tmp) / m) for m in args.models}
        for name, (ref, _) in models.items():
            results.append(measure(name, ref, device, sorted(args.batches), args.repeats))
    rows = [r for m in results for r in m["rows"]]
    print()
    print(
        table(
            [
                [
                    r["model"],
                    r["batch"],
                    r["eager_p50_ms"],
                    r["compiled_p50_ms"],
                    r["eager_chunks_per_s"],
                    r["compiled_chunks_per_s"],
                    f"{r['speedup']:.2f}x",
                    f"{r['max_abs_diff']:.1e}",
                ]
                for r in rows
            ],
            [
                "model",
                "batch",
                "eager p50 ms",
                "compiled p50 ms",
                "eager chunks/s",
                "compiled chunks/s",
                "speedup",
                "max |diff|",
            ],
        )
    )
    summary = {
        "device": device,
        "threads": args.threads,
        "repeats": args.repeats,
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "load": load.summary(),
        "models": results,
    }
    print(f"load average before {load_before}, after {summary['loadavg_after']}")
    print(f"wrote {write_results('compile', summary, args.out)}")


if __name__ == "__main__":
    main()

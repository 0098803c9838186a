"""LeRobot's flow VLAs at their published sizes on a GPU: served inference per chunk and AWR training throughput.

Made for one short run (a few minutes) on a borrowed GPU machine, and runnable on CPU here with tiny
configurations (``--device cpu --quick``) to test the script itself. Per policy type (``smolvla``: SmolVLA,
450.0M parameters; ``pi0``: π0, PaliGemma-3B + Gemma-300M expert; both at the published sizes of
:mod:`bench.vla_models`, random weights, built on the machine, no download), one robot camera
(``--image``) + 6-d state, 6-d actions, K = 10:

1. **inference**: what the policy server runs for a batch (``server.slots.FlowPolicyModel.infer_scored``:
   the folder's pre-processor, one prefix pass, K Euler steps for the whole batch, un-normalisation, the
   ``accel`` uncertainty, host <-> device copies; everything of a request but gRPC, which costs ~1-3 ms on
   loopback, docs/benchmarks.md) at batch 1, 4 and 16 with different instructions per row, under bf16
   autocast (weights float32), p50 / p90 per chunk; beside it LeRobot's own ``predict_action_chunk`` (with
   its processors) on the same batch. Anchors (π0.5, from their posts): SGLang 43 ms end-to-end p50 on an
   H200; mstar 119 ms and 33 requests/s at batch 4.
2. **awr**: the AWR update through the flow-policy contract, as a round runs it: the action expert
   trainable (``set_trainable("expert")``), AdamW, ``mean(w * policy.loss(batch))`` with per-sample
   weights, bf16 autocast, gradient clipping; steps/s and samples/s at ``--train-batch``, peak GPU memory.

3. **modes**: the served batch (``server.slots.ServedVersion.infer_scored``, what the batcher calls) eager,
   under ``torch.compile`` (``--compile auto``: the denoising step, one static graph per batch bucket) and
   with CUDA graphs (``--compile on``: ``mode="reduce-overhead"``), at K = 10 and at the K = 1 / 2 a
   distilled few-step head serves with (the same network, fewer steps: its cost per chunk), batch 1 / 4 /
   16; each mode on a fresh load, its warm-up (compile) time and any fallback to eager recorded. Also for
   our own FlowVLA (``flowvla``: the default size with one 64 px camera, random weights; this section only).

Each section is timed and wrapped (``bench.gpu_check.run_section``): a failure is recorded and the rest
runs; results are written after each section, so a kill keeps what was measured.

The machine has torch and transformers but not LeRobot; pack what it lacks here and carry it::

    .venv/bin/python -m bench.gpu_vla --bundle .carry_vla          # here: .carry_vla/site.tar.xz (~11 MB)
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .carry_vla/site.tar.xz && \\
      PYTHONPATH=/tmp/site:$PWD:$PWD/packages/vla-rl-client python3 -m bench.gpu_vla --device cuda \\
      --out $OUT/gpu_vla.json                                       # there
    .venv/bin/python -m bench.gpu_vla --device cpu --quick          # self-test here (tiny sizes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tarfile
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.common import table, write_results
from bench.gpu_check import environment, run_section, timed

ANCHORS = {
    "sglang_pi05_h200_end_to_end_p50_ms": 43.0,
    "mstar_pi05_batch4_ms": 119.0,
    "mstar_pi05_batch4_requests_per_s": 33.0,
}
INSTRUCTIONS = ("pick up the cube", "push the cube to the left", "open the drawer", "stack the red block")
BUNDLE_PACKAGES = (
    "lerobot",
    "draccus",
    "mergedeep",
    "toml",
    "termcolor",
    "gymnasium",
    "farama_notifications",
    "transformers",  # the version LeRobot 0.6.1 is tested with here (the machine has a newer one)
    "tokenizers",  # the version that transformers requires
    # imported by LeRobot's policy factory (its datasets and diffusion modules)
    "datasets",
    "dill",
    "multiprocess",
    "diffusers",
    "defusedxml",
    "jmespath",
    "opentelemetry",
    "pytz",
    # imported by bench.gpu_check's serving helpers
    "grpc_health",
    "grpc_reflection",
    "grpc_tools",
)
"""What the GPU machine lacks for this script (its package list: the device tool's KINDS.md), found by
importing this script's path here. PyAV is not carried (its FFmpeg libraries alone are over the carry
limit): :data:`AV_STANDIN` replaces it, as LeRobot only names it at import."""
AV_STANDIN = """\"\"\"Stand-in for PyAV (not carried): LeRobot's dataset modules name it at import; using it fails.\"\"\"


class _Missing:
    def __getattr__(self, name):
        return self

    def __or__(self, other):  # annotations such as ``av.codec.Codec | None``
        return self

    __ror__ = __or__

    def __call__(self, *args, **kwargs):
        raise ImportError("PyAV is not installed on this machine (a stand-in for imports only)")


def __getattr__(name):
    return _Missing()
"""


def spec(image: int) -> RobotSpec:
    return RobotSpec("so101", 6, 6, 30.0, INSTRUCTIONS[0], cameras=(CameraSpec("front", image, image),))


def build(policy_type: str, folder: Path, robot: RobotSpec, quick: bool) -> Path:
    """The policy folder: the published size, or the tests' tiny one with ``quick``."""
    if quick:
        from policies.lerobot_tiny import save_tiny_policy

        return save_tiny_policy(
            folder, policy_type, robot, words=INSTRUCTIONS, chunk_size=10, n_action_steps=10
        )
    from bench.vla_models import save_published_policy

    return save_published_policy(folder, policy_type, robot, words=INSTRUCTIONS)


def autocast(device: torch.device, bf16: bool) -> AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def robot_batch(robot: RobotSpec, n: int, event: tuple[int, int]) -> tuple[Any, ...]:
    """n robots' observations (each its own image, state, instruction) and initial noise, as the server
    stacks them."""
    from server.slots import initial_noise

    rng = np.random.default_rng(n)
    cam = robot.cameras[0]
    states = rng.normal(size=(n, robot.state_dim)).astype(np.float32)
    cams = {cam.name: rng.integers(0, 256, (n, cam.height, cam.width, 3), dtype=np.uint8)}
    texts = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(n)]
    noise = np.stack([initial_noise(i, *event) for i in range(n)])
    return states, cams, texts, noise


def percentiles(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(xs, 50)), 2),
        "p90_ms": round(float(np.percentile(xs, 90)), 2),
    }


def time_batch(args: argparse.Namespace, fp: Any, model: Any, robot: RobotSpec, n: int) -> dict[str, Any]:
    """n robots in one batch: our served batch and LeRobot's predict_action_chunk, timed alternately."""
    from policies.lerobot_adapter import to_lerobot_batch

    device = fp.device
    states, cams, texts, noise = robot_batch(robot, n, fp.event_shape)

    def lerobot_call() -> Any:
        batch = to_lerobot_batch(robot.state_dim, states, cams, texts, fp.camera_keys)
        return fp.postprocessor(fp.policy.predict_action_chunk(fp.preprocessor(batch))).cpu()

    ours, theirs = [], []
    with torch.inference_mode(), autocast(device, args.bf16):
        for rep in range(args.warmup + args.reps):
            (actions, score), t = timed(device, lambda: model.infer_scored(states, cams, texts, noise))
            _, t_le = timed(device, lerobot_call)
            if rep >= args.warmup:
                ours.append(t * 1000)
                theirs.append(t_le * 1000)
    return {
        "batch": n,
        **percentiles(ours),
        "chunks_per_s": round(n / statistics.median(ours) * 1000, 2),
        "lerobot_predict": percentiles(theirs),
        "finite": bool(np.isfinite(actions).all()),
        "uncertainty_finite": bool(np.isfinite(score).all()),
    }


def check_inference(args: argparse.Namespace, fp: Any, robot: RobotSpec, out: dict[str, Any]) -> None:
    """Per batch size: our served batch (infer_scored) and LeRobot's predict_action_chunk, p50 / p90."""
    from server.slots import FlowPolicyModel

    model = FlowPolicyModel(
        fp, spec=robot, policy_type=f"lerobot/{fp.lerobot_type}", commit="bench", ref="bench"
    )
    rows = out.setdefault("batches", [])
    for n in args.batches:
        row = time_batch(args, fp, model, robot, n)
        rows.append(row)
        print(
            f"  {fp.lerobot_type} batch {n}: {row['p50_ms']} ms p50 (LeRobot {row['lerobot_predict']['p50_ms']})"
        )


def check_awr(args: argparse.Namespace, fp: Any, robot: RobotSpec, out: dict[str, Any]) -> None:
    """AWR's update through the contract: expert trainable, weighted per-sample flow loss, AdamW."""
    device = fp.device
    params = fp.set_trainable("expert")
    opt = torch.optim.AdamW(params, lr=1e-5)
    fp.train()
    n = args.train_batch
    states, cams, texts, _ = robot_batch(robot, n, fp.event_shape)
    g = torch.Generator().manual_seed(0)
    batch = {
        "state": torch.from_numpy(states),
        "cameras": {k: torch.from_numpy(v) for k, v in cams.items()},
        "instruction": texts,
        "action": torch.randn(n, fp.chunk_len, robot.action_dim, generator=g),
    }
    weights = torch.exp(torch.randn(n, generator=g)).clamp(max=20.0).to(device)  # exp(A / beta), clipped
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step() -> float:
        with autocast(device, args.bf16):
            loss = (weights * fp.loss(batch)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, losses = [], []
    for i in range(args.warmup + args.train_steps):
        loss, t = timed(device, step)
        losses.append(loss)
        if i >= args.warmup:
            times.append(t)
    fp.eval()
    p50 = statistics.median(times)
    out.update(
        trainable_parameters=sum(p.numel() for p in params),
        batch=n,
        step_p50_s=round(p50, 4),
        steps_per_s=round(1 / p50, 3),
        samples_per_s=round(n / p50, 1),
        losses_finite=bool(np.isfinite(losses).all()),
        peak_gpu_memory_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda"
        else None,
    )
    print(
        f"  {fp.lerobot_type} AWR: {out['steps_per_s']} steps/s, {out['samples_per_s']} samples/s at batch {n}"
    )


MODES: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("eager", "off", (10, 2, 1)),
    ("compiled", "auto", (10, 1)),
    ("cuda graphs", "on", (10, 1)),
)
"""``modes``: label, the server's ``--compile`` mode, and the K values timed in it."""


def time_served(args: argparse.Namespace, version: Any, robot: RobotSpec, n: int, k: int) -> dict[str, Any]:
    """p50 / p90 of one served batch of ``n`` robots at K = ``k`` (``infer_scored``, as the batcher runs it)."""
    version.model.num_steps = k
    states, cams, texts, noise = robot_batch(robot, n, version.noise_shape)
    device = torch.device(version.model.device)
    times = []
    with torch.inference_mode(), autocast(device, args.bf16):
        for rep in range(args.warmup + args.reps):
            (actions, _), t = timed(device, lambda: version.infer_scored(states, cams, texts, noise))
            if rep >= args.warmup:
                times.append(t * 1000)
    return {
        "batch": n,
        "K": k,
        **percentiles(times),
        "chunks_per_s": round(n / statistics.median(times) * 1000, 2),
        "finite": bool(np.isfinite(actions).all()),
    }


def check_modes(args: argparse.Namespace, folder: Path, robot: RobotSpec, out: dict[str, Any]) -> None:
    """Eager vs compiled vs CUDA graphs, K = 10 vs 1 / 2, on a fresh load of ``folder`` per mode."""
    from policies.loading import load_servable
    from server.slots import ServedVersion

    device = torch.device(args.device)
    for label, mode, ks in MODES:
        if mode == "on" and device.type != "cuda":
            out[label] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        if mode != "off" and device.type != "cuda" and not args.compile_on_cpu:
            out[label] = {"skipped": "compiled modes run on CUDA (--compile-on-cpu to try them here)"}
            continue
        version = ServedVersion(load_servable(str(folder), device=args.device))
        entry: dict[str, Any] = {"rows": []}
        if mode != "off":
            t0 = time.perf_counter()
            # on a CPU only "on" compiles ("auto" serves eager there): the same torch.compile, no graphs
            cpu_or_mode = "on" if device.type != "cuda" else mode
            compiled = version.start_compiled(cpu_or_mode, max(args.batches), buckets=tuple(args.batches))  # type: ignore[arg-type]
            if compiled is None:
                out[label] = {"skipped": f"--compile {mode} compiles nothing on {device.type}"}
                continue
            with autocast(device, args.bf16):
                compiled.join()
            entry.update(
                warm_up_s=round(time.perf_counter() - t0, 1),
                ready_buckets=sorted(compiled.ready),
                fallback_reason=compiled.failed,
            )
        for k in ks:
            for n in args.batches:
                row = time_served(args, version, robot, n, k)
                if mode != "off":
                    row["compiled_used"] = version.compiled is not None and version.compiled.usable(n)
                entry["rows"].append(row)
                print(f"  {label} K={k} batch {n}: {row['p50_ms']} ms p50, {row['chunks_per_s']} chunks/s")
        out[label] = entry
        del version
        if device.type == "cuda":
            torch.cuda.empty_cache()


def build_flowvla(folder: Path) -> tuple[Path, RobotSpec]:
    """Our FlowVLA at its default size with one 64 px camera + state (random weights)."""
    from bench.compile import save_flowvla
    from bench.inference import default_models

    return save_flowvla(folder, default_models()["64px camera + state"])


def bundle(out: Path) -> None:
    """Pack :data:`BUNDLE_PACKAGES` (with their dist-info) from this environment, and the PyAV stand-in,
    into ``out/site.tar.xz``."""
    from scripts.device_bundle import _copy_tree, _dist_info

    site = Path(next(s for s in sys.path if s.endswith("site-packages") and Path(s, "lerobot").is_dir()))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for module in BUNDLE_PACKAGES:
            if not (site / module).exists() and not (site / f"{module}.py").exists():
                raise SystemExit(f"{module}: not in {site}")
            if (site / module).is_dir():
                _copy_tree(site, module, stage)
            else:
                (stage / f"{module}.py").write_bytes((site / f"{module}.py").read_bytes())
            for info in _dist_info(site, module):
                _copy_tree(site, info.name, stage)
        (stage / "av").mkdir()
        (stage / "av" / "__init__.py").write_text(AV_STANDIN)
        with tarfile.open(out / "site.tar.xz", "w:xz") as tar:
            for path in sorted(stage.iterdir()):
                tar.add(path, arcname=path.name)
    print(f"wrote {out / 'site.tar.xz'} ({(out / 'site.tar.xz').stat().st_size / 2**20:.1f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda on the GPU machine, cpu to test here")
    p.add_argument(
        "--quick", action="store_true", help="tiny configurations, few repetitions (CPU self-test)"
    )
    p.add_argument(
        "--types", default="smolvla,pi0,flowvla", help="smolvla, pi0, pi05 (published sizes), flowvla (ours)"
    )
    p.add_argument("--sections", default="inference,awr,modes", help="inference, awr, modes (see above)")
    p.add_argument(
        "--compile-on-cpu", action="store_true", help="run the modes section's compiled rows on a CPU too"
    )
    p.add_argument("--image", type=int, default=256, help="the robot camera's side, px")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument(
        "--bundle", type=Path, default=None, help="pack what the GPU machine lacks into this folder"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.bundle is not None:
        bundle(args.bundle)
        return
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may download: the folders are built here
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    args.bf16 = not args.fp32 and args.device.startswith("cuda")
    args.batches = (1, 4) if args.quick else (1, 4, 16)
    args.warmup = 1 if args.quick else 3
    if args.quick:
        args.reps, args.train_batch, args.train_steps, args.image = 2, 4, 2, 64
    robot = spec(args.image)
    results: dict[str, Any] = {
        "environment": environment(args.device),
        "quick": args.quick,
        "bf16_autocast": args.bf16,
        "K": 10,
        "robot": robot.to_json(),
        "anchors": ANCHORS,
    }
    from bench.vla_models import parameter_count
    from policies.lerobot_flow import LeRobotFlowPolicy

    sections = {"inference": check_inference, "awr": check_awr}
    wanted = args.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="gpu_vla_") as tmp:
        for ptype in args.types.split(","):
            t0 = time.perf_counter()
            if ptype == "flowvla":  # ours: the modes section only (the others are LeRobot's calls)
                folder, ours = build_flowvla(Path(tmp) / ptype)
                results[ptype] = {
                    "parameters": parameter_count(folder),
                    "build_s": round(time.perf_counter() - t0, 1),
                }
                if "modes" in wanted:
                    run_section(
                        f"{ptype}/modes", lambda out, f=folder, r=ours: check_modes(args, f, r, out), results
                    )
                    write_results("gpu_vla", results, args.out)
                continue
            folder = build(ptype, Path(tmp) / ptype, robot, args.quick)
            fp = LeRobotFlowPolicy.load(folder, device=args.device)
            fp.eval()
            results[ptype] = {
                "parameters": parameter_count(folder),
                "build_s": round(time.perf_counter() - t0, 1),
            }
            print(f"{ptype}: {results[ptype]['parameters'] / 1e6:.1f}M parameters", flush=True)
            for name in wanted:
                run = (
                    (lambda out, f=folder: check_modes(args, f, robot, out))
                    if name == "modes"
                    else (lambda out, name=name, fp=fp: sections[name](args, fp, robot, out))
                )
                run_section(f"{ptype}/{name}", run, results)
                write_results("gpu_vla", results, args.out)
            del fp
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    rows = [
        [
            k.split("/")[0],
            r["batch"],
            r["p50_ms"],
            r["p90_ms"],
            r["chunks_per_s"],
            r["lerobot_predict"]["p50_ms"],
        ]
        for k, v in results.items()
        if k.endswith("/inference") and isinstance(v, dict)
        for r in v.get("batches", [])
    ]
    if rows:
        print(table(rows, ["policy", "batch", "p50 ms", "p90 ms", "chunks/s", "LeRobot predict p50 ms"]))
    mode_rows = [
        [
            k.split("/")[0],
            label,
            r["K"],
            r["batch"],
            r["p50_ms"],
            r["chunks_per_s"],
            r.get("compiled_used", ""),
        ]
        for k, v in results.items()
        if k.endswith("/modes") and isinstance(v, dict)
        for label, entry in v.items()
        if isinstance(entry, dict)
        for r in entry.get("rows", [])
    ]
    if mode_rows:
        print(table(mode_rows, ["policy", "mode", "K", "batch", "p50 ms", "chunks/s", "compiled used"]))
    path = write_results("gpu_vla", results, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

"""Action-chunk inference latency of the flow VLA vs denoising steps K and batch size (CPU or CUDA).

Randomly initialised models at the default size (what matters is the compute, not the weights):
state-only and one 64 px camera + state. Median of ``--repeats`` timed calls after warm-up.
Prints a markdown table and writes bench/results/inference.json.

    python bench/inference.py [--threads 2] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from vla_rl_client.spec import CameraSpec

from bench.common import table, write_results
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from policies.loading import pick_device


def obs_batch(cfg: FlowVLAConfig, b: int, device: torch.device) -> dict[str, object]:
    return {
        "state": torch.randn(b, cfg.state_dim, device=device),
        "cameras": {
            c.name: torch.randint(0, 255, (b, c.height, c.width, 3), dtype=torch.uint8, device=device)
            for c in cfg.cameras
        },
        "instruction_embedding": torch.randn(b, 384, device=device),
    }


def default_models() -> dict[str, FlowVLAConfig]:
    """The default-size flow VLA, state-only and with one 64 px camera (random weights)."""
    return {
        "state-only": FlowVLAConfig(state_dim=42, action_dim=4),
        "64px camera + state": FlowVLAConfig(
            state_dim=29, action_dim=4, cameras=(CameraSpec("base_camera", 64, 64),)
        ),
    }


def measure(
    name: str,
    cfg: FlowVLAConfig,
    device: torch.device,
    batches: tuple[int, ...],
    ks: tuple[int, ...],
    repeats: int,
) -> list[dict[str, object]]:
    """Median latency of ``predict_action_chunk`` per (batch, K) for a randomly initialised ``cfg``."""
    torch.manual_seed(0)
    policy = FlowVLAPolicy(cfg).to(device).eval()
    rows: list[dict[str, object]] = []
    for b in batches:
        obs = obs_batch(cfg, b, device)
        for k in ks:
            with torch.no_grad():
                for _ in range(3):
                    policy.predict_action_chunk(obs, num_steps=k)
                times = []
                for _ in range(repeats):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    policy.predict_action_chunk(obs, num_steps=k)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
            med = statistics.median(times)
            rows.append(
                {
                    "model": name,
                    "params": policy.num_parameters(),
                    "batch": b,
                    "K": k,
                    "median_ms": round(med, 2),
                    "chunks_per_s": round(b * 1e3 / med, 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    rows = []
    for name, cfg in default_models().items():
        rows += measure(name, cfg, device, (1, 8, 32), (1, 4, 10), args.repeats)
    print()
    print(
        table(
            [[r["model"], r["batch"], r["K"], r["median_ms"], r["chunks_per_s"]] for r in rows],
            ["model", "batch", "K", "median ms / call", "chunks/s"],
        )
    )
    print(
        f"\nwrote {write_results('inference', {'device': str(device), 'threads': args.threads, 'rows': rows}, args.out)}"
    )


if __name__ == "__main__":
    main()

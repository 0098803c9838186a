"""``vla-rl demo``: one pass of the loop on one machine, a smaller look than ``vla-rl up`` (vla_rl/up/).

    scripted demos -> episode store + metadata DB -> SFT -> push a tagged checkpoint to the embedded
    Hub-compatible registry -> pull it back by tag (hash-verified) -> evaluate in simulation

It starts its own registry on a free loopback port, so it needs nothing running beforehand. The whole
loop (policy server, fleet collector, simulated fleet, post-training rounds, live swaps) is ``vla-rl up``.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from sim.registry import resolve_task
from vla_rl.evaluation import EvalResult, evaluate
from vla_rl.hub.registry import configure_hub, push_folder
from vla_rl.hub.server import HubServer
from vla_rl.train.sft import SFTConfig, train_sft

log = logging.getLogger(__name__)


@dataclass
class DemoJobConfig:
    """One pass of the loop on this machine, nothing to start beforehand: record scripted demonstrations
    into a Zarr store + SQLite DB, train a flow-matching policy with SFT, push it as a tagged checkpoint
    to an embedded Hub-compatible registry, pull it back by tag and evaluate it in simulation (with a
    video). The workdir's outputs are cleared first."""

    workdir: Path = Path("runs/demo")
    """Everything goes here (store/, sft/, hub/, videos/); it is cleared at the start of each run."""
    task: str = "maniskill/PushCube-v1"
    """Simulated task (see `vla-rl sim list`)."""
    demos: int = 30
    """Scripted demonstrations to record."""
    noise: float = 0.3
    """Expert sloppiness for the demonstrations (see `vla-rl sim demos --help`)."""
    steps: int = 1500
    """SFT optimiser steps."""
    batch_size: int = 64
    """SFT batch size."""
    eval_episodes: int = 20
    """Held-out episodes to evaluate the pulled checkpoint on."""
    num_envs: int = 2
    """Simulator processes for demos and evaluation."""
    seed: int = 0
    """First demo seed; SFT seed."""
    repo: str = "demo/policy"
    """Registry repo the checkpoint is pushed to (tag sft-0)."""
    progress: bool = True
    """Show progress bars."""


@dataclass
class DemoJobResult:
    store: Path
    checkpoint_ref: str
    commit: str
    demo_success: float
    eval: EvalResult
    minutes: float


def run_demo(cfg: DemoJobConfig) -> DemoJobResult:
    t0 = time.perf_counter()
    task = resolve_task(cfg.task).name
    for sub in ("store", "sft", "hub", "videos"):
        shutil.rmtree(cfg.workdir / sub, ignore_errors=True)
    cfg.workdir.mkdir(parents=True, exist_ok=True)

    print(f"[1/4] recording {cfg.demos} scripted demonstrations of {task} (noise {cfg.noise})")
    db = MetadataDB.for_store(cfg.workdir / "store")
    store = EpisodeStore(cfg.workdir / "store", create=True, db=db)
    demos = record_demos(
        store,
        task,
        episodes=cfg.demos,
        noise=cfg.noise,
        seed=cfg.seed,
        num_envs=cfg.num_envs,
        progress=cfg.progress,
    )
    problems = store.verify(db=db)
    if problems:
        raise RuntimeError(f"store failed verification: {problems[:3]}")
    print(f"      {demos.episodes} episodes, {demos.frames} frames, expert success {demos.success_rate:.0%}")

    print(f"[2/4] training SFT for {cfg.steps} steps")
    result = train_sft(
        SFTConfig(
            task=task,
            store=store.root,
            out=cfg.workdir / "sft",
            steps=cfg.steps,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            checkpoint_every=cfg.steps,
            progress=cfg.progress,
            resume=False,
        )
    )
    print(f"      loss {result.first_loss:.3f} -> {result.final_loss:.3f} in {result.seconds / 60:.1f} min")

    token = secrets.token_hex(16)
    with HubServer(cfg.workdir / "hub", token=token) as hub:
        configure_hub(hub.url, token)
        print(f"[3/4] pushing the checkpoint to the embedded registry at {hub.url}")
        sha = push_folder(result.checkpoint, cfg.repo, message=f"sft {task}", tag="sft-0")
        ref = f"hub://{cfg.repo}@sft-0"
        print(f"      {ref} = commit {sha[:12]}")

        print(f"[4/4] evaluating {ref} on {cfg.eval_episodes} held-out episodes")
        policy = load_policy(ref, cache_dir=cfg.workdir / "hub-cache")
        ev = evaluate(
            policy,
            task,
            episodes=cfg.eval_episodes,
            num_envs=cfg.num_envs,
            video_dir=cfg.workdir / "videos",
            num_videos=1,
            progress=cfg.progress,
        )
    return DemoJobResult(
        store=store.root,
        checkpoint_ref=ref,
        commit=sha,
        demo_success=demos.success_rate,
        eval=ev,
        minutes=(time.perf_counter() - t0) / 60,
    )

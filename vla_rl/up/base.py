"""The deliberately weak base ``vla-rl up`` starts from: SFT on a few noisy scripted demos, pushed as
``base`` and ``prod`` once per workdir. FlowVLA learns from scratch on the task's state; a LeRobot VLA
(``--policy smolvla|pi0|pi05``) continues a small random folder of its architecture on the task's camera
(:mod:`vla_rl.up.lerobot`)."""

from __future__ import annotations

from pathlib import Path

from vla_rl.up.config import UpConfig
from vla_rl.up.lerobot import init_folder
from vla_rl.up.threads import training_threads


def seed_base(cfg: UpConfig, work: Path, store: Path, prod: str, db_url: str) -> None:
    """The deliberately weak base: SFT on a few noisy demos, pushed as ``base`` and ``prod`` (once)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    from fleet.db import MetadataDB
    from fleet.selection import EpisodeQuery
    from fleet.store import EpisodeStore
    from sim.demos import record_demos
    from vla_rl.hub.registry import push_folder, resolve
    from vla_rl.train.algorithms import make_config, train
    from vla_rl.train.presets import preset_config

    try:
        resolve(prod)
        return  # an earlier run seeded it
    except (RepositoryNotFoundError, RevisionNotFoundError):
        pass
    db = MetadataDB(db_url)
    s = EpisodeStore(store, create=True, db=db)
    if not db.query_episode_ids(EpisodeQuery(robots=("demo-*",)), limit=1):
        seen = f", {cfg.image_size} px camera" if cfg.lerobot else ""
        print(
            f"[base] recording {cfg.base_demos} scripted demos of {cfg.task} (noise {cfg.base_noise}{seen})",
            flush=True,
        )
        record_demos(
            s,
            cfg.task,
            episodes=cfg.base_demos,
            noise=cfg.base_noise,
            seed=cfg.seed,
            num_envs=1,
            progress=cfg.progress,
            robot_prefix="demo",
            **({"obs": "rgb", "image_size": cfg.image_size} if cfg.lerobot else {}),
        )
    values = {
        "store": store,
        "out": work / "base",
        "db_url": db_url,
        "task": cfg.task,
        "seed": cfg.seed,
        "progress": cfg.progress,
        "threads": training_threads(),
    }
    if cfg.base_steps is not None:
        values["steps"] = cfg.base_steps
    if cfg.lerobot:  # its VLM is random too: the whole policy trains
        values |= {"base": str(init_folder(cfg, work)), "init": "base", "trainable": "full"}
    sft = preset_config(cfg.base_preset, **values) if cfg.base_preset else make_config("sft", **values)
    print(f"[base] training SFT ({sft.steps} steps)", flush=True)
    result = train(sft)
    sha = push_folder(
        result.checkpoint, cfg.repo, message=f"base: sft on {cfg.base_demos} noisy demos", tag="base"
    )
    push_folder(result.checkpoint, cfg.repo, message="prod = base", tag="prod")
    print(f"[base] pushed hub://{cfg.repo}@base ({sha[:12]}) and prod", flush=True)

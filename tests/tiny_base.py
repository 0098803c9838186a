"""The tiny store + SFT base that the trainer tests start from (QAM, FQL, TACO; DIVL's and HELP's kinematic
data): scripted demos recorded into a fresh episode store, and a one-layer flow policy cloned from them
in a few steps. One place, so every test builds them the same way; each test picks its data and steps.

    store = demo_store(root / "store", "kinematic/Reach-v0", episodes=16, noise=0.8)
    store, ckpt = tiny_base(root, "kinematic/Reach-v0", episodes=4, noise=0.5, steps=10, batch_size=16)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleet.store import EpisodeStore

TINY_POLICY: dict[str, Any] = {
    "d_model": 32,
    "n_layers": 1,
    "expert_n_layers": 1,
    "n_heads": 2,
    "chunk_len": 4,
    "n_exec": 2,
    "instruction_encoder": "none",
}
"""The tiny flow policy: d_model 32, one trunk and one expert layer, H = 4 (2 executed), no text encoder."""


def demo_store(
    root: Path, task: str, episodes: int, noise: float, seed: int = 0, max_episode_steps: int | None = None
) -> EpisodeStore:
    """A new store at ``root`` holding ``episodes`` scripted demos of ``task`` at ``noise`` (seeds from
    ``seed``), one simulator process."""
    from sim.demos import record_demos

    store = EpisodeStore(root, create=True)
    record_demos(
        store,
        task,
        episodes=episodes,
        noise=noise,
        seed=seed,
        max_episode_steps=max_episode_steps,
        progress=False,
    )
    return store


def tiny_sft(task: str, store: Path, out: Path, steps: int, batch_size: int, **knobs: Any) -> Path:
    """Behaviour-clone :data:`TINY_POLICY` (``knobs`` override any SFT field) on ``store`` for ``steps``
    updates, one thread; returns the final checkpoint folder."""
    from vla_rl.train.sft import SFTConfig, train_sft

    values: dict[str, Any] = {**TINY_POLICY, "checkpoint_every": steps, "threads": 1, "progress": False}
    values.update(knobs)
    cfg = SFTConfig(task=task, store=store, out=out, steps=steps, batch_size=batch_size, **values)
    return train_sft(cfg).checkpoint


def tiny_base(
    root: Path,
    task: str,
    *,
    episodes: int,
    noise: float,
    steps: int,
    batch_size: int,
    max_episode_steps: int | None = None,
) -> tuple[EpisodeStore, Path]:
    """:func:`demo_store` at ``root/store`` and :func:`tiny_sft` on it at ``root/sft``: (store, checkpoint)."""
    store = demo_store(root / "store", task, episodes, noise, max_episode_steps=max_episode_steps)
    return store, tiny_sft(task, store.root, root / "sft", steps, batch_size)

"""Evaluate a chunk policy without a simulator: action error against recorded (held-out) episodes.

For every frame of the given episodes (or a seeded subsample of ``max_frames``), the policy predicts its
chunk from the recorded observation (state, cameras, the episode's instruction) and is compared with
the recorded next ``H`` actions in the *normalised* action space (the policy's own normaliser, so every
dimension counts alike whatever its units). Past an episode's end the chunk is padded (the last action
repeated, as in training) and padded steps do not count. Reported: MSE overall, per action dimension,
per chunk step, per task and per instruction, plus the flow-matching validation loss on the same frames
(seeded noise and time) when the policy is a flow VLA. Everything is deterministic given ``seed``.

With ``chunk_score`` (e.g. a learned success estimate, :mod:`vla_rl.train.success`), each predicted chunk
is also scored against its recorded observation, and the mean score is reported per episode and over
the episodes (each episode counting alike).

This is what a post-training round reports when its task is not a simulator task (real robot data,
e.g. a LeRobot import), and gates on: the action MSE, or the success estimate where the store holds
outcomes (:mod:`vla_rl.gate_success`); see :func:`vla_rl.rounds.run_round`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from fleet.dataset import ChunkDataset, labelled_instructions
from fleet.store import EpisodeStore


@dataclass
class OfflineEvalResult:
    episode_ids: list[str]
    frames: int
    """Frames evaluated (each one chunk prediction)."""
    chunk_len: int
    action_mse: float
    """Mean squared error over every valid (frame, step, dim) element, normalised action space."""
    per_dim: list[float]
    per_step: list[float]
    per_task: dict[str, float]
    per_instruction: dict[str, float]
    val_loss: float | None
    """Flow-matching loss on the same frames (seeded noise/time); None when the policy has none."""
    seed: int
    seconds: float
    tasks: list[str] = field(default_factory=list)
    per_episode: dict[str, float] = field(default_factory=dict)
    """Episode id -> its MSE (what the gate's paired sign test compares, episode by episode)."""
    score: float | None = None
    """Mean ``chunk_score`` over the episodes (each episode's frames averaged first); None without one."""
    per_episode_score: dict[str, float] = field(default_factory=dict)
    """Episode id -> the mean ``chunk_score`` of its frames."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        vl = "n/a" if self.val_loss is None else f"{self.val_loss:.4f}"
        return (
            f"offline eval on {len(self.episode_ids)} episodes ({self.frames} frames, chunk {self.chunk_len}): "
            f"action MSE {self.action_mse:.4f}, val loss {vl}, {self.seconds:.1f} s"
        )

    def table(self) -> str:
        """Per-dimension, per-step and per-task MSE as plain text."""
        lines = [self.summary(), "", f"{'action dim':<24}{'MSE':>10}"]
        lines += [f"{f'a[{i}]':<24}{v:>10.4f}" for i, v in enumerate(self.per_dim)]
        lines += ["", f"{'chunk step':<24}{'MSE':>10}"]
        lines += [f"{f'h={i}':<24}{v:>10.4f}" for i, v in enumerate(self.per_step)]
        lines += ["", f"{'task':<24}{'MSE':>10}"]
        lines += [f"{k:<24}{v:>10.4f}" for k, v in self.per_task.items()]
        lines += ["", f"{'instruction':<40}{'MSE':>10}"]
        lines += [f"{k[:39]:<40}{v:>10.4f}" for k, v in self.per_instruction.items()]
        return "\n".join(lines)


def is_sim_task(task: str) -> bool:
    """Whether ``task`` names a simulator task (else evaluation has to be offline, on recorded episodes)."""
    from sim.registry import sim_task_name

    return sim_task_name(task) is not None


def action_normalizer(policy: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(offset, scale) of the policy's action normalisation, or None for the identity."""
    norm = getattr(getattr(policy, "policy", None), "normalizer", None)
    if norm is None:
        return None
    return (
        norm.action_offset.detach().float().cpu().numpy(),
        norm.action_scale.detach().float().cpu().numpy(),
    )


def held_out_episodes(episode_ids: Sequence[str], n: int) -> list[str]:
    """The round's offline evaluation set: the last ``n`` of ``episode_ids`` (oldest first, so the most
    recent ones), at least one."""
    return list(episode_ids)[-max(1, n) :]


def _masked_mean(err: np.ndarray, valid: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    w = np.broadcast_to(valid, err.shape)
    return (err * w).sum(axis) / np.maximum(w.sum(axis), 1)


def evaluate_offline(
    policy: Any,
    store: EpisodeStore,
    episode_ids: Sequence[str],
    *,
    seed: int = 0,
    max_frames: int | None = None,
    batch_size: int = 64,
    val_loss: bool = True,
    labels: Mapping[str, Mapping[str, Any]] | None = None,
    chunk_score: Callable[[Mapping[str, Any], np.ndarray], np.ndarray] | None = None,
) -> OfflineEvalResult:
    """Predict each frame's chunk of ``episode_ids`` from its recorded observation and compare it with the
    recorded next ``policy.chunk_len`` actions (see the module docstring). ``max_frames`` evaluates a
    seeded subsample of the frames instead of all. Chunks are predicted in batches with seed
    ``seed + batch number``. ``labels`` (the episodes' current DB labels, ``MetadataDB.current_labels``):
    a LeRobot episode whose task changes mid-way conditions each frame on its own task, as in training.
    ``chunk_score(obs, predicted chunks [B, H, A]) -> [B]``: a score of each predicted chunk (module
    docstring)."""
    t0 = time.perf_counter()
    if not episode_ids:
        raise ValueError("episode_ids: expected at least one episode to evaluate on")
    horizon = int(policy.chunk_len)
    spec = policy.spec
    ds = ChunkDataset(
        store,
        horizon,
        episode_ids=list(episode_ids),
        closed_only=False,
        cameras=bool(spec.cameras),
        instructions=labelled_instructions(labels) if labels is not None else None,
    )
    if ds.spec.state_dim != spec.state_dim or ds.spec.action_dim != spec.action_dim:
        raise ValueError(
            f"policy spec {spec.name} (state {spec.state_dim}, action {spec.action_dim}) does not match the "
            f"episodes' spec {ds.spec.name} (state {ds.spec.state_dim}, action {ds.spec.action_dim})"
        )
    missing = set(spec.camera_names) - set(ds.spec.camera_names)
    if missing:
        raise ValueError(
            f"cameras: the policy needs {sorted(missing)}, the episodes record {list(ds.spec.camera_names)}"
        )
    tasks_of = [store.read_metadata(e).task for e in ds.episode_ids]
    idx = np.arange(len(ds))
    if max_frames is not None and max_frames < len(ds):
        idx = np.sort(np.random.default_rng(seed).choice(len(ds), size=max_frames, replace=False))
    norm = action_normalizer(policy)
    model = getattr(policy, "policy", None)
    want_loss = val_loss and hasattr(model, "flow_matching_loss")
    errs, valids, ep_of, instr_of, losses, scores = [], [], [], [], [], []
    for bi, start in enumerate(range(0, len(idx), batch_size)):
        b = ds.batch(idx[start : start + batch_size])
        instr = [ds.instruction(int(i)) for i in idx[start : start + batch_size]]
        obs = {
            "state": b["observation.state"].numpy(),
            "cameras": {c: b[f"observation.images.{c}"].numpy() for c in spec.camera_names},
            "instruction": instr,
        }
        pred = np.asarray(policy.predict_chunks(obs, seed=seed + bi), dtype=np.float64)
        if chunk_score is not None:
            scores.append(np.asarray(chunk_score(obs, pred), np.float64))
        target = b["action"].numpy().astype(np.float64)
        if norm is not None:
            pred, target = (pred - norm[0]) / norm[1], (target - norm[0]) / norm[1]
        errs.append((pred - target) ** 2)
        valids.append(~b["action_is_pad"].numpy())
        ep_of.append(b["episode_index"].numpy())
        instr_of += instr
        if want_loss:
            assert model is not None
            n = len(instr)
            gen = torch.Generator().manual_seed(seed + bi)
            noise = torch.randn((n, horizon, spec.action_dim), generator=gen)
            t = torch.rand((n,), generator=gen) * 0.999
            was_training = model.training
            model.eval()
            with torch.no_grad():
                batch = {**obs, "action": b["action"], "action_is_pad": b["action_is_pad"]}
                _, m = model.flow_matching_loss(batch, noise=noise, time=t)
            model.train(was_training)
            losses.append((float(m["mse"]), n))
    err = np.concatenate(errs)  # [N, H, A]
    valid = np.concatenate(valids)[..., None].astype(np.float64)  # [N, H, 1]
    episode = np.concatenate(ep_of)
    task_arr = np.array([tasks_of[e] for e in episode])
    id_arr = np.array([ds.episode_ids[e] for e in episode])
    instr_arr = np.array(instr_of)

    def group(keys: np.ndarray) -> dict[str, float]:
        return {
            str(k): float(_masked_mean(err[keys == k], valid[keys == k], (0, 1, 2)))
            for k in sorted(set(keys.tolist()))
        }

    return OfflineEvalResult(
        episode_ids=list(ds.episode_ids),
        frames=len(idx),
        chunk_len=horizon,
        action_mse=float(_masked_mean(err, valid, (0, 1, 2))),
        per_dim=[float(v) for v in _masked_mean(err, valid, (0, 1))],
        per_step=[float(v) for v in _masked_mean(err, valid, (0, 2))],
        per_task=group(task_arr),
        per_instruction=group(instr_arr),
        val_loss=(sum(v * n for v, n in losses) / sum(n for _, n in losses)) if losses else None,
        seed=seed,
        seconds=time.perf_counter() - t0,
        tasks=sorted(set(tasks_of)),
        per_episode=group(id_arr),
        **_episode_scores(scores, id_arr),
    )


def _episode_scores(scores: list[np.ndarray], episode: np.ndarray) -> dict[str, Any]:
    """``score`` and ``per_episode_score`` of :class:`OfflineEvalResult` (empty without scores)."""
    if not scores:
        return {}
    s = np.concatenate(scores)
    per = {str(e): float(s[episode == e].mean()) for e in sorted(set(episode.tolist()))}
    return {"score": float(np.mean(list(per.values()))), "per_episode_score": per}

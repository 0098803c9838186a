"""Read the episode store as torch tensors for training.

Images stay uint8 channels-last ``[H, W, 3]`` as stored: converting to float CHW is the policy's
preprocessing (it knows its normalisation), and uint8 keeps loaded datasets 4x smaller.
Only committed frames are ever read (see :mod:`fleet.store`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from vla_rl_client.meta import TASK_RUNS_LABEL, frame_instructions

from fleet.store import Episode, EpisodeStore


def labelled_instructions(labels: Mapping[str, Mapping[str, Any]]) -> Callable[[Episode], list[str]]:
    """The ``instructions`` of :class:`ChunkDataset` from the episodes' current labels
    (``MetadataDB.current_labels``): each frame's instruction by :func:`frame_instructions`."""

    def instructions(ep: Episode) -> list[str]:
        runs = labels.get(ep.meta.episode_id, {}).get(TASK_RUNS_LABEL)
        return frame_instructions(ep.length, ep.meta.instruction, runs)

    return instructions


def episode_tensors(ep: Episode) -> dict[str, Any]:
    """One episode as tensors (sharing memory with the numpy arrays) plus its id, task and revisions."""
    return {
        "episode_id": ep.meta.episode_id,
        "task": ep.meta.task,
        "revisions": list(ep.meta.revisions),
        "cameras": {name: torch.from_numpy(img) for name, img in ep.cameras.items()},
        **{
            key: torch.from_numpy(getattr(ep, key))
            for key in (
                "state",
                "action",
                "proposed_action",
                "reward",
                "terminated",
                "truncated",
                "controller",
                "segment",
                "revision",
                "timestamp",
            )
        },
    }


def _select(
    store: EpisodeStore, episode_ids: Iterable[str] | None, task: str | None, closed_only: bool
) -> list[str]:
    ids = store.episode_ids() if episode_ids is None else list(episode_ids)
    out = []
    for eid in ids:
        meta = store.read_metadata(eid)
        if (task is None or meta.task == task) and (meta.is_closed or not closed_only):
            out.append(eid)
    return out


def iter_episode_tensors(
    store: EpisodeStore,
    *,
    episode_ids: Iterable[str] | None = None,
    task: str | None = None,
    closed_only: bool = True,
    cameras: bool = True,
) -> Iterator[dict[str, Any]]:
    """Yield selected episodes (all, or ``episode_ids``; filtered by task / closed) as :func:`episode_tensors`."""
    for eid in _select(store, episode_ids, task, closed_only):
        yield episode_tensors(store.read_episode(eid, cameras=cameras))


class ChunkDataset(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length action-chunk samples, one per committed frame of the selected episodes.

    Sample ``i`` (frame ``t`` of episode ``e``) holds the observation at ``t``
    (``observation.state`` float32 [S], ``observation.images.<camera>`` uint8 [H, W, 3]),
    ``action`` float32 [horizon, A] = actions ``t .. t+horizon-1`` with the episode's last action
    repeated past its end, ``action_is_pad`` bool [horizon] marking those repeats, and ``reward``
    (float32), ``controller`` (int64, :class:`vla_rl_client.meta.Controller` code), ``episode_index``
    (into :attr:`episode_ids`), ``frame_index`` (int64) and ``instruction_index`` (int64, into
    :attr:`instructions`: the frame's language instruction). Keys follow LeRobot's naming.

    The instruction is per frame: each frame takes its episode's ``EpisodeMeta.instruction`` (what the
    robot was told; LeRobot import sets it from the episode's task string), so a multi-instruction
    dataset conditions each sample on its own instruction rather than on the spec's one; with
    ``instructions`` (a function of the episode returning its T frames' strings, e.g.
    :func:`labelled_instructions` for LeRobot episodes whose task changes mid-way), each frame its own.

    ``keep`` (optional) says which frames of an episode are samples: a function of the episode returning
    a bool mask [T] (e.g. SFT drops frames in ``idle`` span labels, see
    :func:`vla_rl.train.transitions.span_effects`). Dropped frames are not samples and the kept ones
    split into contiguous runs: an action chunk never crosses a dropped stretch (past a run's end the
    run's last action is repeated and ``action_is_pad`` is set, as at an episode's end);
    ``frame_index`` stays the frame's index in its episode. An episode with no kept frame is left out.

    All committed frames are loaded into memory at construction: fine for our dataset sizes
    (100k frames of two 128x128 cameras is ~10 GB; use ``cameras=False`` for state-only training).
    Every selected episode must have the same spec.
    """

    def __init__(
        self,
        store: EpisodeStore,
        horizon: int,
        *,
        episode_ids: Iterable[str] | None = None,
        task: str | None = None,
        closed_only: bool = True,
        cameras: bool = True,
        keep: Callable[[Episode], np.ndarray] | None = None,
        instructions: Callable[[Episode], Sequence[str]] | None = None,
    ) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.horizon = horizon
        self.episode_ids = _select(store, episode_ids, task, closed_only)
        episodes = [store.read_episode(eid, cameras=cameras) for eid in self.episode_ids]
        episodes = [ep for ep in episodes if ep.length]
        masks = [_keep_mask(keep, ep) for ep in episodes]
        kept = [i for i, m in enumerate(masks) if m is None or m.any()]
        episodes, masks = [episodes[i] for i in kept], [masks[i] for i in kept]
        self.episode_ids = [ep.meta.episode_id for ep in episodes]
        if not episodes:
            raise ValueError(f"no episodes with frames selected from {store}")
        spec = episodes[0].meta.spec
        for ep in episodes[1:]:
            if ep.meta.spec != spec:
                raise ValueError(
                    f"episode {ep.meta.episode_id} has spec {ep.meta.spec.name!r}, not {spec.name!r}"
                )
        self.spec = spec
        # the kept frames of each episode, in order: their index in the episode
        frames = [
            np.flatnonzero(m) if m is not None else np.arange(ep.length)
            for ep, m in zip(episodes, masks, strict=True)
        ]
        lengths = np.array([len(f) for f in frames])
        self._episode_of = np.repeat(np.arange(len(episodes)), lengths)
        self._frame = np.concatenate(frames).astype(np.int64)
        # runs of consecutive kept frames (a whole episode without ``keep``): each frame's run end, the
        # global index one past the run's last frame, where its action chunk stops
        new_run = np.ones(len(self._frame), bool)
        new_run[1:] = (self._episode_of[1:] != self._episode_of[:-1]) | (np.diff(self._frame) != 1)
        run_start = np.flatnonzero(new_run)
        run_end = np.append(run_start[1:], len(self._frame))
        self._run_end = np.repeat(run_end, run_end - run_start)

        def cat(arrays: Iterable[np.ndarray]) -> np.ndarray:
            return np.concatenate(
                [a if len(f) == len(a) else a[f] for a, f in zip(arrays, frames, strict=True)]
            )

        self._state = cat(ep.state for ep in episodes)
        self._action = cat(ep.action for ep in episodes)
        self._reward = cat(ep.reward for ep in episodes)
        self._controller = cat(ep.controller for ep in episodes).astype(np.int64)
        # Distinct instruction strings (sorted, so the index is stable for a given set of episodes) and
        # each frame's index into them. Per frame so that a store with per-frame instructions fits here.
        per_frame = [_frame_texts(instructions, ep, f) for ep, f in zip(episodes, frames, strict=True)]
        self.instructions: tuple[str, ...] = tuple(sorted({t for texts in per_frame for t in texts}))
        code = {text: i for i, text in enumerate(self.instructions)}
        self._instruction = np.array([code[t] for texts in per_frame for t in texts], dtype=np.int64)
        self._images = {c: cat(ep.cameras[c] for ep in episodes) for c in episodes[0].cameras}

    def __len__(self) -> int:
        return len(self._episode_of)

    @property
    def states(self) -> np.ndarray:
        """Every selected frame's state, float32 [N, S] (read-only view; e.g. for normalisation stats)."""
        v = self._state.view()
        v.flags.writeable = False
        return v

    @property
    def actions(self) -> np.ndarray:
        """Every selected frame's executed action, float32 [N, A] (read-only view)."""
        v = self._action.view()
        v.flags.writeable = False
        return v

    def instruction(self, i: int) -> str:
        """The language instruction of sample ``i``."""
        return self.instructions[int(self._instruction[i])]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return {k: v[0] for k, v in self.batch(np.array([i % len(self)])).items()}

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Samples ``indices`` stacked along a leading batch dim, gathered in one vectorised step.

        Faster than a DataLoader over ``__getitem__`` on a few CPU cores: training samples random
        index batches from this directly.
        """
        idx = np.asarray(indices, dtype=np.int64)
        e = self._episode_of[idx]
        end = self._run_end[idx]
        window = idx[:, None] + np.arange(self.horizon)[None, :]
        out = {
            "observation.state": torch.from_numpy(self._state[idx]),
            "action": torch.from_numpy(self._action[np.minimum(window, end[:, None] - 1)]),
            "action_is_pad": torch.from_numpy(window >= end[:, None]),
            "reward": torch.from_numpy(self._reward[idx]),
            "controller": torch.from_numpy(self._controller[idx]),
            "episode_index": torch.from_numpy(e.astype(np.int64)),
            "frame_index": torch.from_numpy(self._frame[idx]),
            "instruction_index": torch.from_numpy(self._instruction[idx]),
        }
        for name, imgs in self._images.items():
            out[f"observation.images.{name}"] = torch.from_numpy(imgs[idx])
        return out


def _keep_mask(keep: Callable[[Episode], np.ndarray] | None, ep: Episode) -> np.ndarray | None:
    """``keep(ep)`` checked: a bool mask [T] (None when nothing is dropped)."""
    if keep is None:
        return None
    m = np.asarray(keep(ep), dtype=bool)
    if m.shape != (ep.length,):
        raise ValueError(
            f"keep: expected a bool mask of {ep.length} frames for {ep.meta.episode_id}, got {m.shape}"
        )
    return None if m.all() else m


def _frame_texts(
    instructions: Callable[[Episode], Sequence[str]] | None, ep: Episode, frames: np.ndarray
) -> list[str]:
    """The kept ``frames``' instructions of ``ep`` (its own one for all without ``instructions``)."""
    if instructions is None:
        return [ep.meta.instruction] * len(frames)
    texts = list(instructions(ep))
    if len(texts) != ep.length:
        raise ValueError(
            f"instructions: expected {ep.length} strings for episode {ep.meta.episode_id}, got {len(texts)}"
        )
    return [texts[int(i)] for i in frames]

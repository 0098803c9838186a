"""Chunked transitions for offline-to-online RL, with intervention-aware credit assignment.

A sample at frame ``t`` of an episode holds what every post-training algorithm needs::

    observation at t, action chunk a_{t:t+H} (padded past the end), the n-step discounted reward
    R = sum_{k<n} gamma^k r_{t+k}, the observation at t+n, done / bootstrap mask / valid flags,
    the controller of frame t (policy, human, scripted), the credit label, the Monte-Carlo return.

Rewards (``RewardKind``):

* ``sparse``: 1 on the frame whose action succeeded (the episode's terminal success), else 0;
* ``steps_to_go`` (RECAP): ``-1 / T_max`` per step and ``-1`` more on the last frame of a failure,
  so returns are minus the normalised time to success (in [-1, 0]) or below -1 for failures;
* ``dense``: the shaped reward the simulator recorded in the store (when present);
* ``shaped``: ``sparse`` plus potential-based shaping with that dense reward as the potential Φ
  (Ng et al. 1999): ``r_t = 1[success at t] + γ Φ(s_{t+1}) − Φ(s_t)``, Φ = 0 at reset and at a
  terminal state. The same reward as PPO's ``dense`` setting; it keeps the sparse task's optimal
  policy (summing the raw dense reward instead pays for hovering near the goal rather than finishing).

**Credit assignment** (HABC / HELP / LWD, docs/algorithms.md §4): an episode's outcome is credited
only to frames the policy (or a scripted controller) drove, and never across an intervention
boundary. A policy segment that ends in a human takeover gets outcome *failure* (the operator judged
it failing); the final autonomous segment gets the episode outcome; human frames get no outcome
(``credit = -1``) and are kept as positive behaviour cloning by the trainers. Monte-Carlo returns are
cut the same way: a segment ended by a takeover is scored as if it failed at the takeover.

**Labels** (from the metadata DB, when the buffer is built with one; the current values, never undone
ones). An episode's ``outcome`` label overrides its recorded success (``success`` -> 1, anything else
-> 0) for the sparse / steps-to-go rewards and the credit. Span labels of key ``segment`` (HELP's
segment classes, ``fleet/labels.toml``) over frames ``[s, e)`` change credit assignment, with
``A`` = the set of non-human frames:

* ``idle``: frames in ``[s, e)`` are dropped from the samples (after rewards, credit and returns were
  computed on the whole episode: the time they took still counts in the returns). The kept frames
  split into contiguous runs; an n-step window or action chunk never crosses a dropped stretch (a
  run ends like a non-terminal episode end: ``bootstrap = 0``, ``valid = 0`` past it);
* ``failure-inducing``: let ``f = max{t in A : t < e}`` (the last autonomous frame before the span's
  end). The autonomous stretch ending at ``f`` is scored as in a takeover at ``f + 1``:
  ``credit[i..f] = 0`` and ``cut[f] = 1``, i.e. ``G_f = r_f + c_fail`` (``c_fail`` = 0, or -1 for
  ``steps_to_go``) and ``G_t = r_t + γ G_{t+1}`` back to the stretch's start ``i``; frames after
  ``f`` start a new stretch credited by what follows it;
* ``recovery``: kept as positive behaviour cloning: never dropped (it wins over ``idle``), never
  scored as a failure (``credit = 1`` on its autonomous frames, human frames keep ``-1``), and
  ``bc = 1`` on all its frames (the buffer's ``bc`` array / batch key: human or recovery frames, the
  ones a trainer should clone). ``progress`` spans change nothing.

**Language**: every frame carries its instruction (``instruction_index`` into the buffer's
``instructions``, the distinct strings in order of first appearance): a stored episode's frames take its
``EpisodeMeta.instruction`` (the robot's task string; LeRobot import sets it from the dataset's task), an
online episode the one it was given (the simulator's, by default the spec's). The trainers embed
``instructions`` once (:func:`vla_rl.train.common.instruction_table`) and each sample gathers its row,
as SFT does with :class:`fleet.dataset.ChunkDataset`.

Episodes come from the store + metadata DB through a :class:`fleet.selection.Selection` (task, robots,
time range, checkpoint revisions, rounds, labels, outcome, ...; evaluated in SQL), or are appended online
(:meth:`add_episode`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from vla_rl_client.meta import TASK_RUNS_LABEL, Controller, frame_instructions
from vla_rl_client.spec import RobotSpec

from fleet import store_index
from fleet.db import MetadataDB, effective_outcome
from fleet.selection import Selection
from fleet.store import Episode, EpisodeStore

RewardKind = Literal["sparse", "steps_to_go", "dense", "shaped"]
REWARD_KINDS: tuple[str, ...] = get_args(RewardKind)
NO_CREDIT = -1
SPAN_KEY = "segment"
"""The span-label key whose values (below) change credit assignment (see the module docstring)."""
SpanType = Literal["progress", "idle", "failure-inducing", "recovery"]
SPAN_TYPES: tuple[str, ...] = get_args(SpanType)

__all__ = [
    "REWARD_KINDS",
    "SPAN_KEY",
    "SPAN_TYPES",
    "RewardKind",
    "TransitionBuffer",
    "credit_labels",
    "load_transitions",
    "next_observation",
    "select_episode_ids",
    "span_effects",
    "step_rewards",
]


# ---------------------------------------------------------------------------- selection
def select_episode_ids(store: EpisodeStore, selection: Selection, db: MetadataDB | None = None) -> list[str]:
    """Closed episodes of ``selection.task`` that ``selection`` selects, oldest first, evaluated in SQL by
    the metadata DB (:func:`fleet.store_index.select_episode_ids`: ``db``, else the store's own, else a
    throwaway index of the store). ValueError when the selection has no task, or selects nothing (with
    how to record data for the task)."""
    if not selection.task:
        raise ValueError("task: expected a task id, e.g. maniskill/PickCube-v1")
    ids = store_index.select_episode_ids(store, selection, db)
    if not ids:
        from sim.registry import sim_task_name

        hint = (
            f"record data with: vla-rl sim demos --task {selection.task}"
            if sim_task_name(selection.task) is not None
            else "import robot data with: vla-rl store import-lerobot DATASET STORE"
        )
        shown = ",".join(filter(None, [f"task={selection.task}", selection.to_text()]))
        raise ValueError(f"no closed episodes in {store.root} match {shown}; check the selection, or {hint}")
    return ids


def load_transitions(
    store: EpisodeStore | str | Path,
    selection: Selection,
    *,
    db: MetadataDB | None = None,
    reward: RewardKind = "sparse",
    gamma: float = 0.99,
    max_steps: int | None = None,
    cameras: bool = True,
) -> TransitionBuffer:
    """Select episodes and load them as a buffer. Without ``db``, the store's own DB (the SQLite file of a
    local store, when there is one) selects them and its labels reach training."""
    store = store if isinstance(store, EpisodeStore) else EpisodeStore(store)
    db = store_index.store_db(store, db)
    ids = select_episode_ids(store, selection, db)
    return TransitionBuffer.from_store(
        store, ids, reward=reward, gamma=gamma, max_steps=max_steps, cameras=cameras, db=db
    )


def _instructions(ep: Episode, labels: Mapping[str, Any]) -> str | list[str]:
    """An episode's instruction, or one per frame where a LeRobot import recorded task runs."""
    runs = labels.get(TASK_RUNS_LABEL)
    return frame_instructions(ep.length, ep.meta.instruction, runs) if runs else ep.meta.instruction


# ---------------------------------------------------------------------------- rewards and credit
def step_rewards(
    kind: RewardKind,
    *,
    stored_reward: np.ndarray,
    success: bool,
    terminated: np.ndarray,
    max_steps: int,
    gamma: float = 0.99,
) -> np.ndarray:
    """Per-frame rewards ``[T]`` of one episode under ``kind`` (see the module docstring).

    ``stored_reward[t]`` is the sim's dense reward after frame t's action, i.e. Φ(s_{t+1}).
    """
    t = len(stored_reward)
    if kind == "dense":
        return stored_reward.astype(np.float32)
    r = np.zeros(t, dtype=np.float32)
    if kind in ("sparse", "shaped"):
        if success and t:
            r[t - 1] = 1.0
        if kind == "shaped" and t:
            phi_next = np.where(terminated, 0.0, stored_reward).astype(np.float64)
            phi = np.concatenate([[0.0], stored_reward[:-1]]).astype(np.float64)
            r += (gamma * phi_next - phi).astype(np.float32)
        return r
    if kind == "steps_to_go":
        r[:] = -1.0 / max_steps
        if not success and t:
            r[t - 1] -= 1.0
        return r
    raise ValueError(f"reward: expected one of {list(REWARD_KINDS)}, got {kind!r}")


def credit_labels(
    controller: np.ndarray, success: bool, failure_at: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame outcome credit and credit-segment ends for one episode.

    Returns ``credit`` int8 ``[T]`` (1 success, 0 failure, -1 no credit: human frames) and ``cut`` bool
    ``[T]``: True on the last frame of an autonomous stretch that a human took over from, or that
    ``failure_at`` names (a ``failure-inducing`` span's last autonomous frame, see
    :func:`span_effects`): returns are cut there and that stretch is scored as a failure.
    """
    human = np.asarray(controller) == int(Controller.HUMAN)
    t = len(human)
    forced = np.zeros(t, dtype=bool)
    for f in failure_at:
        if 0 <= f < t and not human[f]:
            forced[f] = True
    credit = np.full(t, NO_CREDIT, dtype=np.int8)
    cut = np.zeros(t, dtype=bool)
    i = 0
    while i < t:
        j = i
        while j < t and human[j] == human[i] and not (j > i and forced[j - 1]):
            j += 1
        if not human[i]:
            failed = (j < t and human[j]) or forced[j - 1]  # taken over, or a failure-inducing span
            credit[i:j] = 0 if failed else int(success)
            cut[j - 1] = failed
        i = j
    return credit, cut


def span_effects(
    length: int, controller: np.ndarray, spans: Sequence[tuple[str, int, int]]
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """What an episode's ``segment`` span labels ``(type, start, end)`` do (module docstring): returns
    ``keep`` bool ``[T]`` (False in idle spans not covered by a recovery span), the frames where a
    ``failure-inducing`` span ends an autonomous stretch as a failure (for :func:`credit_labels`), and
    ``recovery`` bool ``[T]``. Spans are clipped to the episode; unknown types raise ValueError."""
    human = np.asarray(controller) == int(Controller.HUMAN)
    idle = np.zeros(length, dtype=bool)
    recovery = np.zeros(length, dtype=bool)
    failure_at: list[int] = []
    for kind, start, end in spans:
        if kind not in SPAN_TYPES:
            raise ValueError(f"span label {SPAN_KEY}: expected one of {', '.join(SPAN_TYPES)}, got {kind!r}")
        a, b = max(0, int(start)), min(length, int(end))
        if b <= a:
            continue
        if kind == "idle":
            idle[a:b] = True
        elif kind == "recovery":
            recovery[a:b] = True
        elif kind == "failure-inducing":
            auto = np.flatnonzero(~human[:b])
            if len(auto):
                failure_at.append(int(auto[-1]))
    return ~(idle & ~recovery), sorted(set(failure_at)), recovery


def _discounted_returns(r: np.ndarray, cut: np.ndarray, gamma: float, cut_value: float) -> np.ndarray:
    """Returns-to-go restarting at every ``cut`` frame (which gets ``r + cut_value`` as its tail)."""
    out = np.zeros(len(r), dtype=np.float64)
    g = 0.0
    for i in range(len(r) - 1, -1, -1):
        g = r[i] + (cut_value if cut[i] else gamma * g)
        out[i] = g
    return out.astype(np.float32)


# ---------------------------------------------------------------------------- buffer
class TransitionBuffer:
    """In-memory frames of many episodes, sampled as chunked n-step transitions.

    Build from the store with :meth:`from_store`, or empty and :meth:`add_episode` (online replay).
    ``reward`` / ``gamma`` / ``max_steps`` fix how rewards and Monte-Carlo returns are computed.
    """

    def __init__(
        self,
        spec: RobotSpec,
        *,
        reward: RewardKind = "sparse",
        gamma: float = 0.99,
        max_steps: int = 100,
        cameras: bool = True,
    ) -> None:
        if reward not in REWARD_KINDS:
            raise ValueError(f"reward: expected one of {list(REWARD_KINDS)}, got {reward!r}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma: expected in (0, 1], got {gamma}")
        self.spec, self.reward_kind, self.gamma, self.max_steps = spec, reward, gamma, max_steps
        self.use_cameras = cameras and bool(spec.cameras)
        self.episode_ids: list[str] = []
        self.episode_success: list[bool] = []
        self.instructions: list[str] = []
        """The distinct instructions, in order of first appearance (``instruction_index`` points here)."""
        self._instruction_code: dict[str, int] = {}
        self._parts: list[dict[str, np.ndarray]] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._dirty = False
        self._runs = 0  # contiguous runs of frames so far (an episode is one, or more around idle spans)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_store(
        cls,
        store: EpisodeStore,
        episode_ids: Sequence[str],
        *,
        reward: RewardKind = "sparse",
        gamma: float = 0.99,
        max_steps: int | None = None,
        cameras: bool = True,
        db: MetadataDB | None = None,
    ) -> TransitionBuffer:
        """The episodes' frames as transitions. With the metadata ``db``, their current labels apply: an
        ``outcome`` label overrides the recorded success, and ``segment`` span labels drop idle frames,
        score failure-inducing stretches as failures and keep recovery as positive (module docstring)."""
        if not episode_ids:
            raise ValueError("episode_ids: expected at least one episode")
        episodes = [store.read_episode(e, cameras=cameras) for e in episode_ids]
        labels = db.current_labels(episode_ids) if db is not None else {}
        spans = db.current_spans(episode_ids) if db is not None else {}
        spec = episodes[0].meta.spec
        steps = max_steps or max(ep.length for ep in episodes)
        buf = cls(spec, reward=reward, gamma=gamma, max_steps=steps, cameras=cameras)
        for ep in episodes:
            eid = ep.meta.episode_id
            buf.add_stored_episode(ep, labels.get(eid, {}), spans.get(eid, []))
        if not len(buf):
            raise ValueError("selected episodes hold no frames")
        return buf

    def add_stored_episode(
        self, ep: Episode, labels: Mapping[str, Any] | None = None, spans: Sequence[Any] = ()
    ) -> None:
        """Append a stored episode (:meth:`EpisodeStore.read_episode`) as :meth:`from_store` does: its
        current episode ``labels`` (an ``outcome`` overrides the recorded success) and span labels
        (``spans``: the DB's labels of the episode; those of key ``segment`` apply) from the metadata DB.
        Empty episodes are skipped; another spec raises ValueError."""
        if ep.meta.spec != self.spec:
            raise ValueError(
                f"episode {ep.meta.episode_id}: spec {ep.meta.spec.name!r} != {self.spec.name!r}"
            )
        if ep.length == 0:
            return
        labels = labels or {}
        _, success = effective_outcome(ep.meta.outcome, ep.meta.success, labels)
        self.add_episode(
            state=ep.state,
            action=ep.action,
            reward=ep.reward,
            terminated=ep.terminated,
            controller=ep.controller,
            success=bool(success),
            cameras=ep.cameras if self.use_cameras else None,
            episode_id=ep.meta.episode_id,
            instruction=_instructions(ep, labels),
            spans=[(str(lb.value), lb.start, lb.end) for lb in spans if lb.key == SPAN_KEY],
        )

    def add_episode(
        self,
        *,
        state: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        terminated: np.ndarray,
        controller: np.ndarray,
        success: bool,
        cameras: Mapping[str, np.ndarray] | None = None,
        episode_id: str | None = None,
        spans: Sequence[tuple[str, int, int]] = (),
        instruction: str | Sequence[str] | None = None,
        clone: bool = False,
    ) -> None:
        """Append one finished episode (arrays over its T frames; ``reward`` as the sim recorded it).
        ``spans``: its ``segment`` span labels as ``(type, start, end)`` (module docstring);
        ``instruction``: what the robot was told, for the episode or one string per frame (default: the
        spec's, as a simulator's episode); ``clone``: every frame is one to clone (``bc``), e.g. a
        hindsight-relabelled success (:mod:`vla_rl.train.hindsight`)."""
        t = len(state)
        if t == 0:
            raise ValueError("state: expected at least one frame")
        for name, arr, shape in (
            ("state", state, (t, self.spec.state_dim)),
            ("action", action, (t, self.spec.action_dim)),
            ("reward", reward, (t,)),
            ("terminated", terminated, (t,)),
            ("controller", controller, (t,)),
        ):
            if np.shape(arr) != shape:
                raise ValueError(f"{name}: expected shape {list(shape)}, got {list(np.shape(arr))}")
        r = step_rewards(
            self.reward_kind,
            stored_reward=np.asarray(reward, np.float32),
            success=success,
            terminated=np.asarray(terminated, bool),
            max_steps=self.max_steps,
            gamma=self.gamma,
        )
        keep, failure_at, recovery = span_effects(t, np.asarray(controller), spans)
        credit, cut = credit_labels(np.asarray(controller), success, failure_at)
        human = np.asarray(controller) == int(Controller.HUMAN)
        credit[recovery & ~human] = 1  # a recovery is kept as positive, never scored as a failure
        # A takeover is scored as a failure of the autonomous stretch (returns cut there).
        cut_value = {"sparse": 0.0, "steps_to_go": -1.0, "dense": 0.0, "shaped": 0.0}[self.reward_kind]
        # contiguous runs of kept frames: a window never crosses a dropped (idle) stretch
        breaks = np.concatenate([[True], keep[1:] != keep[:-1]]) if t else np.zeros(0, bool)
        run = self._runs + np.cumsum(breaks) - 1
        part = {
            "state": np.asarray(state, np.float32),
            "action": np.asarray(action, np.float32),
            "reward": r,
            "terminal": np.zeros(t, bool),
            "controller": np.asarray(controller, np.int64),
            "credit": credit,
            "bc": human | recovery | clone,
            "mc_return": _discounted_returns(r, cut, self.gamma, cut_value),
            "cut": np.asarray(cut, bool),
            "episode": np.full(t, len(self.episode_ids), np.int64),
            "frame": np.arange(t, dtype=np.int64),
            "run": run.astype(np.int64),
            "instruction": self._instruction_codes(instruction, t),
        }
        part["terminal"][-1] = bool(np.asarray(terminated)[-1])
        if self.use_cameras:
            if cameras is None:
                raise ValueError(f"cameras: expected {list(self.spec.camera_names)}")
            for cam in self.spec.cameras:
                img = np.asarray(cameras[cam.name])
                if img.shape != (t, cam.height, cam.width, 3):
                    raise ValueError(
                        f"cameras.{cam.name}: expected shape {[t, cam.height, cam.width, 3]}, got {list(img.shape)}"
                    )
                part[f"image.{cam.name}"] = img
        if not keep.all():
            if not keep.any():
                raise ValueError(f"episode {episode_id}: every frame is in an idle span; nothing to train on")
            part = {k: v[keep] for k, v in part.items()}
        self._runs = int(part["run"][-1]) + 1
        self._parts.append(part)
        self.episode_ids.append(episode_id or f"online-{len(self.episode_ids)}-{time.time_ns()}")
        self.episode_success.append(bool(success))
        self._dirty = True

    def _instruction_codes(self, instruction: str | Sequence[str] | None, t: int) -> np.ndarray:
        if instruction is None or isinstance(instruction, str):
            return np.full(t, self.instruction_code(instruction), np.int64)
        if len(instruction) != t:
            raise ValueError(
                f"instruction: expected one string or {t} (one per frame), got {len(instruction)}"
            )
        return np.array([self.instruction_code(x) for x in instruction], np.int64)

    def instruction_code(self, instruction: str | None = None) -> int:
        """The index of ``instruction`` (default: the spec's) in :attr:`instructions`, added if new."""
        text = self.spec.instruction if instruction is None else instruction
        if text not in self._instruction_code:
            self._instruction_code[text] = len(self.instructions)
            self.instructions.append(text)
        return self._instruction_code[text]

    def _consolidate(self) -> dict[str, np.ndarray]:
        if self._dirty:
            self._arrays = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}
            run = self._arrays["run"]
            change = np.flatnonzero(run[1:] != run[:-1]) + 1
            starts, ends = np.concatenate([[0], change]), np.concatenate([change, [len(run)]])
            self._arrays["end"] = np.repeat(ends, ends - starts)  # one past the last frame of its run
            self._parts = [dict(self._arrays)]  # keep one consolidated part
            for k in ("end",):
                self._parts[0].pop(k)
            self._dirty = False
        return self._arrays

    def __len__(self) -> int:
        return sum(len(p["state"]) for p in self._parts)

    @property
    def states(self) -> np.ndarray:
        return self._consolidate()["state"]

    @property
    def actions(self) -> np.ndarray:
        return self._consolidate()["action"]

    def snapshot(self) -> dict[str, Any]:
        """What exactly this buffer holds: episode ids with their frame counts and a digest over them,
        so a round's data can be audited or re-selected even after the store has grown."""
        lengths = [
            int(n) for n in np.bincount(self._consolidate()["episode"], minlength=len(self.episode_ids))
        ]
        h = hashlib.sha1(usedforsecurity=False)
        for eid, n in zip(self.episode_ids, lengths, strict=True):
            h.update(f"{eid}:{n};".encode())
        return {
            "episodes": len(self.episode_ids),
            "frames": len(self),
            "digest": h.hexdigest(),
            "episode_lengths": dict(zip(self.episode_ids, lengths, strict=True)),
        }

    def array(self, name: str) -> np.ndarray:
        """A per-frame array by name (``controller``, ``credit``, ``mc_return``, ``reward``, ...)."""
        return self._consolidate()[name]

    # ------------------------------------------------------------------ sampling
    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, len(self), size=batch_size)

    def batch(self, indices: np.ndarray, horizon: int, n_step: int) -> dict[str, torch.Tensor]:
        """Transitions at ``indices`` with ``horizon``-step action chunks and ``n_step``-step rewards.

        Keys: ``observation.state`` / ``observation.images.<cam>`` (at t), ``action`` [B, H, A],
        ``action_is_pad`` [B, H], ``reward_n`` [B], ``next.state`` / ``next.images.<cam>`` (at t + n),
        ``bootstrap`` [B] (1 if the value at t + n should be added, 0 after a terminal),
        ``valid`` [B] (0 when the window runs past a non-terminal end: no next observation was stored),
        ``controller`` [B], ``human`` [B] bool, ``bc`` [B] bool (human or recovery-span frames: clone
        them), ``credit`` [B] int (1/0/-1), ``mc_return`` [B],
        ``episode_index`` / ``frame_index`` [B], ``next_index`` [B] (the buffer row of ``next.*``),
        ``instruction_index`` / ``next.instruction_index`` [B] (into :attr:`instructions`, at t and t + n).
        """
        if horizon < 1 or n_step < 1:
            raise ValueError(f"horizon/n_step: expected >= 1, got {horizon} and {n_step}")
        a = self._consolidate()
        idx = np.asarray(indices, dtype=np.int64)
        end = a["end"][idx]
        window = idx[:, None] + np.arange(horizon)[None, :]
        steps = idx[:, None] + np.arange(n_step)[None, :]
        in_ep = steps < end[:, None]
        discounts = (self.gamma ** np.arange(n_step))[None, :]
        rewards = np.where(in_ep, a["reward"][np.minimum(steps, end[:, None] - 1)], 0.0)
        reward_n = (rewards * discounts).sum(1).astype(np.float32)
        nxt = idx + n_step
        inside = nxt < end
        ended_terminal = a["terminal"][end - 1]
        bootstrap = inside.astype(np.float32)
        valid = (inside | ended_terminal).astype(np.float32)
        nxt_idx = np.minimum(nxt, end - 1)
        out: dict[str, torch.Tensor] = {
            "observation.state": torch.from_numpy(a["state"][idx]),
            "action": torch.from_numpy(a["action"][np.minimum(window, end[:, None] - 1)]),
            "action_is_pad": torch.from_numpy(window >= end[:, None]),
            "reward_n": torch.from_numpy(reward_n),
            "next.state": torch.from_numpy(a["state"][nxt_idx]),
            "bootstrap": torch.from_numpy(bootstrap),
            "valid": torch.from_numpy(valid),
            "controller": torch.from_numpy(a["controller"][idx]),
            "human": torch.from_numpy(a["controller"][idx] == int(Controller.HUMAN)),
            "bc": torch.from_numpy(a["bc"][idx]),
            "credit": torch.from_numpy(a["credit"][idx].astype(np.int64)),
            "mc_return": torch.from_numpy(a["mc_return"][idx]),
            "episode_index": torch.from_numpy(a["episode"][idx]),
            "frame_index": torch.from_numpy(a["frame"][idx]),
            "next_index": torch.from_numpy(nxt_idx),
            "instruction_index": torch.from_numpy(a["instruction"][idx]),
            "next.instruction_index": torch.from_numpy(a["instruction"][nxt_idx]),
        }
        for cam in self.spec.camera_names if self.use_cameras else ():
            imgs = a[f"image.{cam}"]
            out[f"observation.images.{cam}"] = torch.from_numpy(imgs[idx])
            out[f"next.images.{cam}"] = torch.from_numpy(imgs[nxt_idx])
        return out


def next_observation(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``next.*`` keys of a :meth:`TransitionBuffer.batch` renamed to ``observation.*`` (and the
    next frame's ``instruction_index``)."""
    out = {"observation.state": batch["next.state"]}
    if "next.instruction_index" in batch:
        out["instruction_index"] = batch["next.instruction_index"]
    for k, v in batch.items():
        if k.startswith("next.images."):
            out["observation.images." + k[len("next.images.") :]] = v
    return out

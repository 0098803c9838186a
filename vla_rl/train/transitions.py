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

**Credit assignment** (HABC / HELP / LWD, algorithms.md section 4): an episode's outcome is credited
only to frames the policy (or a scripted controller) drove, and never across an intervention
boundary. A policy segment that ends in a human takeover gets outcome *failure* (the operator judged
it failing); the final autonomous segment gets the episode outcome; human frames get no outcome
(``credit = -1``) and are kept as positive behaviour cloning by the trainers. Monte-Carlo returns are
cut the same way: a segment ended by a takeover is scored as if it failed at the takeover.

Episodes come from the store + metadata DB through a :class:`DataSelection` (task, robots, time range,
checkpoint revisions, rounds, labels, outcome), or are appended online (:meth:`add_episode`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from fleet.db import MetadataDB
from fleet.meta import Controller
from fleet.store import EpisodeStore
from vla_rl.spec import RobotSpec

RewardKind = Literal["sparse", "steps_to_go", "dense", "shaped"]
REWARD_KINDS: tuple[str, ...] = get_args(RewardKind)
NO_CREDIT = -1

__all__ = [
    "REWARD_KINDS",
    "DataSelection",
    "RewardKind",
    "TransitionBuffer",
    "credit_labels",
    "load_transitions",
    "next_observation",
    "select_episode_ids",
    "step_rewards",
]


# ---------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class DataSelection:
    """Which episodes a round trains on. Every field narrows the set; empty means "any".

    The text form (``vla-rl round start --data ...``) is comma-separated ``key=value`` pairs, with
    ``|`` between alternatives: ``robot=arm-1|arm-2,since=2026-11-01,revision=abc123,round=3,
    label.quality=good,success=true,max=200``.
    """

    task: str
    robots: tuple[str, ...] = ()
    since: float | None = None
    """Unix time; episodes created at or after it."""
    until: float | None = None
    revisions: tuple[str, ...] = ()
    """Episodes in which any of these checkpoint revisions acted."""
    rounds: tuple[int, ...] = ()
    """Episodes collected by the checkpoints these post-training rounds produced (needs the DB)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Episode-level labels that must match (key -> value as text), from the metadata DB."""
    success: bool | None = None
    max_episodes: int | None = None
    """Keep the most recent this many (after the other filters)."""

    def __post_init__(self) -> None:
        if not self.task:
            raise ValueError("task: expected a task id, e.g. maniskill/PickCube-v1")
        if self.max_episodes is not None and self.max_episodes < 1:
            raise ValueError(f"max: expected a positive integer, got {self.max_episodes}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ValueError(f"until: expected >= since ({self.since}), got {self.until}")

    @classmethod
    def parse(cls, task: str, text: str | None) -> DataSelection:
        """Parse the text form (see the class docstring); raises ValueError naming the bad key."""
        kw: dict[str, Any] = {}
        labels: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"data selection: expected key=value, got {part!r}")
            alts = tuple(v.strip() for v in value.split("|") if v.strip())
            if key == "robot":
                kw["robots"] = alts
            elif key in ("since", "until"):
                kw[key] = _parse_time(key, value)
            elif key == "revision":
                kw["revisions"] = alts
            elif key == "round":
                try:
                    kw["rounds"] = tuple(int(v) for v in alts)
                except ValueError:
                    raise ValueError(f"round: expected round numbers, got {value!r}") from None
            elif key == "success":
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"success: expected true or false, got {value!r}")
                kw["success"] = value.lower() == "true"
            elif key == "max":
                if not value.isdigit():
                    raise ValueError(f"max: expected a positive integer, got {value!r}")
                kw["max_episodes"] = int(value)
            elif key.startswith("label.") and len(key) > len("label."):
                labels[key[len("label.") :]] = value
            else:
                raise ValueError(
                    f"data selection: unknown key {key!r}; expected robot, since, until, revision, round, "
                    "success, max or label.<name>"
                )
        return cls(task=task, labels=labels, **kw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "robots": list(self.robots),
            "since": self.since,
            "until": self.until,
            "revisions": list(self.revisions),
            "rounds": list(self.rounds),
            "labels": dict(self.labels),
            "success": self.success,
            "max_episodes": self.max_episodes,
        }


def _parse_time(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(f"{key}: expected unix seconds or an ISO date (2026-11-01), got {value!r}") from None


def select_episode_ids(
    store: EpisodeStore,
    selection: DataSelection,
    db: MetadataDB | None = None,
    round_revisions: Mapping[int, Sequence[str]] | None = None,
) -> list[str]:
    """Closed episodes matching ``selection``, oldest first. ``round_revisions`` maps a round number
    to the checkpoint revisions it produced (from the rounds table)."""
    revisions = set(selection.revisions)
    if selection.rounds:
        if round_revisions is None:
            raise ValueError("round: selecting by round needs the metadata DB's rounds table")
        for r in selection.rounds:
            if r not in round_revisions:
                raise ValueError(f"round: no round {r} in the metadata DB")
            revisions.update(round_revisions[r])
    metas = [store.read_metadata(e) for e in store.episode_ids()]
    metas = [
        m
        for m in metas
        if m.task == selection.task
        and m.is_closed
        and (not selection.robots or m.robot_id in selection.robots)
        and (selection.since is None or m.created >= selection.since)
        and (selection.until is None or m.created <= selection.until)
        and (not revisions or revisions.intersection(m.revisions))
        and (selection.success is None or bool(m.success) == selection.success)
    ]
    if selection.labels:
        if db is None:
            raise ValueError("label: selecting by label needs the metadata DB (--db)")
        keep = []
        for m in metas:
            have = {
                lb.key: str(lb.value).lower() for lb in db.labels(m.episode_id) if lb.segment_index is None
            }
            if all(have.get(k) == str(v).lower() for k, v in selection.labels.items()):
                keep.append(m)
        metas = keep
    metas.sort(key=lambda m: (m.created, m.episode_id))
    if selection.max_episodes is not None:
        metas = metas[-selection.max_episodes :]
    if not metas:
        raise ValueError(
            f"no closed episodes in {store.root} match {selection.to_dict()}; "
            f"check the selection, or record data with: vla-rl sim demos --task {selection.task}"
        )
    return [m.episode_id for m in metas]


def load_transitions(
    store: EpisodeStore | str | Path,
    selection: DataSelection,
    *,
    db: MetadataDB | None = None,
    reward: RewardKind = "sparse",
    gamma: float = 0.99,
    max_steps: int | None = None,
    cameras: bool = True,
) -> TransitionBuffer:
    """Select episodes (rounds resolved through the DB's rounds table) and load them as a buffer."""
    store = store if isinstance(store, EpisodeStore) else EpisodeStore(store)
    if db is None and (selection.labels or selection.rounds):
        db = MetadataDB.for_store(store.root)
    ids = select_episode_ids(
        store, selection, db=db, round_revisions=db.round_revisions() if db is not None else None
    )
    return TransitionBuffer.from_store(
        store, ids, reward=reward, gamma=gamma, max_steps=max_steps, cameras=cameras
    )


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


def credit_labels(controller: np.ndarray, success: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame outcome credit and credit-segment ends for one episode.

    Returns ``credit`` int8 ``[T]`` (1 success, 0 failure, -1 no credit: human frames) and ``cut`` bool
    ``[T]``: True on the last frame of an autonomous stretch that a human took over from (returns are
    cut there and that frame is scored as a failure).
    """
    human = np.asarray(controller) == int(Controller.HUMAN)
    t = len(human)
    credit = np.full(t, NO_CREDIT, dtype=np.int8)
    cut = np.zeros(t, dtype=bool)
    i = 0
    while i < t:
        j = i
        while j < t and human[j] == human[i]:
            j += 1
        if not human[i]:
            taken_over = j < t  # a human frame follows this autonomous stretch
            credit[i:j] = 0 if taken_over else int(success)
            cut[j - 1] = taken_over
        i = j
    return credit, cut


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
        self._parts: list[dict[str, np.ndarray]] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._dirty = False

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
    ) -> TransitionBuffer:
        if not episode_ids:
            raise ValueError("episode_ids: expected at least one episode")
        episodes = [store.read_episode(e, cameras=cameras) for e in episode_ids]
        spec = episodes[0].meta.spec
        steps = max_steps or max(ep.length for ep in episodes)
        buf = cls(spec, reward=reward, gamma=gamma, max_steps=steps, cameras=cameras)
        for ep in episodes:
            if ep.meta.spec != spec:
                raise ValueError(f"episode {ep.meta.episode_id}: spec {ep.meta.spec.name!r} != {spec.name!r}")
            if ep.length == 0:
                continue
            buf.add_episode(
                state=ep.state,
                action=ep.action,
                reward=ep.reward,
                terminated=ep.terminated,
                controller=ep.controller,
                success=bool(ep.meta.success),
                cameras=ep.cameras if buf.use_cameras else None,
                episode_id=ep.meta.episode_id,
            )
        if not len(buf):
            raise ValueError("selected episodes hold no frames")
        return buf

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
    ) -> None:
        """Append one finished episode (arrays over its T frames; ``reward`` as the sim recorded it)."""
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
        credit, cut = credit_labels(np.asarray(controller), success)
        # A takeover is scored as a failure of the autonomous stretch (returns cut there).
        cut_value = {"sparse": 0.0, "steps_to_go": -1.0, "dense": 0.0, "shaped": 0.0}[self.reward_kind]
        part = {
            "state": np.asarray(state, np.float32),
            "action": np.asarray(action, np.float32),
            "reward": r,
            "terminal": np.zeros(t, bool),
            "controller": np.asarray(controller, np.int64),
            "credit": credit,
            "mc_return": _discounted_returns(r, cut, self.gamma, cut_value),
            "episode": np.full(t, len(self.episode_ids), np.int64),
            "frame": np.arange(t, dtype=np.int64),
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
        self._parts.append(part)
        self.episode_ids.append(episode_id or f"online-{len(self.episode_ids)}-{time.time_ns()}")
        self.episode_success.append(bool(success))
        self._dirty = True

    def _consolidate(self) -> dict[str, np.ndarray]:
        if self._dirty:
            self._arrays = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}
            lengths = np.array([len(p["state"]) for p in self._parts])
            ends = np.cumsum(lengths)
            self._arrays["end"] = np.repeat(ends, lengths)  # one past the episode's last frame
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
        ``controller`` [B], ``human`` [B] bool, ``credit`` [B] int (1/0/-1), ``mc_return`` [B],
        ``episode_index`` / ``frame_index`` [B], ``next_index`` [B] (the buffer row of ``next.*``).
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
            "credit": torch.from_numpy(a["credit"][idx].astype(np.int64)),
            "mc_return": torch.from_numpy(a["mc_return"][idx]),
            "episode_index": torch.from_numpy(a["episode"][idx]),
            "frame_index": torch.from_numpy(a["frame"][idx]),
            "next_index": torch.from_numpy(nxt_idx),
        }
        for cam in self.spec.camera_names if self.use_cameras else ():
            imgs = a[f"image.{cam}"]
            out[f"observation.images.{cam}"] = torch.from_numpy(imgs[idx])
            out[f"next.images.{cam}"] = torch.from_numpy(imgs[nxt_idx])
        return out


def next_observation(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``next.*`` keys of a :meth:`TransitionBuffer.batch` renamed to ``observation.*``."""
    out = {"observation.state": batch["next.state"]}
    for k, v in batch.items():
        if k.startswith("next.images."):
            out["observation.images." + k[len("next.images.") :]] = v
    return out

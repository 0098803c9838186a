"""TACO: test-time anti-exploration by pseudo-counts (docs/algorithms.md §6b).

An SFT flow policy keeps modes its data barely supports; which one a chunk lands in depends on the
initial noise. TACO samples N chunks per decision and executes the one the SFT data *counts* most:

    a* = argmax_i N̂(o, a_i),      N̂(h) = d / ||f_φ(h)||²

with a **Coin-Flipping Network** (CFN, Lobel et al. 2023) f_φ: R^F -> R^d regressed, per data sample,
to a random Rademacher code c_i ∈ {±1}^d drawn once for that sample:

    L(φ) = mean_i ||f_φ(h_i) − c_i||² / d.

For a feature seen n times the least-squares optimum is the mean of its n codes, whose squared norm
has expectation d/n, hence ||f||²/d ≈ 1/n and N̂ ≈ n. The features here are the policy's normalised
state (or, with cameras, its mean-pooled prefix tokens, as QAM's critic) concatenated with the
normalised, clipped *executed* part of the chunk (``n_exec`` actions): a decoupled estimator on the
inputs, not the paper's "coupled" one on the VLA's last hidden states with its noise-level feature
search (our action expert is small; the inputs are what it is conditioned on and what it outputs).

Pieces: :func:`pseudo_count`, :func:`rademacher_codes`, :class:`CoinFlipNet` (fit by
:func:`train_cfn`, saved as safetensors + JSON, never pickle), :func:`select_max`, and
:class:`BestOfNPolicy`, a :class:`vla_rl.evaluation.ChunkPolicy` that samples N chunks per
observation and executes the best by a score: :class:`TACOScore` (pseudo-counts) or any other
(e.g. a critic's Q, the best-of-N this is compared with).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from vla_rl_client.spec import RobotSpec

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import mlp
from policies.loading import LoadedPolicy
from vla_rl.train.loop import fit_minibatches
from vla_rl.train.transitions import select_episode_ids

log = logging.getLogger(__name__)
Tensor = torch.Tensor
Scorer = Callable[[Mapping[str, Any], Tensor], Tensor]
"""``score(obs, chunks)``: normalised chunks ``[B, N, H, A]`` -> scores ``[B, N]`` (higher = execute)."""

CFN_WEIGHTS, CFN_CONFIG = "cfn.safetensors", "cfn.json"

__all__ = [
    "BestOfNPolicy",
    "CoinFlipNet",
    "TACOConfig",
    "TACOScore",
    "cfn_loss",
    "pseudo_count",
    "rademacher_codes",
    "select_max",
    "train_cfn",
]


@dataclass(kw_only=True)
class TACOConfig:
    """Fit TACO's coin-flipping network on a policy's SFT data (``vla-rl taco fit``); deploy it with
    ``vla-rl eval --taco OUT`` or :func:`taco_policy`."""

    base: str
    """The SFT checkpoint whose samples are selected (its normalisation defines the features)."""
    store: Path
    """Episode store with the SFT data (the demonstrations the base was trained on)."""
    out: Path
    """Folder for ``cfn.safetensors`` + ``cfn.json``."""
    data: str | None = None
    """Which episodes, as selection text (docs/training.md); None = every closed episode of the task."""
    task: str | None = None
    """Task id; None = the base checkpoint's."""
    code_dim: int = 64
    """d: length of the Rademacher codes (the count's relative noise is about sqrt(2/d))."""
    hidden: tuple[int, ...] = (256, 256)
    """CFN MLP widths."""
    steps: int = 3000
    """Adam updates."""
    batch_size: int = 256
    """Frames per update."""
    lr: float = 1e-3
    """Adam learning rate."""
    num_samples: int = 8
    """N: chunks sampled per decision at deployment (printed in the eval command; eval's --num-samples)."""
    seed: int = 0
    """Seeds the codes, the initialisation and the batches."""
    threads: int = 1
    """CPU threads for torch."""

    def __post_init__(self) -> None:
        self.store, self.out = Path(self.store), Path(self.out)
        self.hidden = tuple(int(h) for h in self.hidden)
        for name in ("code_dim", "steps", "batch_size", "num_samples", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")


# ============================================================================ pure pieces
def pseudo_count(f: Tensor) -> Tensor:
    """``N̂ = d / ||f||²`` over the last dimension (``f`` ``[..., d]``); a zero output counts as 1e12."""
    return f.shape[-1] / (f.float() ** 2).sum(-1).clamp_min(f.shape[-1] * 1e-12)


def rademacher_codes(n: int, d: int, seed: int) -> Tensor:
    """``[n, d]`` codes with independent fair ±1 entries (numpy's seeded generator)."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 2, size=(n, d)).astype(np.float32) * 2 - 1)


def cfn_loss(f: Tensor, codes: Tensor) -> Tensor:
    """``mean_i ||f_i − c_i||² / d``."""
    return ((f - codes) ** 2).sum(-1).mean() / f.shape[-1]


def select_max(scores: Tensor) -> Tensor:
    """Index of the highest score per row (``[B, N]`` -> ``[B]``; the first on a tie)."""
    return scores.argmax(-1)


class CoinFlipNet(nn.Module):
    """f_φ: standardised features ``[.., F]`` -> ``[.., d]``; :meth:`count` is the pseudo-count."""

    def __init__(self, in_dim: int, code_dim: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        self.in_dim, self.code_dim, self.hidden = int(in_dim), int(code_dim), tuple(int(h) for h in hidden)
        self.net = mlp(in_dim, self.hidden, code_dim, layer_norm=False)
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))

    def forward(self, h: Tensor) -> Tensor:
        return self.net((h - self.mean) / self.std)

    @torch.no_grad()
    def count(self, h: Tensor) -> Tensor:
        return pseudo_count(self(h))

    def save(self, folder: Path, extra: Mapping[str, Any] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / CFN_WEIGHTS))
        meta = {
            "in_dim": self.in_dim,
            "code_dim": self.code_dim,
            "hidden": list(self.hidden),
            **(extra or {}),
        }
        (folder / CFN_CONFIG).write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, folder: Path) -> tuple[CoinFlipNet, dict[str, Any]]:
        """The network and its JSON metadata; ValueError naming the file when it does not fit."""
        folder = Path(folder)
        if not (folder / CFN_CONFIG).exists():
            raise FileNotFoundError(f"taco: no {CFN_CONFIG} in {folder} (fit one with: vla-rl taco fit)")
        meta = json.loads((folder / CFN_CONFIG).read_text())
        net = cls(int(meta["in_dim"]), int(meta["code_dim"]), tuple(meta["hidden"]))
        try:
            net.load_state_dict(load_file(str(folder / CFN_WEIGHTS)))
        except RuntimeError as e:
            raise ValueError(f"{folder / CFN_WEIGHTS}: does not match {CFN_CONFIG} ({e})") from None
        return net.eval(), meta


def train_cfn(
    features: Tensor,
    *,
    code_dim: int,
    hidden: Sequence[int],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[CoinFlipNet, list[float]]:
    """Fit f_φ to one Rademacher code per row of ``features`` ``[n, F]`` (:func:`cfn_loss`, Adam,
    seeded; inputs standardised by the rows' mean / std). Returns the network and the loss curve."""
    n = len(features)
    codes = rademacher_codes(n, code_dim, seed)
    torch.manual_seed(seed)
    net = CoinFlipNet(features.shape[1], code_dim, hidden)
    net.mean.copy_(features.mean(0))
    net.std.copy_(features.std(0).clamp_min(1e-6) if n > 1 else torch.ones(features.shape[1]))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rng = np.random.default_rng(seed + 1)

    def loss_fn() -> Tensor:
        idx = torch.from_numpy(rng.integers(0, n, size=min(batch_size, n)))
        return cfn_loss(net(features[idx]), codes[idx])

    losses = fit_minibatches(opt, loss_fn, steps)
    return net.eval(), losses


# ============================================================================ on a policy
def observation_features(policy: Any, obs: Mapping[str, Any]) -> Tensor:
    """The policy's normalised state ``[B, S]``, or its mean-pooled prefix tokens with cameras."""
    if policy.config.cameras:
        return policy.encode_prefix(obs).pooled().float()
    state = torch.as_tensor(np.asarray(obs["state"]), dtype=torch.float32, device=policy.device)
    return policy.normalizer.normalize_state(state).float()


def chunk_features(obs_features: Tensor, chunks: Tensor, n_exec: int) -> Tensor:
    """``[B, F]`` and normalised chunks ``[B, N, H, A]`` -> ``[B, N, F + n_exec·A]`` (executed part,
    clipped to [−1, 1])."""
    b, n = chunks.shape[:2]
    executed = chunks[:, :, :n_exec].clamp(-1.0, 1.0).reshape(b, n, -1)
    return torch.cat([obs_features[:, None].expand(b, n, -1), executed.float()], -1)


@dataclass
class TACOScore:
    """Scorer: the CFN's pseudo-count of each sampled chunk (higher = better supported by the data)."""

    cfn: CoinFlipNet
    policy: Any
    n_exec: int

    @torch.no_grad()
    def __call__(self, obs: Mapping[str, Any], chunks: Tensor) -> Tensor:
        h = chunk_features(observation_features(self.policy, obs), chunks, self.n_exec)
        return self.cfn.count(h.cpu())


@dataclass
class BestOfNPolicy:
    """A :class:`vla_rl.evaluation.ChunkPolicy`: per observation, sample ``num_samples`` chunks
    (seeded initial noise, the base's ODE) and return the one ``scorer`` ranks highest, in env units.
    ``last_scores`` / ``last_choice`` keep the latest decision's scores and picks."""

    loaded: LoadedPolicy
    scorer: Scorer
    num_samples: int = 8
    last_scores: Tensor | None = field(default=None, repr=False)
    last_choice: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples: expected a positive integer, got {self.num_samples}")

    @property
    def spec(self) -> RobotSpec:
        return self.loaded.spec

    @property
    def chunk_len(self) -> int:
        return self.loaded.chunk_len

    @property
    def n_exec(self) -> int:
        return self.loaded.n_exec

    @torch.no_grad()
    def sample(self, obs: Mapping[str, Any], seed: int) -> Tensor:
        """Normalised, clipped chunks ``[B, N, H, A]`` (the samples :meth:`predict_chunks` ranks)."""
        policy = self.loaded.policy
        gen = torch.Generator(device=policy.device).manual_seed(int(seed))
        inputs = {"state": obs["state"], "cameras": obs.get("cameras", {}), "instruction": obs["instruction"]}
        s = policy.sample(
            inputs, num_samples=self.num_samples, num_steps=self.loaded.num_steps, generator=gen
        )
        a = s.actions
        return a.clamp(-1.0, 1.0) if policy.config.action_norm == "min_max" else a

    @torch.no_grad()
    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        chunks = self.sample(obs, seed)
        scores = self.scorer(obs, chunks).to(chunks.device)
        choice = select_max(scores)
        self.last_scores, self.last_choice = scores.cpu(), choice.cpu()
        picked = chunks[torch.arange(len(chunks), device=chunks.device), choice]
        return self.loaded.policy.normalizer.unnormalize_action(picked).float().cpu().numpy()


def data_features(
    loaded: LoadedPolicy, store: EpisodeStore, episode_ids: Sequence[str], n_exec: int
) -> Tensor:
    """CFN training rows: for every frame t with t + n_exec <= T of the episodes, the policy's features
    of (o_t, the recorded a_{t:t+n_exec}, normalised)."""
    policy = loaded.policy
    rows = []
    for eid in episode_ids:
        ep = store.read_episode(eid, cameras=bool(policy.config.cameras))
        t = ep.length - n_exec + 1
        if t < 1:
            continue
        obs = {"state": ep.state[:t], "cameras": {k: v[:t] for k, v in ep.cameras.items()}, "instruction": ""}
        with torch.no_grad():
            feats = observation_features(policy, obs)
            act = torch.as_tensor(
                np.stack([ep.action[i : i + n_exec] for i in range(t)]), dtype=torch.float32
            )
            chunk = policy.normalizer.normalize_action(act.to(policy.device))[:, None]
        rows.append(chunk_features(feats, chunk, n_exec)[:, 0].cpu())
    if not rows:
        raise ValueError(f"episodes: none is at least n_exec = {n_exec} frames long")
    return torch.cat(rows)


def train_taco(cfg: TACOConfig) -> dict[str, Any]:
    """Fit the CFN on the base's data and save it in ``cfg.out``; returns a summary."""
    from policies.loading import load_policy

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    loaded = load_policy(cfg.base, device="cpu")
    store = EpisodeStore(cfg.store)
    selection = Selection.parse(cfg.data, task=cfg.task or loaded.spec.name)
    ids = select_episode_ids(store, selection)
    if not ids:
        raise ValueError(f"data: no closed episodes of {selection.task} in {cfg.store}")
    n_exec = loaded.policy.config.n_exec
    feats = data_features(loaded, store, ids, n_exec)
    cfn, losses = train_cfn(
        feats,
        code_dim=cfg.code_dim,
        hidden=cfg.hidden,
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
    )
    summary = {
        "episodes": len(ids),
        "rows": len(feats),
        "n_exec": n_exec,
        "final_loss": float(np.mean(losses[-50:])),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    cfn.save(cfg.out, {"base": str(cfg.base), "n_exec": n_exec, "config": _jsonable(asdict(cfg)), **summary})
    return summary


def _jsonable(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def taco_policy(loaded: LoadedPolicy, cfn_folder: Path, num_samples: int) -> BestOfNPolicy:
    """The base wrapped with TACO selection from a saved CFN."""
    cfn, meta = CoinFlipNet.load(cfn_folder)
    return BestOfNPolicy(loaded, TACOScore(cfn, loaded.policy, int(meta["n_exec"])), num_samples)

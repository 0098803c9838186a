"""Flow-matching VLA: observation prefix -> transformer trunk -> action expert -> velocity field.

TIME CONVENTION (one, everywhere in this package): t = 0 is noise, t = 1 is data,
``x_t = (1 - t) * x0 + t * x1`` with ``x0 ~ N(0, I)``, and the network's velocity targets
``x1 - x0``; sampling integrates t from 0 to 1. openpi / RLinf use the reverse (1 = noise, velocity
``u = eps - a``): convert only through :mod:`policies.flow_vla.conventions`
(``to_openpi_time``/``from_openpi_time``, ``v_ours(x, t) = -u_openpi(x, 1 - t)``).

Structure (π0-like, scaled down to train on a CPU):

* prefix tokens: [instruction (frozen MiniLM -> projection), state (MLP), g*g tokens per camera
  (small conv net, or a ResNet-18), each camera first resized to ``image_resize``] + learned slot embeddings -> ``n_layers`` bidirectional transformer blocks;
* action expert: H action tokens (``x_t`` projected and fused with the sin-cos time embedding by an
  MLP, as π0) + learned positions -> ``expert_n_layers`` blocks whose attention keys/values are
  ``[prefix; actions]`` -- the prefix part is projected once per observation into a
  :class:`PrefixCache` and reused for every denoising step and every sample of that observation;
* noise head (Flow-Noise): a small tanh MLP on the expert's per-token hidden state (a function of
  prefix, x_t and t) giving a per-element std bounded to [noise_std_min, noise_std_max].

Public tensors at :meth:`FlowVLAPolicy.predict_action_chunk` are UNnormalised env actions; everything
else (velocity, samplers, chains, loss internals) works on normalised actions.

Observation dict (batched; numpy arrays or tensors): ``"state"`` ``[B, S]`` float, ``"cameras"``
``{name: [B, H, W, 3] uint8}``, and ``"instruction"`` (str or B strings) or
``"instruction_embedding"`` ``[B, 384]`` (precomputed with :func:`.encoders.embed_instructions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .configuration_flow_vla import MINILM_DIM, FlowVLAConfig
from .conventions import VelocityFn, from_openpi_time
from .encoders import (
    ImageEncoder,
    InstructionEncoder,
    MiniLMEmbedder,
    ResNet18Encoder,
    StateEncoder,
    load_resnet18_weights,
    preprocess_images,
    random_shift,
)
from .layers import MLP, Block, PrefixKV, sincos_time_embedding
from .normalize import Normalizer
from .sampling import (
    NoisyVelocityFn,
    SampleResult,
    SDESchedule,
    chain_log_prob,
    check_num_steps,
    euler_sample,
    initial_noise,
    learnable_noise_sample,
    noise_kernel,
    per_action_time,
    random_prefix,
    sde_kernel,
    sde_sample,
)
from .uncertainty import accel_score

Tensor = torch.Tensor
Method = Literal["ode", "sde", "noise"]
ADVANTAGE_UNCONDITIONAL, ADVANTAGE_NEGATIVE, ADVANTAGE_POSITIVE = 0, 1, 2


# ---------------------------------------------------------------------- containers
@dataclass
class PrefixCache:
    """What the action expert needs from one batch of observations, computed once.

    ``tokens``: trunk output ``[B, P, D]`` (value heads can pool it); ``kv``: per expert layer, the
    prefix keys and values ``[B, heads, P, D / heads]``.
    """

    tokens: Tensor
    kv: tuple[tuple[Tensor, Tensor], ...]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def repeat_interleave(self, n: int) -> PrefixCache:
        """Each observation's cache repeated n times (row b*n + i is observation b): copies, no recompute."""
        if n == 1:
            return self
        return PrefixCache(
            self.tokens.repeat_interleave(n, 0),
            tuple((k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in self.kv),
        )

    def pooled(self) -> Tensor:
        """Mean prefix token ``[B, D]``."""
        return self.tokens.mean(1)


@dataclass
class DenoisingChain:
    """A stored stochastic denoising chain, enough to recompute its log-likelihood (PPO).

    ``iterates``: ``[B, N, K + 1, H, A]`` normalised x_0..x_K; ``stochastic``: ``[K]`` or ``[B, N, K]``
    bool, the steps that drew noise; the rest says how the log-prob was taken.
    """

    iterates: Tensor
    method: Literal["sde", "noise"]
    stochastic: Tensor
    schedule: SDESchedule | None
    include_initial: bool
    n_exec: int


@dataclass
class FlowSample:
    """Result of :meth:`FlowVLAPolicy.sample` for B observations x N samples (normalised actions).

    ``actions`` ``[B, N, H, A]``; ``iterates`` ``[B, N, K + 1, H, A]`` or None; ``log_prob`` ``[B, N]``
    (stochastic methods; over the executed actions) or None; ``chain`` for stochastic methods.
    """

    actions: Tensor
    iterates: Tensor | None
    log_prob: Tensor | None
    chain: DenoisingChain | None


def stochastic_sample(
    method: Literal["sde", "noise"],
    velocity_fn: VelocityFn,
    noisy_velocity_fn: NoisyVelocityFn,
    x0: Tensor,
    num_steps: int,
    *,
    schedule: SDESchedule | None,
    stochastic_steps: Sequence[int] | Tensor | None,
    noise: Tensor | None,
    generator: torch.Generator | None,
    logprob_mask: Tensor,
) -> tuple[SampleResult, SDESchedule | None]:
    """π-RL's noise-injected chain from ``x0`` ``[N, H, D]`` (iterates and log-prob over
    ``logprob_mask``), and the SDE schedule it used (None for Flow-Noise). One place for every flow
    policy: :meth:`FlowVLAPolicy.sample` and :class:`policies.flow_rl.StochasticFlowPolicy`."""
    if method == "sde":
        schedule = schedule or SDESchedule()
        res = sde_sample(
            velocity_fn,
            x0,
            num_steps,
            schedule,
            stochastic_steps=stochastic_steps,
            noise=noise,
            generator=generator,
            logprob_mask=logprob_mask,
            return_iterates=True,
        )
        return res, schedule
    res = learnable_noise_sample(
        noisy_velocity_fn,
        x0,
        num_steps,
        noise=noise,
        generator=generator,
        logprob_mask=logprob_mask,
        include_initial=True,
        return_iterates=True,
    )
    return res, None


def denoising_chain(
    res: SampleResult,
    method: Literal["sde", "noise"],
    schedule: SDESchedule | None,
    b: int,
    n: int,
    n_exec: int,
) -> DenoisingChain:
    """The stored chain of :func:`stochastic_sample`'s ``B * N`` rows, as B observations x N samples."""
    assert res.iterates is not None
    kp1 = res.iterates.shape[1]
    return DenoisingChain(
        iterates=res.iterates.reshape(b, n, kp1, *res.iterates.shape[2:]),
        method=method,
        stochastic=res.stochastic if res.stochastic.ndim == 1 else res.stochastic.reshape(b, n, kp1 - 1),
        schedule=schedule,
        include_initial=method == "noise",
        n_exec=n_exec,
    )


def stored_chain_log_prob(
    chain: DenoisingChain, velocity_fn: VelocityFn, noisy_velocity_fn: NoisyVelocityFn, logprob_mask: Tensor
) -> Tensor:
    """Log-likelihood ``[B, N]`` of a stored chain under the functions given (the CURRENT weights;
    differentiable); they see the K steps of every chain as one batch of ``B * N * K`` rows, chain-major."""
    b, n, kp1 = chain.iterates.shape[:3]
    k = kp1 - 1
    iterates = chain.iterates.reshape(b * n, kp1, *chain.iterates.shape[3:])
    stoch = chain.stochastic if chain.stochastic.ndim == 1 else chain.stochastic.reshape(b * n, k)
    if chain.method == "noise":
        kernel = noise_kernel(noisy_velocity_fn)
    elif chain.method == "sde":
        kernel = sde_kernel(velocity_fn, chain.schedule or SDESchedule())
    else:
        raise ValueError(f"chain.method must be 'sde' or 'noise', got {chain.method!r}")
    lp = chain_log_prob(
        kernel,
        iterates,
        stochastic_steps=stoch,
        logprob_mask=logprob_mask,
        include_initial=chain.include_initial,
    )
    return lp.reshape(b, n)


# ---------------------------------------------------------------------- heads
class ActionExpert(nn.Module):
    """Velocity of an H-step chunk given the prefix cache, ``x_t`` and ``t``."""

    def __init__(self, cfg: FlowVLAConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.time_mlp = MLP(2 * d, d, d, act=nn.SiLU)  # π0: MLP(swish) on concat[action token, time emb]
        self.pos = nn.Parameter(torch.zeros(cfg.chunk_len, d))
        self.prefix_kv = nn.ModuleList(PrefixKV(d, cfg.n_heads) for _ in range(cfg.expert_n_layers))
        self.blocks = nn.ModuleList(
            Block(d, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.expert_n_layers)
        )
        self.norm_out = nn.LayerNorm(d)
        self.action_out = nn.Linear(d, cfg.action_dim)

    def cache_kv(self, prefix_tokens: Tensor) -> tuple[tuple[Tensor, Tensor], ...]:
        return tuple(p(prefix_tokens) for p in self.prefix_kv)

    def forward(self, kv: Sequence[tuple[Tensor, Tensor]], x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """``x_t [N, H, A], t [N] (or [N, H]: one flow time per action) -> (velocity [N, H, A],
        hidden [N, H, D])``."""
        c = self.cfg
        flat = t.reshape(-1)
        temb = sincos_time_embedding(flat, c.d_model, c.time_min_period, c.time_max_period).to(x_t.dtype)
        a = self.action_in(x_t)
        temb = temb.view(*t.shape, -1)
        temb = temb[:, None, :].expand_as(a) if t.ndim == 1 else temb
        h = self.time_mlp(torch.cat([a, temb], dim=-1)) + self.pos
        for blk, layer_kv in zip(self.blocks, kv, strict=True):
            h = blk(h, layer_kv)
        h = self.norm_out(h)
        return self.action_out(h), h


class NoiseHead(nn.Module):
    """Flow-Noise std: tanh MLP -> log-variance squashed into [2 log std_min, 2 log std_max] (RLinf)."""

    def __init__(self, d_model: int, action_dim: int, hidden: Sequence[int], std_min: float, std_max: float):
        super().__init__()
        layers: list[nn.Module] = []
        d_in = d_model
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.Tanh()]
            d_in = h
        self.out = nn.Linear(d_in, action_dim)
        nn.init.zeros_(self.out.weight)  # start at the middle of the range
        nn.init.zeros_(self.out.bias)
        self.body = nn.Sequential(*layers)
        self.logvar_min = 2.0 * float(np.log(std_min))
        self.logvar_max = 2.0 * float(np.log(std_max))

    def forward(self, hidden: Tensor) -> Tensor:
        raw = self.out(self.body(hidden))
        logvar = self.logvar_min + (self.logvar_max - self.logvar_min) * (torch.tanh(raw) + 1.0) / 2.0
        return torch.exp(0.5 * logvar)


# ---------------------------------------------------------------------- policy
class FlowVLAPolicy(nn.Module):
    """Flow-matching vision-language-action policy (see the module docstring)."""

    def __init__(self, config: FlowVLAConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        d = c.d_model
        self.normalizer = Normalizer(c.state_dim, c.action_dim, c.normalization_stats, c.action_norm)
        self.instruction_encoder = InstructionEncoder(d) if c.uses_instruction else None
        self.state_encoder = StateEncoder(c.state_dim, d) if c.state_dim > 0 else None
        if not c.cameras:
            self.image_encoders = None
        else:
            keys = ("shared",) if c.share_image_encoder else c.camera_names
            self.image_encoders = nn.ModuleDict({k: _image_encoder(c) for k in keys})
        self.slot_emb = nn.Parameter(torch.zeros(c.n_prefix_tokens, d))
        self.trunk = nn.ModuleList(Block(d, c.n_heads, c.mlp_ratio, c.dropout) for _ in range(c.n_layers))
        self.trunk_norm = nn.LayerNorm(d)
        self.expert = ActionExpert(c)
        self.noise_head = NoiseHead(d, c.action_dim, c.noise_head_hidden, c.noise_std_min, c.noise_std_max)
        self.advantage_embedding = nn.Embedding(3, d) if c.advantage_conditioning else None
        self._init_weights()

    def _init_weights(self) -> None:
        """PyTorch's default fan-in init for linear/conv layers (it trained these small models faster
        than GPT-style N(0, 0.02)); small random token embeddings; the noise head starts mid-range."""
        nn.init.trunc_normal_(self.slot_emb, std=0.02)
        nn.init.trunc_normal_(self.expert.pos, std=0.02)
        if self.advantage_embedding is not None:
            nn.init.zeros_(self.advantage_embedding.weight)

    # ------------------------------------------------------------------ construction / IO
    def load_pretrained_image_encoders(self) -> int:
        """Initialise every ResNet-18 camera encoder from ``config.image_encoder_weights`` (safetensors;
        a folder, a file or a hub ref); returns how many encoders were loaded (0 when there is nothing
        to load). What a trainer calls on a fresh model; checkpoints carry the weights themselves."""
        source = self.config.image_encoder_weights
        if source is None or self.image_encoders is None:
            return 0
        for enc in self.image_encoders.values():
            load_resnet18_weights(enc, source)
        return len(self.image_encoders)

    @classmethod
    def from_config_dict(cls, d: Mapping[str, Any]) -> FlowVLAPolicy:
        return cls(FlowVLAConfig.from_dict(d))

    def save_weights(self, path: str | Path) -> None:
        """``model.safetensors`` (all trainable weights + normalisation buffers; no MiniLM)."""
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))

    def load_weights(self, path: str | Path, strict: bool = True) -> None:
        from safetensors.torch import load_file

        self.load_state_dict(load_file(str(path), device=str(self.device)), strict=strict)

    def num_parameters(self, trainable_only: bool = True) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @property
    def device(self) -> torch.device:
        return self.slot_emb.device

    def logprob_mask(self) -> Tensor:
        """``[H, A]`` bool: the executed actions (first ``n_exec``), the only ones RL log-probs score."""
        m = torch.zeros(self.config.chunk_len, self.config.action_dim, dtype=torch.bool, device=self.device)
        m[: self.config.n_exec] = True
        return m

    # ------------------------------------------------------------------ prefix
    def encode_prefix(self, obs: Mapping[str, Any], *, augment: bool = False) -> PrefixCache:
        """Run the encoders and the trunk once for a batch of observations. ``augment``: random shifts."""
        c = self.config
        b = self._batch_size(obs)
        tokens: list[Tensor] = []
        if self.instruction_encoder is not None:
            tokens.append(self.instruction_encoder(self._instruction_embedding(obs, b))[:, None])
        if self.state_encoder is not None:
            state = self._tensor(obs, "state", (b, c.state_dim))
            tokens.append(self.state_encoder(self.normalizer.normalize_state(state.float()))[:, None])
        if self.image_encoders is not None:
            cams = obs.get("cameras")
            if not isinstance(cams, Mapping):
                raise ValueError(
                    f"cameras: expected a mapping of {list(c.camera_names)}, got {type(cams).__name__}"
                )
            imgs = []
            for cam in c.cameras:
                if cam.name not in cams:
                    raise ValueError(f"cameras.{cam.name}: missing")
                img = self._as_tensor(cams[cam.name])
                if img.ndim != 4 or img.shape[0] != b or img.shape[-1] != 3:
                    raise ValueError(f"cameras.{cam.name}: expected [{b}, H, W, 3], got {list(img.shape)}")
                x = preprocess_images(img, *c.image_input_size(cam))  # native size -> model size
                imgs.append(random_shift(x, c.image_augment_pad) if augment else x)
            if c.share_image_encoder and len({x.shape for x in imgs}) == 1:
                enc = self.image_encoders["shared"](torch.cat(imgs, 0))  # one batched conv pass
                tokens += list(enc.split(b, 0))
            else:
                for cam, x in zip(c.cameras, imgs, strict=True):
                    key = "shared" if c.share_image_encoder else cam.name
                    tokens.append(self.image_encoders[key](x))
        h = torch.cat(tokens, dim=1) + self.slot_emb
        if self.advantage_embedding is not None:
            h = h + self.advantage_embedding(self._advantage_indicator(obs, b))[:, None]
        for blk in self.trunk:
            h = blk(h)
        h = self.trunk_norm(h)
        return PrefixCache(h, self.expert.cache_kv(h))

    def _advantage_indicator(self, obs: Mapping[str, Any], b: int) -> Tensor:
        """``obs["advantage"]``: int ``[B]`` (0 unconditional, 1 negative, 2 positive); default positive."""
        ind = obs.get("advantage")
        if ind is None:
            return torch.full((b,), ADVANTAGE_POSITIVE, dtype=torch.long, device=self.device)
        ind = self._as_tensor(ind).long().reshape(-1)
        if ind.shape[0] != b or bool(((ind < 0) | (ind > 2)).any()):
            raise ValueError(f"advantage: expected {b} values in {{0, 1, 2}}, got {ind.tolist()[:8]}")
        return ind

    def _guided_prefixes(self, obs: Mapping[str, Any]) -> tuple[PrefixCache, PrefixCache] | None:
        """(unconditional, positive) prefixes when classifier-free guidance applies to ``obs``."""
        c = self.config
        if not c.advantage_conditioning or c.guidance_scale == 1.0 or "advantage" in obs:
            return None
        b = self._batch_size(obs)
        uncond = self.encode_prefix({**obs, "advantage": torch.zeros(b, dtype=torch.long)})
        return uncond, self.encode_prefix(obs)

    # ------------------------------------------------------------------ velocity
    def velocity(
        self, prefix: PrefixCache, x_t: Tensor, t: Tensor | float, *, return_hidden: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Flow velocity (our convention, normalised actions) ``[N, H, A]`` for ``x_t [N, H, A]``.

        ``N`` may be a multiple of the prefix batch (rows ``b*m .. b*m + m - 1`` belong to
        observation b): the cached prefix is repeated, never recomputed. ``t``: float, 0-d, ``[N]`` or
        ``[N, H]`` (one flow time per action: trained real-time chunking's clean prefix at t = 1).
        """
        n = x_t.shape[0]
        if n != prefix.batch_size:
            if n % prefix.batch_size:
                raise ValueError(f"x_t batch {n} is not a multiple of the prefix batch {prefix.batch_size}")
            prefix = prefix.repeat_interleave(n // prefix.batch_size)
        t = torch.as_tensor(t, device=x_t.device, dtype=x_t.dtype)
        if t.ndim == 0:
            t = t.expand(n)
        v, hidden = self.expert(prefix.kv, x_t, t)
        return (v, hidden) if return_hidden else v

    def noise_std(self, hidden: Tensor) -> Tensor:
        """Flow-Noise per-element std ``[N, H, A]`` from the expert's hidden state."""
        return self.noise_head(hidden.detach() if self.config.noise_head_detach else hidden)

    def _velocity_and_std(self, prefix: PrefixCache, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        v, hidden = self.velocity(prefix, x, t, return_hidden=True)
        return v, self.noise_std(hidden)

    # ------------------------------------------------------------------ training
    def sample_time(self, n: int) -> Tensor:
        """π0's training time in OUR convention: s ~ Beta(1.5, 1) * 0.999 + 0.001 is openpi time
        (1 = noise, so noisy times are favoured), and t = 1 - s in [0, 0.999]."""
        c = self.config
        beta = torch.distributions.Beta(
            torch.tensor(c.time_beta_alpha, device=self.device),
            torch.tensor(c.time_beta_beta, device=self.device),
        )
        s = beta.sample((n,)) * c.time_max + (1.0 - c.time_max)
        return from_openpi_time(s)

    def flow_matching_loss(
        self,
        batch: Mapping[str, Any],
        *,
        noise: Tensor | None = None,
        time: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Conditional flow matching: ``mean_b w_b * mean_{valid h, a} (v(x_t, t) - (x1 - x0))²``.

        ``batch``: an observation dict plus ``"action"`` ``[B, H, A]`` (unnormalised) and optionally
        ``"action_is_pad"`` ``[B, H]`` bool (padded steps do not count; each sample's loss is the mean
        over its valid elements, so short tails are not down-weighted) and ``"weight"`` ``[B]``.
        ``weights`` overrides ``batch["weight"]`` (AWR-style per-sample weights, used as given).
        ``noise`` ``[B, H, A]`` / ``time`` ``[B]`` fix x0 and t (tests, FPO-style paired estimates).
        Random-shift image augmentation applies in training mode. Metrics are detached tensors.
        """
        b = self._batch_size(batch)
        per_sample, valid = self._per_sample_loss(batch, noise, time)
        w = weights if weights is not None else batch.get("weight")
        if w is not None:
            w = self._as_tensor(w).to(per_sample).reshape(b)
            loss = (w * per_sample).mean()
        else:
            loss = per_sample.mean()
        metrics = {
            "loss": loss.detach(),
            "mse": per_sample.mean().detach(),
            "valid_frac": valid[..., 0].mean().detach(),
        }
        return loss, metrics

    def per_sample_loss(
        self, batch: Mapping[str, Any], *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> Tensor:
        """Each sample's flow-matching loss ``[B]`` (the terms :meth:`flow_matching_loss` averages), for
        trainers that weight samples themselves (AWR, RECAP) through :mod:`policies.flow_policy`."""
        return self._per_sample_loss(batch, noise, time)[0]

    def _per_sample_loss(
        self, batch: Mapping[str, Any], noise: Tensor | None, time: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(mean over valid elements of (v - (x1 - x0))² per sample [B], valid mask [B, H, A])``."""
        c = self.config
        b = self._batch_size(batch)
        actions = self._tensor(batch, "action", (b, c.chunk_len, c.action_dim)).float()
        x1 = self.normalizer.normalize_action(actions)
        x0 = torch.randn_like(x1) if noise is None else noise.to(x1)
        t = self.sample_time(b) if time is None else torch.as_tensor(time, device=x1.device, dtype=x1.dtype)
        given = self._rtc_prefix(b, x1.device)  # trained RTC: the executed prefix, given clean
        if given is not None:
            t = per_action_time(t, given)
        tt = t.view(b, -1, 1)
        x_t = (1.0 - tt) * x0 + tt * x1
        target = x1 - x0
        prefix = self.encode_prefix(batch, augment=self.training and c.image_augment_pad > 0)
        v = self.velocity(prefix, x_t, t)
        err = (v - target).square()
        if batch.get("action_is_pad") is not None:
            pad = self._tensor(batch, "action_is_pad", (b, c.chunk_len)).bool()
            valid = (~pad).to(err.dtype)[..., None].expand_as(err)
        else:
            valid = torch.ones_like(err)
        if given is not None:  # no loss on the given prefix: it is an input
            valid = valid * (~given).to(err.dtype)[..., None]
        return (err * valid).sum((1, 2)) / valid.sum((1, 2)).clamp_min(1.0), valid

    def _rtc_prefix(self, b: int, device: torch.device) -> Tensor | None:
        """``[B, H]`` bool, each sample's first d actions (trained real-time chunking; d drawn as
        ``rtc_max_delay`` and ``rtc_zero_delay_prob`` say); None when the policy does not train for it."""
        c = self.config
        if not c.rtc_max_delay:
            return None
        return random_prefix(c.rtc_max_delay, b, c.chunk_len, device, c.rtc_zero_delay_prob)

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        obs_or_prefix: Mapping[str, Any] | PrefixCache,
        *,
        method: Method = "ode",
        num_steps: int | None = None,
        num_samples: int = 1,
        noise: Tensor | None = None,
        step_noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        schedule: SDESchedule | None = None,
        stochastic_steps: Sequence[int] | Tensor | None = None,
        return_iterates: bool = False,
    ) -> FlowSample:
        """Sample ``num_samples`` normalised chunks per observation, encoding each observation once.

        * ``method="ode"``: Euler, deterministic given ``noise``;
        * ``"sde"``: Euler–Maruyama with ``schedule`` (default memoryless; ``SDESchedule("flow_sde",
          0.5)`` is π-RL Flow-SDE) on ``stochastic_steps`` (indices or bool ``[K]`` / ``[B, N, K]``;
          None = all);
        * ``"noise"``: Flow-Noise with the learned std on every step; ``log_prob`` is the exact joint.

        ``noise`` ``[B, N, H, A]`` is the initial x0 and ``step_noise`` ``[B, N, K, H, A]`` the per-step
        normals; when absent they are drawn from ``generator``. Given the same noise, rows do not depend
        on each other (batched == unbatched up to float rounding).
        """
        c = self.config
        guided = (
            self._guided_prefixes(obs_or_prefix)
            if method == "ode" and not isinstance(obs_or_prefix, PrefixCache)
            else None
        )
        if guided is not None:
            prefix = guided[1]
        else:
            prefix = (
                obs_or_prefix if isinstance(obs_or_prefix, PrefixCache) else self.encode_prefix(obs_or_prefix)
            )
        b, n, k = prefix.batch_size, num_samples, num_steps or c.num_inference_steps
        event = (c.chunk_len, c.action_dim)
        dtype = prefix.tokens.dtype
        check_num_steps(k)
        x0 = initial_noise((b, n, *event), noise, generator, self.device, dtype).reshape(b * n, *event)
        flat_step_noise = None
        if step_noise is not None:
            if step_noise.shape != (b, n, k, *event):
                raise ValueError(
                    f"step_noise: expected shape {[b, n, k, *event]}, got {list(step_noise.shape)}"
                )
            if not bool(torch.isfinite(step_noise).all()):
                raise ValueError("step_noise: expected finite values, got NaN or inf")
            flat_step_noise = step_noise.to(self.device, dtype).reshape(b * n, k, *event)
        rows = prefix.repeat_interleave(n)
        mask = self.logprob_mask()
        chain = None
        if method == "ode" and guided is not None:
            # CFG (RECAP / CFGRL): v = (1 - β) v_uncond + β v_positive
            uncond_rows, beta = guided[0].repeat_interleave(n), c.guidance_scale
            res = euler_sample(
                lambda x, t: (1 - beta) * self.velocity(uncond_rows, x, t) + beta * self.velocity(rows, x, t),
                x0,
                k,
                return_iterates=return_iterates,
            )
        elif method == "ode":
            res = euler_sample(lambda x, t: self.velocity(rows, x, t), x0, k, return_iterates=return_iterates)
        elif method in ("sde", "noise"):
            res, schedule = stochastic_sample(
                method,
                lambda x, t: self.velocity(rows, x, t),
                lambda x, t: self._velocity_and_std(rows, x, t),
                x0,
                k,
                schedule=schedule,
                stochastic_steps=_flat_stochastic(stochastic_steps, b, n, k, self.device)
                if method == "sde"
                else None,
                noise=flat_step_noise,
                generator=generator,
                logprob_mask=mask,
            )
        else:
            raise ValueError(f"method must be 'ode', 'sde' or 'noise', got {method!r}")
        iterates = res.iterates.reshape(b, n, k + 1, *event) if res.iterates is not None else None
        if method != "ode":
            chain = denoising_chain(res, method, schedule, b, n, c.n_exec)  # type: ignore[arg-type]
        log_prob = res.log_prob.reshape(b, n) if res.log_prob is not None else None
        return FlowSample(
            actions=res.actions.reshape(b, n, *event),
            iterates=iterates if (return_iterates or method != "ode") else None,
            log_prob=log_prob,
            chain=chain,
        )

    def chain_log_prob(self, prefix: PrefixCache, chain: DenoisingChain) -> Tensor:
        """Log-likelihood ``[B, N]`` of a stored chain under the CURRENT parameters (differentiable)."""
        b = chain.iterates.shape[0]
        if b != prefix.batch_size:
            raise ValueError(f"chain batch {b} != prefix batch {prefix.batch_size}")
        if chain.n_exec != self.config.n_exec:
            raise ValueError(f"chain was scored over n_exec={chain.n_exec}, policy uses {self.config.n_exec}")
        return stored_chain_log_prob(
            chain,
            lambda x, t: self.velocity(prefix, x, t),
            lambda x, t: self._velocity_and_std(prefix, x, t),
            self.logprob_mask(),
        )

    @torch.no_grad()
    def predict_action_chunk(
        self,
        obs: Mapping[str, Any],
        *,
        num_samples: int | None = None,
        method: Method = "ode",
        num_steps: int | None = None,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        clip: bool = True,
    ) -> Tensor:
        """UNnormalised env action chunks: ``[B, H, A]`` (``num_samples=None``) or ``[B, N, H, A]``.

        ``noise``: ``[B, H, A]`` (or ``[B, N, H, A]`` with num_samples). ``clip`` clamps normalised
        actions to [-1, 1] first under min-max normalisation, i.e. to the range seen in the data.
        """
        n = num_samples or 1
        if noise is not None and num_samples is None:
            noise = noise[:, None]
        s = self.sample(
            obs, method=method, num_steps=num_steps, num_samples=n, noise=noise, generator=generator
        )
        a = s.actions
        if clip and self.config.action_norm == "min_max":
            a = a.clamp(-1.0, 1.0)
        a = self.normalizer.unnormalize_action(a)
        return a[:, 0] if num_samples is None else a

    def accel(
        self, iterates: Tensor, prefix_steps: int | None = None, dim_scale: Tensor | None = None
    ) -> Tensor:
        """`accel` uncertainty of ODE iterates ``[..., K + 1, H, A]`` over the executed actions."""
        return accel_score(iterates, self.config.n_exec, prefix_steps, dim_scale)

    # ------------------------------------------------------------------ input helpers
    def _as_tensor(self, x: Any) -> Tensor:
        if isinstance(x, Tensor):
            return x.to(self.device)
        return torch.as_tensor(np.asarray(x), device=self.device)

    def _tensor(self, obs: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> Tensor:
        if key not in obs or obs[key] is None:
            raise ValueError(f"{key}: missing")
        x = self._as_tensor(obs[key])
        if tuple(x.shape) != shape:
            raise ValueError(f"{key}: expected shape {list(shape)}, got {list(x.shape)}")
        return x

    def _batch_size(self, obs: Mapping[str, Any]) -> int:
        for key in ("state", "instruction_embedding", "action"):
            if obs.get(key) is not None:
                return int(np.shape(obs[key])[0]) if not isinstance(obs[key], Tensor) else obs[key].shape[0]
        cams = obs.get("cameras") or {}
        for img in cams.values():
            return int(img.shape[0])
        instr = obs.get("instruction")
        if isinstance(instr, (list, tuple)):
            return len(instr)
        raise ValueError("observation: cannot infer the batch size (no state, camera or instruction list)")

    def _instruction_embedding(self, obs: Mapping[str, Any], b: int) -> Tensor:
        if obs.get("instruction_embedding") is not None:
            return self._tensor(obs, "instruction_embedding", (b, MINILM_DIM)).float()
        instr = obs.get("instruction")
        if instr is None:
            raise ValueError("instruction: missing (give 'instruction' text or 'instruction_embedding')")
        texts = [instr] * b if isinstance(instr, str) else list(instr)
        if len(texts) != b:
            raise ValueError(f"instruction: expected {b} strings, got {len(texts)}")
        return MiniLMEmbedder.embed(texts).to(self.device)


def _image_encoder(c: FlowVLAConfig) -> nn.Module:
    if c.image_encoder == "resnet18":
        return ResNet18Encoder(c.image_tokens_grid, c.d_model, frozen=c.freeze_image_encoder)
    return ImageEncoder(c.image_encoder_width, c.image_encoder_stages, c.image_tokens_grid, c.d_model)


def _flat_stochastic(
    steps: Sequence[int] | Tensor | None, b: int, n: int, k: int, device: torch.device
) -> Tensor | Sequence[int] | None:
    """``[B, N, K]`` per-row masks flattened to ``[B * N, K]``; other forms pass through."""
    if isinstance(steps, Tensor) and steps.ndim == 3:
        if steps.shape != (b, n, k):
            raise ValueError(f"stochastic_steps: expected shape {[b, n, k]}, got {list(steps.shape)}")
        return steps.to(device).reshape(b * n, k)
    return steps

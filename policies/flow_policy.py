"""One contract for flow-matching policies: what trainers, evaluation and the server hold.

:class:`FlowPolicy` is implemented by our FlowVLA (:class:`FlowVLAFlowPolicy`, below) and by LeRobot's
SmolVLA, π0 and π0.5 (:class:`policies.lerobot_flow.LeRobotFlowPolicy`); :func:`policies.loading.load_flow_policy`
loads either from a checkpoint reference. Both are ``torch.nn.Module`` s (``parameters()``, ``train()``,
``state_dict()`` as usual).

**Time**: ours everywhere (t = 0 noise, t = 1 data, ``x_t = (1 - t) x0 + t x1``, velocity ``x1 - x0``;
docs/algorithms.md §0). LeRobot's π0 family runs openpi's convention; its implementation converts at the
boundary through :mod:`policies.flow_vla.conventions` and nowhere else.

**Action spaces**: env units ``[..., H, A]`` (what a robot executes, ``A = action_dim``) and the model's
normalised space ``[..., H, D]`` with ``(H, D) = event_shape``: x_t, noise, velocities, samples and
iterates live there. ``D = A`` for FlowVLA; LeRobot's VLAs pad to ``max_action_dim``, the first A dims
being the robot's (:meth:`FlowPolicy.logprob_mask` is False on the padding and on the unexecuted steps).

**Batches**: our observation dict, ``"state"`` ``[B, S]``, ``"cameras"`` ``{name: [B, H, W, 3] uint8}``,
``"instruction"`` (a string or B strings), plus for :meth:`FlowPolicy.loss` ``"action"`` ``[B, H, A]`` in
env units and optionally ``"action_is_pad"`` ``[B, H]``. Each implementation normalises them itself
(FlowVLA: its statistics; LeRobot: the folder's own pre/post-processors).

**Advantage conditioning (RECAP)**: an observation's ``"advantage"`` (int ``[B]``: 0 unconditioned, 1
negative, 2 positive) conditions a policy made advantage-conditioned by :meth:`FlowPolicy.condition_on_advantage`
(FlowVLA: a learned embedding added to the trunk tokens; LeRobot: "Advantage: positive" / "negative" appended
to the instruction). Observations that name none act as positive, with classifier-free guidance between the
unconditioned and the positive prefix when the guidance scale saved with the policy is not 1.

**Which parameters train** (:meth:`FlowPolicy.set_trainable`, :data:`TRAINABLE_PARTS`): ``"expert"`` = the
action expert and its projections, the VLM / trunk frozen (the CPU default for LeRobot VLAs); ``"full"`` =
everything the model trains; ``"lora"`` = LoRA adapters only (:mod:`policies.lora`, placed by the
architecture's default targets or the settings' own), merged into the weights when the policy is saved, so
the saved checkpoint or folder is an ordinary one.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import numpy as np
import torch
from torch import nn
from vla_rl_client.spec import RobotSpec

from policies.flow_vla import FlowSample, FlowVLAConfig, FlowVLAPolicy, PrefixCache, euler_sample
from policies.flow_vla.conventions import VelocityFn
from policies.flow_vla.sampling import check_num_steps, initial_noise
from policies.lora import LoraSettings, add_lora, lora_state, merged_state_dict
from policies.rtc import RTCSettings, sample_rtc
from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint

Tensor = torch.Tensor
RTCRequest = tuple[int, np.ndarray] | None
"""A row's real-time chunking: (inference delay, queued env-unit actions [n, A]); None = a plain row."""
TrainableParts = Literal["expert", "full", "lora"]
TRAINABLE_PARTS: tuple[str, ...] = get_args(TrainableParts)
EXPERT_MODULES = ("expert.", "noise_head.", "advantage_embedding.")
"""FlowVLA's action head: the expert (with its prefix K/V projections), the Flow-Noise std head, and
RECAP's advantage embedding (new when a policy is made advantage-conditioned: it must learn)."""
NEW_HEADS = ("noise_head.", "advantage_embedding.")
"""FlowVLA's heads that an algorithm adds (fresh): trained whole under LoRA."""
FLOW_VLA_LORA_TARGETS = (
    r"(trunk|expert\.blocks)\.\d+\.(attn\.(qkv|out)|mlp\.(0|2))"
    r"|expert\.(prefix_kv\.\d+\.kv|action_in|action_out|time_mlp\.(0|2))"
)
"""Where LoRA adapters go on FlowVLA by default: the attention and MLP projections of the trunk and the
expert blocks, the expert's prefix K/V projections, its action in / out and time MLP."""


class FlowPolicyError(ValueError):
    """A policy cannot do what was asked of it (a non-flow policy, an unsupported option); says which."""


class Prefix(Protocol):
    """An opaque per-observation encoding (FlowVLA: :class:`PrefixCache`; LeRobot: KV cache + masks)."""

    @property
    def batch_size(self) -> int: ...

    def repeat_interleave(self, n: int) -> Prefix: ...


@runtime_checkable
class FlowPolicy(Protocol):
    """A flow-matching action policy (see the module docstring for time, spaces and batches)."""

    @property
    def chunk_len(self) -> int:
        """H: actions predicted per call."""
        ...

    @property
    def n_exec(self) -> int:
        """Actions executed per call (the RL action is this sub-chunk)."""
        ...

    @property
    def action_dim(self) -> int:
        """A: the robot's action dims (env units)."""
        ...

    @property
    def event_shape(self) -> tuple[int, int]:
        """(H, D): the shape of one normalised chunk in the model's space (D >= A)."""
        ...

    @property
    def num_inference_steps(self) -> int:
        """K used when a sample names none."""
        ...

    @property
    def device(self) -> torch.device: ...

    def logprob_mask(self) -> Tensor:
        """``[H, D]`` bool: the executed steps' robot dims, the only elements RL log-probs score."""
        ...

    def encode_prefix(self, obs: Mapping[str, Any]) -> Prefix:
        """Encode a batch of observations once (VLM / trunk pass); reused for every step and sample."""
        ...

    def velocity(self, prefix: Prefix, x_t: Tensor, t: Tensor | float) -> Tensor:
        """``v(x_t, t)`` ``[N, H, D]`` in our time convention for ``x_t [N, H, D]`` (N = the prefix's rows);
        ``t`` a scalar, ``[N]``, or ``[N, H]`` (one flow time per action: trained RTC; LeRobot's π0.5 takes
        rows of one time only)."""
        ...

    def sample(
        self,
        obs_or_prefix: Mapping[str, Any] | Any,
        *,
        num_steps: int | None = None,
        num_samples: int = 1,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        return_iterates: bool = False,
    ) -> FlowSample:
        """Euler ODE from ``noise`` ``[B, N, H, D]`` (or drawn from ``generator``): normalised chunks
        ``[B, N, H, D]`` (and the K + 1 iterates when asked)."""
        ...

    def predict_action_chunk(
        self,
        obs: Mapping[str, Any],
        *,
        num_steps: int | None = None,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Env-unit chunks ``[B, H, A]`` from ``noise`` ``[B, H, D]`` (or drawn)."""
        ...

    def loss(
        self, batch: Mapping[str, Any], *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> Tensor:
        """Per-sample flow-matching loss ``[B]``: mean over valid (unpadded) steps and robot dims of
        ``(v(x_t, t) - (x1 - x0))²``. ``noise`` ``[B, H, D]`` and ``time`` ``[B]`` (our convention) fix
        x0 and t; drawn otherwise (π0's Beta time). AWR / RECAP weights multiply this."""
        ...

    def sample_time(self, n: int) -> Tensor:
        """``[n]`` training times in our convention, drawn as the policy trains (π0's Beta(1.5, 1))."""
        ...

    def features(self, prefix: Prefix) -> Tensor:
        """``[B, F]`` per-observation features for value heads (the pooled prefix / VLM output)."""
        ...

    def condition_on_advantage(self, guidance_scale: float) -> FlowPolicy:
        """This policy advantage-conditioned (RECAP), acting with ``guidance_scale`` when deployed (saved
        with it); the policy to train from here on (it may be this one)."""
        ...

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env units ``[..., H, A]`` -> the model's space ``[..., H, D]`` (padding dims 0)."""
        ...

    def unnormalize_actions(self, x: Tensor) -> Tensor:
        """The model's space ``[..., H, D]`` -> env units ``[..., H, A]`` (no clipping)."""
        ...

    def executable_actions(self, x: Tensor) -> Tensor:
        """A sample in the model's space ``[..., H, D]`` -> the env-unit chunk ``[..., H, A]`` a robot
        executes, exactly what :meth:`predict_action_chunk` returns for that sample (FlowVLA clips to the
        data range first under min-max normalisation; LeRobot un-normalises unclipped). The policy server
        applies it to the samples it draws itself (it keeps their iterates for the uncertainty)."""
        ...

    def set_trainable(self, parts: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """Choose which parameters train (``requires_grad``) and return them, for the optimiser; ``"lora"``
        adds adapters as ``lora`` says (None: the default :class:`~policies.lora.LoraSettings`)."""
        ...

    def save(
        self,
        folder: str | os.PathLike[str],
        *,
        lineage: Lineage | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the policy in its own format (FlowVLA: our checkpoint; LeRobot: its policy folder)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool = True) -> Any: ...


def check_trainable(parts: str) -> None:
    """Refuse anything but :data:`TRAINABLE_PARTS`; ``"lora"`` without the ``peft`` package names it."""
    if parts == "lora" and importlib.util.find_spec("peft") is None:
        raise FlowPolicyError(
            "trainable: 'lora' needs the peft package, which is not installed here; use 'expert' or 'full'"
        )
    if parts not in TRAINABLE_PARTS:
        raise FlowPolicyError(f"trainable: expected one of {list(TRAINABLE_PARTS)}, got {parts!r}")


def euler_sample_prefix(
    policy: FlowPolicy,
    prefix: Prefix,
    *,
    num_steps: int | None,
    num_samples: int,
    noise: Tensor | None,
    generator: torch.Generator | None,
    return_iterates: bool,
) -> FlowSample:
    """:meth:`FlowPolicy.sample` for a policy that has only ``velocity``: Euler ODE on our time grid
    ``t_k = k / K`` from x0 ``[B, N, H, D]``, every row of observation b using b's prefix."""
    b, n = prefix.batch_size, num_samples
    k = num_steps or policy.num_inference_steps
    check_num_steps(k)
    event = policy.event_shape
    x0 = initial_noise((b, n, *event), noise, generator, policy.device, torch.float32)
    rows = prefix.repeat_interleave(n)
    res = euler_sample(
        lambda x, t: policy.velocity(rows, x, t),
        x0.reshape(b * n, *event),
        k,
        return_iterates=return_iterates,
    )
    iterates = res.iterates.reshape(b, n, k + 1, *event) if res.iterates is not None else None
    return FlowSample(actions=res.actions.reshape(b, n, *event), iterates=iterates, log_prob=None, chain=None)


def masked_mean_per_sample(err: Tensor, action_is_pad: Tensor | None) -> Tensor:
    """``err`` ``[B, H, A]`` averaged per sample over the steps that are not padding -> ``[B]``."""
    if action_is_pad is None:
        return err.mean((1, 2))
    valid = (~action_is_pad.bool()).to(err.dtype)[..., None].expand_as(err)
    return (err * valid).sum((1, 2)) / valid.sum((1, 2)).clamp_min(1.0)


@torch.no_grad()
def seeded_chunks(policy: Any, obs: dict[str, Any], seed: int, num_steps: int | None) -> np.ndarray:
    """float32 [N, H, A] env-unit chunks of ``policy.predict_action_chunk`` (a FlowVLA or any flow policy)
    for a batch of observations (state, cameras, instruction), its initial noise drawn from ``seed``."""
    gen = torch.Generator(device=policy.device).manual_seed(int(seed))
    chunks = policy.predict_action_chunk(
        {"state": obs["state"], "cameras": obs.get("cameras", {}), "instruction": obs["instruction"]},
        num_steps=num_steps,
        generator=gen,
    )
    return chunks.float().cpu().numpy()


@torch.no_grad()
def seeded_rtc_chunks(
    policy: FlowPolicy, obs: dict[str, Any], seed: int, num_steps: int | None, rtc: list[RTCRequest]
) -> np.ndarray:
    """:func:`seeded_chunks` of a flow policy with real-time chunking on the rows whose ``rtc`` is
    ``(delay, queued env-unit actions [n, A])`` (None: plain), LeRobot's default settings
    (:func:`policies.rtc.sample_rtc`): the same initial noise, so rows without RTC get the same chunks."""
    gen = torch.Generator(device=policy.device).manual_seed(int(seed))
    b = len(rtc)
    x0 = initial_noise((b, *policy.event_shape), None, gen, policy.device, torch.float32)
    batch = {"state": obs["state"], "cameras": obs.get("cameras", {}), "instruction": obs["instruction"]}
    res = sample_rtc(policy, batch, x0, rtc, RTCSettings(), num_steps)
    return policy.executable_actions(res.actions).float().cpu().numpy()


@dataclass
class FlowChunkPolicy:
    """A flow policy as evaluation's ``ChunkPolicy`` (:mod:`vla_rl.evaluation`): seeded initial noise,
    env-unit chunks from :meth:`FlowPolicy.predict_action_chunk`; for trainers that hold a policy behind
    the contract (a LeRobot VLA has no :class:`~policies.loading.LoadedPolicy`)."""

    policy: FlowPolicy
    spec: RobotSpec

    @property
    def chunk_len(self) -> int:
        return self.policy.chunk_len

    @property
    def n_exec(self) -> int:
        return self.policy.n_exec

    def predict_chunks(
        self, obs: dict[str, Any], seed: int, rtc: list[RTCRequest] | None = None
    ) -> np.ndarray:
        """:func:`seeded_chunks`: the chunks a loaded checkpoint of this policy gives (with ``rtc``:
        :func:`seeded_rtc_chunks`)."""
        if rtc is not None:
            return seeded_rtc_chunks(self.policy, obs, seed, None, rtc)
        return seeded_chunks(self.policy, obs, seed, None)


# ---------------------------------------------------------------------------- FlowVLA
class FlowVLAFlowPolicy(nn.Module):
    """Our :class:`FlowVLAPolicy` behind the contract: every method delegates to the model (its numbers
    unchanged); the robot spec and the base checkpoint's lineage ride along for :meth:`save`."""

    def __init__(self, model: FlowVLAPolicy, spec: RobotSpec, base: CheckpointInfo | None = None) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.base = base
        self._full = {n for n, p in model.named_parameters() if p.requires_grad}  # what the config trains

    @classmethod
    def from_checkpoint(cls, model: FlowVLAPolicy, info: CheckpointInfo) -> FlowVLAFlowPolicy:
        return cls(model, info.robot_spec, info)

    # ---------------------------------------------------------------- shapes
    @property
    def chunk_len(self) -> int:
        return self.model.config.chunk_len

    @property
    def n_exec(self) -> int:
        return self.model.config.n_exec

    @property
    def action_dim(self) -> int:
        return self.model.config.action_dim

    @property
    def event_shape(self) -> tuple[int, int]:
        return (self.model.config.chunk_len, self.model.config.action_dim)

    @property
    def num_inference_steps(self) -> int:
        return self.model.config.num_inference_steps

    @property
    def rtc_max_delay(self) -> int:
        """The largest executed prefix the policy was trained to take given (0: not trained for RTC)."""
        return self.model.config.rtc_max_delay

    @property
    def rtc_zero_delay_prob(self) -> float | None:
        """How often its training delay was 0 (None: d ~ U{0..rtc_max_delay}); lineage, not serving."""
        return self.model.config.rtc_zero_delay_prob

    @property
    def device(self) -> torch.device:
        return self.model.device

    def logprob_mask(self) -> Tensor:
        return self.model.logprob_mask()

    # ---------------------------------------------------------------- flow
    def encode_prefix(self, obs: Mapping[str, Any]) -> PrefixCache:
        return self.model.encode_prefix(obs)

    def velocity(self, prefix: PrefixCache, x_t: Tensor, t: Tensor | float) -> Tensor:
        return self.model.velocity(prefix, x_t, t)  # type: ignore[return-value]

    def observation_velocity(self, obs: Mapping[str, Any]) -> VelocityFn:
        """``v(x, t)`` for ``obs`` as :meth:`sample` integrates it: classifier-free guidance between the
        unconditioned and the positive prefix when the policy's guidance scale applies (RECAP)."""
        guided = self.model._guided_prefixes(obs)
        if guided is None:
            prefix = self.encode_prefix(obs)
            return lambda x, t: self.velocity(prefix, x, t)
        uncond, cond, beta = *guided, self.model.config.guidance_scale
        return lambda x, t: (1 - beta) * self.velocity(uncond, x, t) + beta * self.velocity(cond, x, t)

    def sample(
        self,
        obs_or_prefix: Mapping[str, Any] | PrefixCache,
        *,
        num_steps: int | None = None,
        num_samples: int = 1,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        return_iterates: bool = False,
    ) -> FlowSample:
        return self.model.sample(
            obs_or_prefix,
            num_steps=num_steps,
            num_samples=num_samples,
            noise=noise,
            generator=generator,
            return_iterates=return_iterates,
        )

    def predict_action_chunk(
        self,
        obs: Mapping[str, Any],
        *,
        num_steps: int | None = None,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Clipped to [-1, 1] before un-normalising under min-max normalisation, as FlowVLA deploys."""
        return self.model.predict_action_chunk(obs, num_steps=num_steps, noise=noise, generator=generator)

    def loss(
        self, batch: Mapping[str, Any], *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> Tensor:
        return self.model.per_sample_loss(batch, noise=noise, time=time)

    def sample_time(self, n: int) -> Tensor:
        return self.model.sample_time(n)

    def features(self, prefix: PrefixCache) -> Tensor:
        """The mean trunk token ``[B, d_model]``."""
        return prefix.pooled()

    def condition_on_advantage(self, guidance_scale: float) -> FlowVLAFlowPolicy:
        """A new FlowVLA with the same weights plus RECAP's advantage embedding (fresh, as the model
        initialises it) and ``guidance_scale`` in its config; an already conditioned model keeps its
        embedding."""
        return self.rebuilt(advantage_conditioning=True, guidance_scale=guidance_scale)

    def rebuilt(self, **config: Any) -> FlowVLAFlowPolicy:
        """A new FlowVLA of this config with ``config`` overriding it, carrying this one's weights (the
        trainers' policy to update, apart from the base they score with). Building the model draws its
        fresh initialisation from the global generator, as the trainers always did, so their later draws
        are unchanged."""
        try:
            model = FlowVLAPolicy(FlowVLAConfig.from_dict(self.model.config.to_dict() | config)).to(
                self.device
            )
        except ValueError as e:
            raise FlowPolicyError(str(e)) from None
        missing, unexpected = model.load_state_dict(self.model.state_dict(), strict=False)
        if unexpected or set(missing) - {"advantage_embedding.weight"}:
            raise FlowPolicyError(f"base weights do not fit: missing {missing}, unexpected {unexpected}")
        base = replace(self.base, model_config=model.config.to_dict()) if self.base is not None else None
        return FlowVLAFlowPolicy(model, self.spec, base)

    @property
    def lineage(self) -> Lineage | None:
        """The checkpoint's lineage (None for a model built here)."""
        return self.base.lineage if self.base is not None else None

    def normalize_actions(self, actions: Tensor) -> Tensor:
        return self.model.normalizer.normalize_action(actions)

    def unnormalize_actions(self, x: Tensor) -> Tensor:
        return self.model.normalizer.unnormalize_action(x)

    def executable_actions(self, x: Tensor) -> Tensor:
        """Clipped to [-1, 1] under min-max normalisation, then un-normalised (``predict_action_chunk``'s
        ``clip``)."""
        if self.model.config.action_norm == "min_max":
            x = x.clamp(-1.0, 1.0)
        return self.model.normalizer.unnormalize_action(x)

    # ---------------------------------------------------------------- training / IO
    def set_trainable(self, parts: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """``"expert"``: the action expert (with its prefix K/V projections), the noise head and RECAP's
        advantage embedding; the encoders, trunk and other embeddings frozen. ``"full"``: everything the
        config trains (a frozen ResNet-18 backbone stays frozen). ``"lora"``: LoRA adapters (``lora``,
        placed by :data:`FLOW_VLA_LORA_TARGETS` unless it names targets) plus the noise head and RECAP's
        advantage embedding, whole; merged into the weights when saved."""
        check_trainable(parts)
        if parts == "lora":
            heads = tuple(h for h in NEW_HEADS if any(n.startswith(h) for n in self._full))
            try:
                return add_lora(
                    self.model,
                    lora or LoraSettings(),
                    default_targets=FLOW_VLA_LORA_TARGETS,
                    heads=heads,
                    what="flow_vla",
                )[1]
            except ValueError as e:
                raise FlowPolicyError(str(e)) from None
        if lora_state(self.model) is not None:
            raise FlowPolicyError(
                f"trainable: {parts!r} on a policy that carries LoRA adapters; save it (the adapters are "
                "merged) and train the saved checkpoint"
            )
        for name, p in self.model.named_parameters():
            p.requires_grad = name in self._full and (parts == "full" or name.startswith(EXPERT_MODULES))
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(
        self,
        folder: str | os.PathLike[str],
        *,
        lineage: Lineage | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Path:
        """Our checkpoint (``config.json`` with hashes, ``model.safetensors``, model card); lineage
        defaults to the base checkpoint's."""
        model = self.model
        base = self.base
        if lineage is None:
            lineage = base.lineage if base is not None else Lineage(algorithm="unknown")
        adapters = lora_state(model)
        if adapters is not None:
            lineage = replace(lineage, lora=adapters.record())
        info = CheckpointInfo(
            policy_type="flow_vla",
            model_config=model.config.to_dict(),
            robot_spec=self.spec,
            normalization=base.normalization if base is not None else model.config.normalization_stats or {},
            lineage=lineage,
            metrics=dict(metrics or {}),
        )
        save_checkpoint(folder, merged_state_dict(model), info)
        return Path(folder)

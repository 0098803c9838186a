"""Stochastic denoising chains on any flow policy: what Flow-Noise / Flow-SDE PPO samples and re-scores.

π-RL makes a flow policy stochastic by injecting noise into its K-step Euler chain, which gives an exact,
differentiable log-likelihood of the executed action sub-chunk (docs/algorithms.md §3).
:class:`StochasticFlowPolicy` builds those chains on the flow-policy contract
(:mod:`policies.flow_policy`): it needs only ``encode_prefix`` and ``velocity`` (plus, for Flow-Noise, the
action expert's hidden state), so our FlowVLA and LeRobot's SmolVLA / π0 / π0.5 run the same code:

* ``sample(prefix, method="sde")``: Euler–Maruyama on :func:`~policies.flow_vla.sampling.sde_kernel` over
  ``velocity`` (π-RL's ``SDESchedule("flow_sde", a)``) on the chosen steps, ODE elsewhere;
* ``sample(prefix, method="noise")``: every step ``N(x + dt v, σ_φ²)`` with σ_φ from a learned
  :class:`~policies.flow_vla.modeling_flow_vla.NoiseHead` on the expert's last hidden state, the exact
  joint log-prob of the chain (the initial normal included);
* ``chain_log_prob(prefix, chain)``: the same sum for a stored chain under the current weights, all K
  steps in one batch (PPO's ratio).

Log-probs count only :meth:`~policies.flow_policy.FlowPolicy.logprob_mask`: the executed steps' robot
dims. LeRobot's VLAs pad actions to ``max_action_dim``; the chain runs in the padded space (the padding
draws noise too, as the model sees it) but the padding never enters a log-prob or an entropy.

Where the noise head reads the expert's hidden state:

* FlowVLA (:class:`FlowVLAStochastic`): its own ``noise_head`` on the expert's output tokens, saved in
  our checkpoint (numbers identical to :meth:`FlowVLAPolicy.sample`);
* LeRobot (:class:`LeRobotStochastic`): a forward pre-hook on the model's ``action_out_proj`` captures its
  input (the expert's suffix output ``[N, H, W]``, the same tensor LeRobot projects to the velocity) for
  the duration of one ``velocity`` call; the head maps it to a std per padded action dim. The head is not
  part of LeRobot's model: it is saved beside the folder (:data:`NOISE_HEAD_FILE`, LeRobot ignores it) and
  picked up again when a later run starts from that folder. Deployment never uses it (the ODE).

Conditioning: PPO collects observations without their instruction (one task per run); the wrapper adds
it (FlowVLA: the MiniLM embedding computed once; LeRobot: the text, tokenised by its pre-processor).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from policies.flow_policy import FlowPolicy, FlowPolicyError, FlowVLAFlowPolicy, Prefix, TrainableParts
from policies.flow_vla import DenoisingChain, FlowSample, FlowVLAConfig, SDESchedule
from policies.flow_vla.modeling_flow_vla import (
    NoiseHead,
    denoising_chain,
    stochastic_sample,
    stored_chain_log_prob,
)
from policies.flow_vla.sampling import check_num_steps, initial_noise
from policies.lora import LoraSettings

Tensor = torch.Tensor
ChainMethod = Literal["sde", "noise"]
NOISE_HEAD_FILE = "vla_rl_noise_head.safetensors"
"""Beside a LeRobot policy folder: the Flow-Noise std head trained with it (sizes in its metadata)."""
DEFAULT_STD_RANGE = (FlowVLAConfig.noise_std_min, FlowVLAConfig.noise_std_max)
"""RLinf's Flow-Noise std bounds (normalised action units), FlowVLA's defaults."""
DEFAULT_NOISE_HIDDEN = FlowVLAConfig.noise_head_hidden


class StochasticFlowPolicy(nn.Module):
    """A :class:`~policies.flow_policy.FlowPolicy` with noise-injected chains (see the module docstring).

    Subclasses say where Flow-Noise's std comes from (:meth:`velocity_and_std`) and how a normalised
    chunk becomes env actions (:meth:`to_env`); sampling and scoring are shared.
    """

    def __init__(self, policy: FlowPolicy) -> None:
        super().__init__()
        self.policy = policy

    # ---------------------------------------------------------------- shapes
    @property
    def n_exec(self) -> int:
        return self.policy.n_exec

    @property
    def action_dim(self) -> int:
        return self.policy.action_dim

    @property
    def event_shape(self) -> tuple[int, int]:
        return self.policy.event_shape

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def state_dim(self) -> int:
        """Dims of the normalised state :meth:`normalize_state` returns (0: the policy has none to give)."""
        return 0

    @property
    def feature_dim(self) -> int:
        """F of :meth:`features` (a value head's input width)."""
        raise NotImplementedError

    def logprob_mask(self) -> Tensor:
        return self.policy.logprob_mask()

    # ---------------------------------------------------------------- to override
    def observation(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        """``obs`` with the run's instruction added (PPO's observations carry none)."""
        raise NotImplementedError

    def velocity_and_std(self, prefix: Prefix, x: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
        """Flow-Noise's step: the velocity ``[N, H, D]`` and the learned std ``[N, H, D]`` at (x, t)."""
        raise NotImplementedError

    def to_env(self, x: Tensor) -> Tensor:
        """Normalised chunks ``[B, H, D]`` -> env units ``[B, H, A]``, as the policy deploys them."""
        raise NotImplementedError

    def normalize_state(self, state: Tensor) -> Tensor:
        raise FlowPolicyError(
            f"critic: 'state' is not available for {type(self.policy).__name__}; use 'prefix'"
        )

    def actor_parameters(self, scope: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """Mark what PPO's actor trains (``requires_grad``) and return it: ``"full"`` the policy's trainable
        weights, ``"expert"`` the action expert with its projections (VLM / trunk frozen), ``"lora"`` LoRA
        adapters as ``lora`` says (the contract's ``set_trainable``); the noise head always."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def encode_prefix(self, obs: Mapping[str, Any]) -> Prefix:
        return self.policy.encode_prefix(self.observation(obs))

    def velocity(self, prefix: Prefix, x: Tensor, t: Tensor | float) -> Tensor:
        return self.policy.velocity(prefix, x, t)

    def features(self, prefix: Prefix) -> Tensor:
        return self.policy.features(prefix)

    def sample(
        self,
        prefix: Prefix,
        *,
        method: ChainMethod,
        num_steps: int,
        generator: torch.Generator | None = None,
        schedule: SDESchedule | None = None,
        stochastic_steps: list[int] | Tensor | None = None,
    ) -> FlowSample:
        """One noise-injected chunk per observation: actions ``[B, 1, H, D]``, the chain and its log-prob
        ``[B, 1]`` over the executed robot dims. ``stochastic_steps`` (Flow-SDE): the step indices that draw
        noise (None = all); Flow-Noise draws on every step."""
        b, k, event = prefix.batch_size, num_steps, self.event_shape
        check_num_steps(k)
        x0 = initial_noise((b, 1, *event), None, generator, self.device, torch.float32).reshape(b, *event)
        if method not in ("sde", "noise"):
            raise FlowPolicyError(f"method: expected 'sde' or 'noise', got {method!r}")
        res, schedule = stochastic_sample(
            method,
            lambda x, t: self.velocity(prefix, x, t),
            lambda x, t: self.velocity_and_std(prefix, x, t),
            x0,
            k,
            schedule=schedule,
            stochastic_steps=stochastic_steps if method == "sde" else None,
            noise=None,
            generator=generator,
            logprob_mask=self.logprob_mask(),
        )
        assert res.log_prob is not None
        chain = denoising_chain(res, method, schedule, b, 1, self.n_exec)
        return FlowSample(
            actions=res.actions.reshape(b, 1, *event),
            iterates=chain.iterates,
            log_prob=res.log_prob.reshape(b, 1),
            chain=chain,
        )

    def chain_log_prob(
        self, prefix: Prefix, chain: DenoisingChain, *, stds: list[Tensor] | None = None
    ) -> Tensor:
        """Log-likelihood ``[B, N]`` of stored chains under the CURRENT weights (differentiable); the K
        steps of every chain run as one batch. ``stds`` collects Flow-Noise's std (the entropy bonus)."""
        b, n, kp1 = chain.iterates.shape[:3]
        if b != prefix.batch_size:
            raise FlowPolicyError(f"chain: batch {b} != the prefix's {prefix.batch_size}")
        if chain.n_exec != self.n_exec:
            raise FlowPolicyError(
                f"chain: scored over n_exec={chain.n_exec}, the policy executes {self.n_exec}"
            )
        if chain.method not in ("sde", "noise"):
            raise FlowPolicyError(f"chain.method: expected 'sde' or 'noise', got {chain.method!r}")
        rows = prefix.repeat_interleave(n * (kp1 - 1))  # row (chain, step) -> its observation

        def velocity_and_std(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
            v, std = self.velocity_and_std(rows, x, t)
            if stds is not None:
                stds.append(std)
            return v, std

        return stored_chain_log_prob(
            chain, lambda x, t: self.velocity(rows, x, t), velocity_and_std, self.logprob_mask()
        )


# ---------------------------------------------------------------------------- FlowVLA
class FlowVLAStochastic(StochasticFlowPolicy):
    """Our FlowVLA: its own noise head, state normaliser and deployment clipping."""

    def __init__(self, policy: FlowVLAFlowPolicy, instruction: str, embedding: Tensor | None = None) -> None:
        """``embedding`` ``[1, 384]``: the instruction's MiniLM embedding when already computed."""
        super().__init__(policy)
        self.model = policy.model
        self.embedding: Tensor | None = None
        if self.model.config.uses_instruction:  # one task, one instruction: embed it once
            from policies.flow_vla import embed_instructions

            emb = embedding if embedding is not None else embed_instructions([instruction])
            self.embedding = emb.to(policy.device)

    @property
    def state_dim(self) -> int:
        return self.model.config.state_dim

    @property
    def feature_dim(self) -> int:
        return self.model.config.d_model

    def observation(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(obs)
        if self.embedding is not None:
            out["instruction_embedding"] = self.embedding.expand(self.model._batch_size(obs), -1)
        return out

    def velocity_and_std(self, prefix: Prefix, x: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
        v, hidden = self.model.velocity(prefix, x, t, return_hidden=True)  # type: ignore[arg-type,misc]
        return v, self.model.noise_std(hidden)

    def to_env(self, x: Tensor) -> Tensor:
        """Clipped to [-1, 1] first under min-max normalisation, as :meth:`FlowVLAPolicy.predict_action_chunk`."""
        if self.model.config.action_norm == "min_max":
            x = x.clamp(-1.0, 1.0)
        return self.model.normalizer.unnormalize_action(x)

    def normalize_state(self, state: Tensor) -> Tensor:
        return self.model.normalizer.normalize_state(state)

    def actor_parameters(self, scope: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """``"full"``: every weight (PPO's historical scope, frozen encoders included); ``"expert"``: the
        expert and the noise head; ``"lora"``: the contract's adapters, the noise head whole."""
        if scope == "lora":
            return self.policy.set_trainable(scope, lora)
        params = []
        for name, p in self.model.named_parameters():
            train = scope == "full" or name.startswith(("expert.", "noise_head."))
            p.requires_grad_(train)
            if train:
                params.append(p)
        return params


# ---------------------------------------------------------------------------- LeRobot
class LeRobotStochastic(StochasticFlowPolicy):
    """LeRobot's SmolVLA / π0 / π0.5: Flow-Noise's std from a head on ``action_out_proj``'s input."""

    def __init__(
        self,
        policy: Any,  # policies.lerobot_flow.LeRobotFlowPolicy
        instruction: str,
        *,
        std_range: tuple[float, float] | None = None,
        hidden: tuple[int, ...] = DEFAULT_NOISE_HIDDEN,
        detach: bool = False,
    ) -> None:
        super().__init__(policy)
        self.instruction = instruction
        self.expert_out: nn.Linear = policy.policy.model.action_out_proj
        saved = _read_noise_head(policy.path)
        lo, hi = std_range or (saved["std_range"] if saved else DEFAULT_STD_RANGE)
        hidden = tuple(saved["hidden"]) if saved and std_range is None else hidden
        self.noise_head = NoiseHead(self.expert_out.in_features, self.event_shape[1], hidden, lo, hi)
        self.noise_head_config = {"hidden": list(hidden), "std_range": [float(lo), float(hi)]}
        if saved and saved["hidden"] == list(hidden):
            self.noise_head.load_state_dict(saved["weights"])
        self.noise_head.to(self.device)
        self.detach = detach

    @property
    def feature_dim(self) -> int:
        return self.policy.feature_dim

    def observation(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        return {**obs, "instruction": self.instruction}

    def velocity_and_std(self, prefix: Prefix, x: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
        seen: list[Tensor] = []
        handle = self.expert_out.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            v = self.velocity(prefix, x, t)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise FlowPolicyError(
                f"noise head: expected one action_out_proj call per velocity, saw {len(seen)}"
            )
        hidden = seen[0].float()
        return v, self.noise_head(hidden.detach() if self.detach else hidden)

    def to_env(self, x: Tensor) -> Tensor:
        """The post-processor's un-normalisation, unclipped (as LeRobot deploys)."""
        return self.policy.unnormalize_actions(x)

    def actor_parameters(self, scope: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """The contract's ``set_trainable`` plus the noise head; eval mode stays
        (no dropout anywhere: rollouts and updates must see the same function)."""
        params = self.policy.set_trainable(scope, lora)
        self.policy.eval()
        return [*params, *self.noise_head.parameters()]

    def save_noise_head(self, folder: str | os.PathLike[str]) -> Path:
        """Write the head beside a saved LeRobot folder (:data:`NOISE_HEAD_FILE`), through a temporary file
        moved into place, so a later run never reads half a head."""
        from safetensors.torch import save_file

        path = Path(folder) / NOISE_HEAD_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        weights = {k: v.detach().cpu().contiguous() for k, v in self.noise_head.state_dict().items()}
        save_file(weights, str(tmp), metadata={"config": json.dumps(self.noise_head_config)})
        os.replace(tmp, path)
        return path


def _read_noise_head(folder: Path | None) -> dict[str, Any] | None:
    """A saved head's config and weights, or None when the folder has none."""
    path = Path(folder) / NOISE_HEAD_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        config = json.loads((f.metadata() or {}).get("config", "{}"))
        weights = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (a safetensors handle)
    if not isinstance(config.get("hidden"), list) or len(config.get("std_range") or ()) != 2:
        raise FlowPolicyError(f"{path}: metadata.config: expected hidden and std_range, got {config!r}")
    return {"hidden": config["hidden"], "std_range": tuple(config["std_range"]), "weights": weights}


def stochastic_policy(
    policy: FlowPolicy,
    instruction: str,
    *,
    std_range: tuple[float, float] | None = None,
) -> StochasticFlowPolicy:
    """The noise-injecting wrapper for ``policy``: our FlowVLA (its std range is its config's) or a LeRobot
    flow VLA (``std_range`` None: the saved head's, else RLinf's 0.08-0.16)."""
    if isinstance(policy, FlowVLAFlowPolicy):
        return FlowVLAStochastic(policy, instruction)
    from policies.lerobot_flow import LeRobotFlowPolicy

    if isinstance(policy, LeRobotFlowPolicy):
        return LeRobotStochastic(policy, instruction, std_range=std_range)
    raise FlowPolicyError(f"policy: no stochastic chains for {type(policy).__name__}")

"""The models a server hosts: the :class:`ServedModel` protocol, any flow policy behind the contract as one
(:class:`FlowPolicyModel`; our checkpoints through :class:`FlowVLAModel`), a loaded version
(:class:`ServedVersion`) and a model id's slot (:class:`ModelSlot`): its serving, previous and staged
versions, bounded queue and batcher thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np
import torch
from vla_rl_client.spec import RobotSpec

from policies.failure import FAILURE_DIR, FailurePredictor, decision_features, find_predictor
from policies.flow_policy import FlowPolicy, FlowVLAFlowPolicy
from policies.flow_vla.uncertainty import accel_score
from policies.loading import LoadedFlowPolicy, LoadedPolicy
from policies.rtc import RTCSettings, sample_rtc, step_cap
from server.batching import BatchQueue, LatencyWindow, RTCReport, RTCRequest, _Pending, _Result
from server.compiled import CompiledVelocity, batch_buckets, bucket_for, compile_options, velocity_owner
from server.config import CompileMode
from server.stage_timing import timed_prefix
from vla_rl.core.rpc import RequestError
from vla_rl.hub.checkpoint import CheckpointError

log = logging.getLogger("vla_rl.server")


def initial_noise(seed: int, chunk_len: int, action_dim: int) -> np.ndarray:
    """The float32 [H, A] initial flow noise a request with ``seed`` gets (clients can reproduce it).

    Drawn on the CPU with its own generator so it is the same on any device and in any batch.
    """
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn((chunk_len, action_dim), generator=gen, dtype=torch.float32).numpy()


def spec_problems(serving: RobotSpec, new: RobotSpec) -> list[str]:
    """Why a robot talking to ``serving`` could not talk to ``new`` (empty = compatible)."""
    problems = []
    if serving.state_dim != new.state_dim:
        problems.append(f"state_dim {serving.state_dim} -> {new.state_dim}")
    if serving.action_dim != new.action_dim:
        problems.append(f"action_dim {serving.action_dim} -> {new.action_dim}")
    old_cams = {c.name: c.shape for c in serving.cameras}
    new_cams = {c.name: c.shape for c in new.cameras}
    if old_cams != new_cams:
        problems.append(f"cameras {old_cams} -> {new_cams}")
    return problems


class ServedModel(Protocol):
    """What the server needs from a hosted model: a flow policy behind the contract (:class:`FlowPolicyModel`:
    our FlowVLA, LeRobot's SmolVLA / π0 / π0.5) or another LeRobot policy
    (:class:`policies.lerobot_adapter.LeRobotModel`: ACT, Diffusion, ...)."""

    ref: str
    commit: str

    @property
    def spec(self) -> RobotSpec: ...
    @property
    def chunk_len(self) -> int: ...
    @property
    def n_exec(self) -> int: ...
    @property
    def policy_type(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def noise_shape(self) -> tuple[int, int] | None: ...  # per-request initial noise; None = takes none

    def infer(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
    ) -> np.ndarray: ...

    # Optional: ``infer_scored(...) -> (actions [B, H, A], uncertainty float32 [B])`` from the same pass,
    # with ``uncertainty_kind`` naming the score. A model without it replies with no uncertainty.
    # Optional: ``rtc_mode`` ("guided" / "trained"), ``rtc_report(RTCRequest) -> RTCReport`` and an
    # ``rtc=`` argument of ``infer_scored``: the model runs real-time chunking (RTC requests are refused
    # by a model without them).


Batch = tuple[np.ndarray, Mapping[str, np.ndarray], list[str], np.ndarray | None]
"""One batch's states [B, S], cameras {name: [B, H, W, 3]}, instructions and initial noise [B, H, D]."""

UNCERTAINTY_KIND = "accel"
"""The score flow-policy replies carry: :func:`policies.flow_vla.uncertainty.accel_score` of the executed
window's ODE iterates, default prefix (round(K / 2) steps), on the robot's dims of the normalised actions
(no extra dim_scale)."""


class FlowPolicyModel:
    """A flow-matching policy behind the contract (:class:`~policies.flow_policy.FlowPolicy`) as a
    :class:`ServedModel`: FlowVLA and LeRobot's flow VLAs are batched the same way.

    A batch is one :meth:`~policies.flow_policy.FlowPolicy.sample` call on the batch's observations: one
    prefix pass (each row its own observation and instruction), then K Euler steps for the whole batch from
    each request's own initial noise, so a row's chunk does not depend on its batch. ``sample`` gets the
    observations, never a pre-encoded prefix, so a policy that guides itself on observations (RECAP's
    classifier-free guidance at its saved scale, FlowVLA's ``guidance_scale``) is served guided.
    """

    uncertainty_kind = UNCERTAINTY_KIND
    rtc_settings = RTCSettings()  # how guided RTC weighs queued actions (the server sets its config's)

    def __init__(
        self,
        policy: FlowPolicy,
        *,
        spec: RobotSpec,
        policy_type: str,
        commit: str,
        ref: str,
        num_steps: int | None = None,
    ) -> None:
        self.policy, self.spec, self.policy_type = policy, spec, policy_type
        self.commit, self.ref, self.num_steps = commit, ref, num_steps

    @classmethod
    def from_loaded(cls, loaded: LoadedFlowPolicy) -> FlowPolicyModel:
        return cls(
            loaded.policy,
            spec=loaded.spec,
            policy_type=loaded.policy_type,
            commit=loaded.commit,
            ref=loaded.ref,
            num_steps=loaded.num_steps,
        )

    chunk_len = property(lambda self: self.policy.chunk_len)
    n_exec = property(lambda self: self.policy.n_exec)
    device = property(lambda self: self.policy.device)
    noise_shape = property(lambda self: self.policy.event_shape)  # (H, D): the model's padded action dims

    @property
    def rtc_max_delay(self) -> int:
        """A policy trained for real-time chunking: the largest delay it takes (0: not trained so)."""
        return int(getattr(self.policy, "rtc_max_delay", 0))

    @property
    def rtc_mode(self) -> str:
        """The real-time chunking it runs: trained (the executed prefix given clean, as the policy
        trained) or guided (training-free guidance over the contract's velocity, any flow policy)."""
        return "trained" if self.rtc_max_delay else "guided"

    def rtc_report(self, req: RTCRequest) -> RTCReport:
        """How :meth:`infer_scored` applied ``req`` (the settings it used, the horizon capped at the queue)."""
        queued = min(len(req.queued), self.chunk_len)
        if self.rtc_mode == "trained":
            return RTCReport("trained", req.delay, queued)
        horizon = min(self.rtc_settings.execution_horizon or queued, queued)
        k = self.num_steps or self.policy.num_inference_steps
        return RTCReport(
            self.rtc_mode, req.delay, queued, horizon, step_cap(self.rtc_settings.max_guidance_weight, k)
        )

    def infer(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
    ) -> np.ndarray:
        return self.infer_scored(states, cameras, instructions, noise)[0]

    def infer_scored(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
        rtc: list[RTCRequest | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Env-unit chunks [B, H, A] and their ``accel`` uncertainty [B], from one ODE sample per row.

        The same computation as ``policy.predict_action_chunk`` (Euler ODE from ``noise``, then
        :meth:`~policies.flow_policy.FlowPolicy.executable_actions`), keeping the K + 1 Euler iterates the
        loop computes anyway: the score costs no forward pass, only a few vector norms over them. A
        one-step head (FQL) has no velocity change to score: NaN. Rows with an ``rtc`` request are
        sampled with real-time chunking (:mod:`policies.rtc`), the others as without it, in one pass.
        """
        policy = self.policy
        device = policy.device
        with torch.inference_mode():
            obs = self._observation(states, cameras, instructions)
            x0 = None if noise is None else torch.from_numpy(noise).to(device)
            if rtc is not None and any(r is not None for r in rtc):
                actions, iterates = self._sample_rtc(obs, x0, rtc)
            else:
                s = policy.sample(
                    obs,
                    num_steps=self.num_steps,
                    noise=None if x0 is None else x0[:, None],
                    return_iterates=True,
                )
                actions, iterates = s.actions[:, 0], None if s.iterates is None else s.iterates[:, 0]
            out = policy.executable_actions(actions).float().cpu().numpy()
            if iterates is None or iterates.shape[1] < 3:  # accel needs two velocity steps
                return out, np.full(len(out), np.nan, np.float32)
            score = accel_score(iterates[..., : policy.action_dim].float(), n_exec=policy.n_exec)
            return out, score.float().cpu().numpy()

    def _sample_rtc(
        self, obs: Mapping[str, Any], x0: torch.Tensor | None, rtc: list[RTCRequest | None]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(normalised chunks [B, H, D], their Euler iterates [B, K + 1, H, D]) with real-time chunking on
        the rows that ask for it (:func:`policies.rtc.sample_rtc`: trained or guided)."""
        policy = self.policy
        if x0 is None:
            x0 = torch.randn(len(rtc), *policy.event_shape, device=policy.device)
        requests = [None if r is None else (r.delay, r.queued) for r in rtc]
        res = sample_rtc(policy, obs, x0, requests, self.rtc_settings, self.num_steps)
        return res.actions, res.iterates

    def features(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        prefix: Any | None = None,
    ) -> np.ndarray:
        """The policy's ``features(prefix)`` ``[B, F]`` of a batch: what the failure predictor reads. From
        ``prefix`` when the forward already encoded this batch (its first B rows: a compiled bucket pads),
        else one more prefix pass (no denoising)."""
        if prefix is None:
            return decision_features(self.policy, self._observation(states, cameras, instructions)).numpy()
        with torch.inference_mode():
            return self.policy.features(prefix)[: len(states)].float().cpu().numpy()

    def _observation(
        self, states: np.ndarray, cameras: Mapping[str, np.ndarray], instructions: list[str]
    ) -> dict[str, Any]:
        device = self.policy.device
        return {
            "state": torch.from_numpy(states).to(device),
            "cameras": {k: torch.from_numpy(v).to(device) for k, v in cameras.items()},
            "instruction": instructions,
        }


class FlowVLAModel(FlowPolicyModel):
    """A vla-rl checkpoint (:class:`LoadedPolicy`) as a :class:`ServedModel`, through the contract
    (:class:`~policies.flow_policy.FlowVLAFlowPolicy`: the same calls, the same numbers)."""

    def __init__(self, loaded: LoadedPolicy) -> None:
        self.loaded = loaded
        super().__init__(
            FlowVLAFlowPolicy.from_checkpoint(loaded.policy, loaded.info),
            spec=loaded.spec,
            policy_type=loaded.info.policy_type,
            commit=loaded.commit,
            ref=loaded.ref,
            num_steps=loaded.num_steps,
        )


def served_model(model: LoadedPolicy | LoadedFlowPolicy | ServedModel) -> ServedModel:
    """What :func:`policies.loading.load_servable` returns, as the model a :class:`ServedVersion` runs."""
    if isinstance(model, LoadedPolicy):
        return FlowVLAModel(model)
    if isinstance(model, LoadedFlowPolicy):
        return FlowPolicyModel.from_loaded(model)
    return model


class ServedVersion:
    """One loaded, verified model (a vla-rl checkpoint or a LeRobot policy) and how to run a batch through it."""

    def __init__(self, model: LoadedPolicy | LoadedFlowPolicy | ServedModel) -> None:
        self.model: ServedModel = served_model(model)
        self.loaded_at = time.time()
        self.compiled: CompiledVelocity | None = None  # set by start_compiled
        self.failure: FailurePredictor | None = None
        """The checkpoint's failure predictor (``failure/``, :mod:`policies.failure`), when it has one
        fit on these weights; its score and alarm ride with every chunk next to ``uncertainty``."""
        self.failure_note = ""
        """Why a ``failure/`` artefact in the checkpoint folder is not served ("" when none is there)."""
        self.forward_us: int | None = None
        """The last batch's forward pass through this version (µs); None before the first. Whether a lone
        request may run on the event loop depends on it (:meth:`ModelSlot.serve_lone`)."""
        path = getattr(model, "path", None)
        if path is not None and isinstance(self.model, FlowPolicyModel):
            self._load_failure(Path(path))

    def _load_failure(self, checkpoint: Path) -> None:
        """Load ``checkpoint/failure/`` when present and fit for this model (a blank batch's features
        give the width); a predictor that does not fit is logged and left out: the policy serves."""
        if not (checkpoint / FAILURE_DIR).is_dir():
            return
        states, cams, instructions, _ = self._blank_batch(1)
        dim = self.model.features(states, cams, instructions).shape[1]  # type: ignore[attr-defined]
        self.failure, self.failure_note = find_predictor(checkpoint, dim)
        if self.failure_note:
            log.warning(self.failure_note, extra={"commit": self.commit, "path": str(checkpoint)})

    def failure_scores(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        uncertainty: np.ndarray,
        prefix: Any | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The failure predictor's ``p`` float32 ``[B]`` and alarms bool ``[B]`` for a batch whose chunks
        scored ``uncertainty``, from the forward's own ``prefix`` when given (else one more prefix pass);
        None when no predictor is served."""
        if self.failure is None:
            return None
        feats = self.model.features(states, cameras, instructions, prefix)  # type: ignore[attr-defined]
        p = self.failure.score(feats, uncertainty)
        return p, self.failure.alarms(p)

    @property
    def commit(self) -> str:
        return self.model.commit

    @property
    def spec(self) -> RobotSpec:
        return self.model.spec

    @property
    def chunk_len(self) -> int:
        return self.model.chunk_len

    @property
    def action_dim(self) -> int:
        return self.model.spec.action_dim

    @property
    def n_exec(self) -> int:
        return self.model.n_exec

    @property
    def noise_shape(self) -> tuple[int, int] | None:
        return self.model.noise_shape

    @property
    def rtc_mode(self) -> str:
        """Real-time chunking this model runs: "guided", "trained", or "" (none: RTC requests refused)."""
        return str(getattr(self.model, "rtc_mode", ""))

    @property
    def rtc_max_delay(self) -> int:
        """The largest inference delay a checkpoint trained for RTC takes (0 = no bound but chunk_len)."""
        return int(getattr(self.model, "rtc_max_delay", 0))

    def initial_noise(self, seed: int) -> np.ndarray | None:
        shape = self.noise_shape
        return None if shape is None else initial_noise(seed, *shape)

    def infer(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
    ) -> np.ndarray:
        """float32 [B, H, A] env-unit chunks for a batch, from explicit initial noise [B, *noise_shape]
        (None for a model that takes none)."""
        return self.model.infer(states, cameras, instructions, noise)

    @property
    def uncertainty_kind(self) -> str:
        """What the replies' ``uncertainty`` is ("accel" for flow_vla); "" = the model cannot score chunks."""
        return str(getattr(self.model, "uncertainty_kind", "")) if self._scorer() is not None else ""

    def _scorer(self) -> Callable[..., tuple[np.ndarray, np.ndarray]] | None:
        return getattr(self.model, "infer_scored", None)

    def infer_scored(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
        rtc: list[RTCRequest | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`infer` plus each chunk's uncertainty (float32 [B], from the same pass); NaN when the
        model cannot score its chunks (a LeRobot ACT or Diffusion): the replies then carry no uncertainty.

        Runs the compiled denoising step when the batch's bucket is warm (:meth:`start_compiled`; the
        batch padded to its bucket, the padding dropped), eager otherwise; a compiled batch that fails
        disables compilation (one warning) and is rerun eager."""
        compiled, n = self.compiled, len(states)
        bucket = None if compiled is None else bucket_for(n, compiled.buckets)
        if compiled is not None and bucket is not None and compiled.usable(bucket):
            padded = pad_batch(bucket, (states, cameras, instructions, noise))
            rtc_rows = None if rtc is None else [*rtc, *[None] * (bucket - n)]
            try:
                with compiled.active():
                    actions, score = self._infer_scored_eager(padded, rtc_rows)
                return actions[:n], score[:n]
            except Exception as e:
                compiled.disable(f"a compiled batch of {bucket} failed: {type(e).__name__}: {e}")
        return self._infer_scored_eager((states, cameras, instructions, noise), rtc)

    def _infer_scored_eager(
        self, batch: Batch, rtc: list[RTCRequest | None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`infer_scored` on the calling thread's path (eager, or compiled inside ``active()``)."""
        states, cameras, instructions, noise = batch
        scorer = self._scorer()
        if rtc is not None and any(r is not None for r in rtc):
            if not self.rtc_mode or scorer is None:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"inference_delay: commit {self.commit} ({self.model.policy_type}) cannot run real-time "
                    "chunking; send no inference_delay or queued_actions",
                )
            actions, score = scorer(states, cameras, instructions, noise, rtc=rtc)
            return actions, np.asarray(score, np.float32).reshape(len(actions))
        if scorer is None:
            actions = self.infer(states, cameras, instructions, noise)
            return actions, np.full(len(actions), np.nan, np.float32)
        actions, score = scorer(states, cameras, instructions, noise)
        return actions, np.asarray(score, np.float32).reshape(len(actions))

    def start_compiled(
        self,
        mode: CompileMode,
        max_batch: int,
        compiler: Callable[..., Callable[..., Any]] | None = None,
        buckets: tuple[int, ...] | None = None,
    ) -> CompiledVelocity | None:
        """Compile the denoising step for every batch bucket up to ``max_batch`` (or exactly ``buckets``)
        on a background thread (:mod:`server.compiled`; ``compiler`` defaults to ``torch.compile``); eager
        serves each bucket until its graph is warm. None (eager only) when ``mode`` says so on this device
        or the model is not a flow policy."""
        options = compile_options(mode, torch.device(self.model.device))
        owner = velocity_owner(self.model.policy) if isinstance(self.model, FlowPolicyModel) else None
        if options is None or owner is None:
            return None
        chosen = tuple(sorted(set(buckets))) if buckets else batch_buckets(max_batch)
        self.compiled = CompiledVelocity(owner, chosen, options, compiler)
        self.compiled.start_warm_up(lambda b: self._infer_scored_eager(self._blank_batch(b)))
        return self.compiled

    def _blank_batch(self, rows: int) -> Batch:
        """A batch of ``rows`` blank observations (zero state, black images, seed-0 noise)."""
        spec = self.spec
        states = np.zeros((rows, spec.state_dim), np.float32)
        cams = {c.name: np.zeros((rows, *c.shape), np.uint8) for c in spec.cameras}
        noise = self.initial_noise(0)
        return states, cams, [spec.instruction] * rows, None if noise is None else np.stack([noise] * rows)

    def warm_up(self) -> None:
        """One forward pass on a blank observation: fails early (and off the serving path) on a broken
        model, and pays one-time costs (allocator, kernels) before the first robot does."""
        out = self.infer(*self._blank_batch(1))
        if out.shape != (1, self.chunk_len, self.action_dim):
            raise CheckpointError(
                f"warm-up: expected actions [1, {self.chunk_len}, {self.action_dim}], got {list(out.shape)}"
            )
        if not np.isfinite(out).all():
            raise CheckpointError("warm-up: the model produced NaN or inf actions on a blank observation")


def pad_batch(rows: int, batch: Batch) -> Batch:
    """A batch grown to ``rows`` by repeating its last row (a compiled bucket's static shape)."""
    states, cameras, instructions, noise = batch

    def grow(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.repeat(x[-1:], rows - len(x), 0)]) if rows > len(x) else x

    extra = [instructions[-1]] * (rows - len(instructions))
    return (
        grow(states),
        {k: grow(v) for k, v in cameras.items()},
        list(instructions) + extra,
        None if noise is None else grow(noise),
    )


class ModelSlot:
    """One model id: its serving version (plus previous and staged ones), its :class:`BatchQueue` and the
    batcher thread that runs each batch through the version serving when the batch was taken."""

    def __init__(self, model_id: str, version: ServedVersion, queue: BatchQueue) -> None:
        self.queue = queue
        self.model_id = model_id
        self.active = version
        self.previous: ServedVersion | None = None
        self.staged: ServedVersion | None = None
        self.last_load_error = ""  # public (GetInfo without a token): no file names, contents or hashes
        self.last_load_error_detail = ""  # the full reason: server log, and GetInfo with the control token
        self.last_failed_commit = ""
        self.followed_ref = ""
        self.served = self.batches = self.dropped_expired = self.non_finite = 0
        self.rtc_served = 0  # answers real-time chunking shaped
        self.latency = LatencyWindow()  # answered requests (GetInfo's p50 / p99 / requests per second)
        self.load_lock = threading.Lock()  # one load per model at a time
        self._forward = threading.Lock()  # one batch at a time: the batcher's or a lone request's
        self._thread = threading.Thread(target=self._run, name=f"batcher-{model_id}", daemon=True)

    @property
    def rejected_full(self) -> int:
        """Requests refused RESOURCE_EXHAUSTED (queue full, or too many from one connection)."""
        return self.queue.rejected_full

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        for item in self.queue.close():
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(RequestError(grpc.StatusCode.UNAVAILABLE, "server shutting down"))
        self._thread.join(timeout=10)

    def submit(self, item: _Pending) -> None:
        """Queue ``item`` or raise RESOURCE_EXHAUSTED at once (backpressure, not unbounded latency)."""
        self.queue.submit(item)

    # -- swaps: all under the queue's lock, so they land between batches
    def swap_in(self, version: ServedVersion) -> ServedVersion:
        with self.queue.cond:
            old, self.active = self.active, version
            self.previous = old
            return old

    def stage(self, version: ServedVersion) -> None:
        with self.queue.cond:
            self.staged = version

    def promote(self) -> ServedVersion:
        with self.queue.cond:
            if self.staged is None:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"model {self.model_id!r}: nothing staged"
                )
            self.previous, self.active, self.staged = self.active, self.staged, None
            return self.active

    def rollback(self) -> ServedVersion:
        with self.queue.cond:
            if self.previous is None:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"model {self.model_id!r}: no previous revision to roll back to",
                )
            self.active, self.previous = self.previous, self.active
            return self.active

    # -- the batcher
    def queued(self) -> int:
        """Requests waiting for a batch (not yet picked for inference)."""
        return len(self.queue)

    def active_clients(self) -> int:
        """Connections that sent a request within the last ``activity_window_s`` (or have one queued)."""
        return self.queue.active_clients()

    def _take_batch(self) -> tuple[list[_Pending], ServedVersion] | None:
        with self.queue.cond:
            batch = self.queue.take()
            if batch is None:
                return None
            self._forward.acquire()  # released once the batch is answered; serve_lone skips a busy slot
            # the version is read once per batch, in the same hold of the lock: swaps land between batches
            return batch, self.active

    def _run(self) -> None:
        while True:
            taken = self._take_batch()
            if taken is None:
                return
            try:
                self._serve(*taken)
            finally:
                self._forward.release()

    def serve_lone(self, item: _Pending, max_forward_us: int) -> bool:
        """Answer ``item`` on the calling thread (the server's event loop) when it would be a batch of its own
        anyway (:meth:`BatchQueue.claim_lone`), no batch is running and the serving version's last forward
        took at most ``max_forward_us``: it skips the hand-off to the batcher thread and the wake-up back.
        True = ``item.future`` is answered; False = nothing was done (queue it with :meth:`submit`)."""
        last = self.active.forward_us  # read unlocked: a crowd's batches are slow, refused without a lock
        if last is None or last > max_forward_us:
            return False
        with self.queue.cond:  # no batch is taken (nor a version swapped) while this decides
            version = self.active
            if not self._forward.acquire(blocking=False):
                return False
            if not self.queue.claim_lone(item.peer):
                self._forward.release()
                return False
        try:
            self._serve([item], version)
        finally:
            self._forward.release()
        return True

    def _serve(self, batch: list[_Pending], version: ServedVersion) -> None:
        """Answer ``batch`` through ``version``: requests cancelled or past their deadline are dropped,
        the rest run as one batch (:meth:`_run_batch`)."""
        start_ns = time.perf_counter_ns()
        now = time.monotonic()
        live: list[_Pending] = []
        for item in batch:
            if not item.future.set_running_or_notify_cancel():
                continue  # the caller gave up (cancelled) while queued
            if item.deadline is not None and now >= item.deadline:
                self.dropped_expired += 1
                item.future.set_exception(
                    RequestError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed after {(start_ns - item.enqueued_ns) // 1000} us in the queue; "
                        "dropped before inference",
                    )
                )
                continue
            live.append(item)
        if live:
            self._run_batch(live, version, start_ns)

    def _run_batch(self, live: list[_Pending], version: ServedVersion, start_ns: int) -> None:
        shape = version.noise_shape
        try:
            noise = None
            if shape is not None:
                noise = np.stack(
                    [it.noise if it.noise is not None else initial_noise(it.seed, *shape) for it in live]
                )
                if (
                    noise.shape[1:] != shape
                ):  # explicit noise checked against the version serving before a swap
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"noise: expected float32{list(shape)} for commit {version.commit}, got {list(noise.shape[1:])}",
                    )
            elif any(it.noise is not None for it in live):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"noise: commit {version.commit} takes no initial noise; send a seed or nothing",
                )
            states = np.stack([it.state for it in live]).astype(np.float32, copy=False)
            cams = {c.name: np.stack([it.cameras[c.name] for it in live]) for c in version.spec.cameras}
            t0 = time.perf_counter_ns()
            rtc = [it.rtc for it in live] if any(it.rtc is not None for it in live) else None
            instructions = [it.instruction for it in live]
            args = (states, cams, instructions, noise)
            with timed_prefix(version.model) as prefix_clock:
                actions, scores = (
                    version.infer_scored(*args) if rtc is None else version.infer_scored(*args, rtc)
                )
                failure = version.failure_scores(
                    states, cams, instructions, scores, prefix_clock.sole_prefix()
                )
            infer_us = (time.perf_counter_ns() - t0) // 1000
            version.forward_us = infer_us
            prefix_us, denoise_us = prefix_clock.split_us(infer_us)
            want = (len(live), version.chunk_len, version.action_dim)
            if actions.shape != want:
                raise RequestError(
                    grpc.StatusCode.INTERNAL,
                    f"inference failed: expected actions {list(want)}, got {list(actions.shape)}",
                )
            kind = version.uncertainty_kind
            finite = np.isfinite(actions.reshape(len(live), -1)).all(axis=1)
        except Exception as e:  # every waiting request must get an answer
            err = (
                e
                if isinstance(e, RequestError)
                else RequestError(grpc.StatusCode.INTERNAL, f"inference failed: {type(e).__name__}: {e}")
            )
            log.exception("batch failed", extra={"model_id": self.model_id, "batch": len(live)})
            for it in live:
                it.future.set_exception(err)
            return
        self.batches += 1
        self.served += len(live)
        self.rtc_served += sum(it.rtc is not None for it in live)
        for i, it in enumerate(live):
            if not finite[i]:  # never data: a non-finite chunk is an error reply
                self.non_finite += 1
                it.future.set_exception(
                    RequestError(
                        grpc.StatusCode.INTERNAL,
                        f"actions: the model produced NaN or inf for this request (commit {version.commit}); "
                        "nothing to execute",
                    )
                )
                continue
            it.future.set_result(
                _Result(
                    actions=actions[i],
                    commit=version.commit,
                    n_exec=version.n_exec,
                    batch_size=len(live),
                    queue_us=(start_ns - it.enqueued_ns) // 1000,
                    inference_us=infer_us,
                    uncertainty=float(scores[i]),
                    uncertainty_kind=kind if np.isfinite(scores[i]) else "",
                    failure=float("nan") if failure is None else float(failure[0][i]),
                    failure_alarm=failure is not None and bool(failure[1][i]),
                    batch_us=(t0 - start_ns) // 1000,
                    prefix_us=prefix_us,
                    denoise_us=denoise_us,
                    done_ns=time.perf_counter_ns(),
                    rtc=None if it.rtc is None else version.model.rtc_report(it.rtc),  # type: ignore[attr-defined]
                )
            )

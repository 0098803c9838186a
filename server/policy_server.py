"""gRPC policy server: dynamic batching across robots, several models, live checkpoint swaps.

Why it is built this way (what LeRobot's async server and openpi's server get wrong, see
``shared/reference/anchors.md`` sections 1-2):

* **Every chunk answers its own observation.** A request becomes a :class:`_Pending` item holding its
  own future; the batcher resolves exactly that future with exactly that row of the batch. There is no
  shared "latest observation" slot.
* **Nothing blocks the event loop.** The service runs on ``grpc.aio``: streams cost no threads (LeRobot's
  4-thread pool starves at 16 clients), and the model runs in one batcher thread per model, whose result
  reaches the handler through a future. Checkpoint loads run in another thread pool, so a reload never
  stalls inference (openpi #717).
* **Backpressure and deadlines.** The queue is bounded: a full queue answers RESOURCE_EXHAUSTED at once
  instead of growing latency without bound. A request whose deadline (the call's, or ``timeout_ms`` on a
  stream) has passed while it waited is dropped before inference: nobody is waiting for it.
* **Reproducible under batching.** Each request's initial noise comes from its own seed (a CPU
  ``torch.Generator``, :func:`initial_noise`) or explicit tensor, so its actions do not depend on what it
  was batched with (up to BLAS rounding, ~1e-6).
* **Live swap.** A new checkpoint is pulled, hash-verified (:func:`vla_rl.hub.checkpoint.load_checkpoint`),
  checked for spec compatibility and warmed up off the serving path; the batcher reads the serving
  version once per batch, so the swap happens between batches, in-flight requests finish on the old
  model, and every reply names the commit that produced it. A refused checkpoint leaves the old one
  serving and its error in ``GetInfo``. The previous version stays in memory so Rollback is instant.
* **Authenticated control.** LoadCheckpoint/Promote/Rollback need ``authorization: Bearer <token>``;
  without a configured token they are disabled. Bound to 127.0.0.1 unless told otherwise. GetInfo is
  open, so its ``last_load_error`` says only that a load failed; the reason goes to the log and to
  GetInfo callers that send the token.
* **Bounded by** :class:`ServerLimits`. A checkpoint only opens its own regular files, each under
  ``max_file_bytes``, and a load stops at ``load_timeout_s``; loads run in their own pool, so
  Promote/Rollback never wait behind them. The config's implied tensor shapes are checked against the
  safetensors header before anything is built. Requests are capped in size (derived from the robot
  spec), in number (``max_concurrent_rpcs``, ``max_peer_queued``) and in values (``max_noise_abs``,
  ``max_state_abs``). Bytes that do not parse are INVALID_ARGUMENT naming the field, logged once per
  peer per ``log_interval_s``. When requests wait, the connections served least recently go first, and
  a stream reply the robot does not read within ``stream_write_timeout_s`` closes that stream. A
  non-finite chunk is an error reply and is never sent as actions.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from vla_rl_client.codec import decode_image, from_tensor, to_tensor
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc
from vla_rl_client.spec import RobotSpec, SpecError

from policies.loading import LoadedPolicy, load_servable
from vla_rl.core.version import __version__
from vla_rl.hub.checkpoint import DEFAULT_MAX_FILE_BYTES, CheckpointError, LoadLimits

log = logging.getLogger("vla_rl.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PolicyService"].full_name
DEFAULT_PORT = 50061
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # only an upper bound now: the default is derived from the spec
MIN_DERIVED_MESSAGE_BYTES = 1024 * 1024  # headroom for a later checkpoint with a slightly larger spec
MESSAGE_SLACK_BYTES = 64 * 1024  # on top of the spec's pixels, state and noise: ids, instruction, framing
MAX_INSTRUCTION_CHARS = 2000
MAX_REQUEST_ID_CHARS = 200
DEFAULT_LOAD_TIMEOUT_S = 600.0
DEFAULT_MAX_CONCURRENT_RPCS = 256
DEFAULT_MAX_PEER_QUEUED = 64
DEFAULT_STREAM_WRITE_TIMEOUT_S = 10.0
DEFAULT_MAX_NOISE_ABS = 10.0
DEFAULT_MAX_STATE_ABS = 1e6
DEFAULT_LOG_INTERVAL_S = 10.0
DEFAULT_DRAIN_S = 2.0  # vla-rl serve: seconds NOT_SERVING between SIGTERM and the stop


class RequestError(Exception):
    """A request (or control call) failed with a gRPC status; ``message`` names the field when it can."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


def initial_noise(seed: int, chunk_len: int, action_dim: int) -> np.ndarray:
    """The float32 [H, A] initial flow noise a request with ``seed`` gets (clients can reproduce it).

    Drawn on the CPU with its own generator so it is the same on any device and in any batch.
    """
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn((chunk_len, action_dim), generator=gen, dtype=torch.float32).numpy()


@dataclass(frozen=True)
class ServerLimits:
    """What one client (or one checkpoint) can make the server do; every error names the field."""

    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # one checkpoint load, then it is abandoned
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # one checkpoint file
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS  # calls + open streams; more: RESOURCE_EXHAUSTED
    max_peer_queued: int = DEFAULT_MAX_PEER_QUEUED  # requests one connection may have waiting
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S  # an unread reply ends its stream
    max_noise_abs: float = DEFAULT_MAX_NOISE_ABS  # |explicit initial noise|
    max_state_abs: float = DEFAULT_MAX_STATE_ABS  # |observation.state|
    log_interval_s: float = DEFAULT_LOG_INTERVAL_S  # one warning per peer and kind per interval

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")


def request_bytes_for(spec: RobotSpec, noise_shape: tuple[int, int] | None) -> int:
    """The largest ActRequest a robot with ``spec`` needs to send: every camera raw (or encoded, up to 2x
    raw for incompressible JPEG/PNG), the state, explicit noise, plus :data:`MESSAGE_SLACK_BYTES`."""
    pixels = sum(c.height * c.width * 3 for c in spec.cameras)
    noise = 4 * noise_shape[0] * noise_shape[1] if noise_shape else 0
    return 2 * pixels + 4 * spec.state_dim + noise + MESSAGE_SLACK_BYTES


class RateLimitedLog:
    """At most one warning per (peer, kind) per ``interval_s``; the next one says how many were suppressed.

    A flood of garbage from one peer costs one log line per interval, not a traceback per call.
    """

    MAX_KEYS = 10_000

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, peer: str, kind: str, msg: str, *, exc_info: bool = False, **extra: Any) -> bool:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get((peer, kind), (-float("inf"), 0))
            if now - last < self.interval_s:
                self._last[(peer, kind)] = (last, suppressed + 1)
                return False
            if len(self._last) >= self.MAX_KEYS:
                cutoff = now - self.interval_s
                self._last = {k: v for k, v in self._last.items() if v[0] >= cutoff}
            self._last[(peer, kind)] = (now, 0)
        log.warning(
            msg, exc_info=exc_info, extra={"peer": peer, "kind": kind, "suppressed": suppressed, **extra}
        )
        return True


@dataclass(frozen=True)
class Undecodable:
    """What the server's deserializers return for bytes that are not a valid request message (instead of
    raising, which grpc answers UNKNOWN with a logged traceback)."""

    type_name: str
    field: str
    size: int

    @property
    def message(self) -> str:
        return f"{self.field}: the request is not a valid {self.type_name} protobuf ({self.size} bytes)"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def bad_field(data: bytes, desc: Any, prefix: str = "", depth: int = 0) -> str | None:
    """The dotted name of the first field whose wire encoding is broken in ``data`` (None if none is
    found): walks the protobuf wire format with the message descriptor, never allocating more than
    ``data``."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    i, n = 0, len(data)
    while i < n:
        try:
            key, i = _varint(data, i)
        except ValueError:
            return prefix.rstrip(".") or "request"
        num, wire = key >> 3, key & 7
        f = desc.fields_by_number.get(num)
        name = prefix + (f.name if f is not None else f"field {num}")
        try:
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                length, i = _varint(data, i)
                chunk = data[i : i + length]
                i += length
                if i > n:
                    return name
                if f is not None and f.type == FD.TYPE_MESSAGE and depth < 8:
                    inner = bad_field(chunk, f.message_type, name + ".", depth + 1)
                    if inner is not None:
                        return inner
                elif f is not None and f.type == FD.TYPE_STRING:
                    chunk.decode("utf-8")
            else:
                return name
        except (ValueError, UnicodeDecodeError):
            return name
        if i > n:
            return name
    return None


def _safe_deserializer(cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception:
            where = bad_field(data, cls.DESCRIPTOR) or "request"
            return Undecodable(cls.DESCRIPTOR.full_name, where, len(data))

    return deserialize


class _AnySet:
    """``is_set()`` of several events (a load's own cancel flag and the server's stop)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


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


# ----------------------------------------------------------------------------------------------- versions
class ServedModel(Protocol):
    """What the server needs from a hosted model: our flow VLA (:class:`FlowVLAModel`) or a LeRobot policy
    (:class:`policies.lerobot_adapter.LeRobotModel`)."""

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


UNCERTAINTY_KIND = "accel"
"""The score flow_vla replies carry: :func:`policies.flow_vla.uncertainty.accel_score` of the executed
window's ODE iterates, default prefix (round(K / 2) steps), on normalised actions (no extra dim_scale)."""


class FlowVLAModel:
    """A vla-rl checkpoint (:class:`LoadedPolicy`) as a :class:`ServedModel`."""

    def __init__(self, loaded: LoadedPolicy) -> None:
        self.loaded = loaded
        self.ref, self.commit = loaded.ref, loaded.commit

    spec = property(lambda self: self.loaded.spec)
    chunk_len = property(lambda self: self.loaded.chunk_len)
    n_exec = property(lambda self: int(self.loaded.policy.config.n_exec))
    policy_type = property(lambda self: self.loaded.info.policy_type)
    device = property(lambda self: self.loaded.policy.device)
    noise_shape = property(lambda self: (self.loaded.chunk_len, self.loaded.spec.action_dim))
    uncertainty_kind = UNCERTAINTY_KIND

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
    ) -> tuple[np.ndarray, np.ndarray]:
        """Env-unit chunks [B, H, A] and their ``accel`` uncertainty [B], from one ODE sample per row.

        The same computation as ``policy.predict_action_chunk`` (Euler ODE from ``noise``, clipped to the
        data range under min-max normalisation, unnormalised), keeping the K + 1 Euler iterates the loop
        computes anyway: the score costs no forward pass, only a few vector norms over them.
        """
        policy = self.loaded.policy
        device = policy.device
        with torch.inference_mode():
            obs = {
                "state": torch.from_numpy(states).to(device),
                "cameras": {k: torch.from_numpy(v).to(device) for k, v in cameras.items()},
                "instruction": instructions,
            }
            s = policy.sample(
                obs,
                method="ode",
                num_steps=self.loaded.num_steps,
                noise=None if noise is None else torch.from_numpy(noise).to(device)[:, None],
                return_iterates=True,
            )
            a = s.actions[:, 0]
            if policy.config.action_norm == "min_max":
                a = a.clamp(-1.0, 1.0)
            actions = policy.normalizer.unnormalize_action(a)
            assert s.iterates is not None
            score = policy.accel(s.iterates[:, 0].float())
            return actions.float().cpu().numpy(), score.float().cpu().numpy()


class ServedVersion:
    """One loaded, verified model (a vla-rl checkpoint or a LeRobot policy) and how to run a batch through it."""

    def __init__(self, model: LoadedPolicy | ServedModel) -> None:
        self.model: ServedModel = FlowVLAModel(model) if isinstance(model, LoadedPolicy) else model
        self.loaded_at = time.time()

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
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`infer` plus each chunk's uncertainty (float32 [B], from the same pass); NaN when the
        model cannot score its chunks (a LeRobot policy): the replies then carry no uncertainty."""
        scorer = self._scorer()
        if scorer is None:
            actions = self.infer(states, cameras, instructions, noise)
            return actions, np.full(len(actions), np.nan, np.float32)
        actions, score = scorer(states, cameras, instructions, noise)
        return actions, np.asarray(score, np.float32).reshape(len(actions))

    def warm_up(self) -> None:
        """One forward pass on a blank observation: fails early (and off the serving path) on a broken
        model, and pays one-time costs (allocator, kernels) before the first robot does."""
        spec = self.spec
        states = np.zeros((1, spec.state_dim), np.float32)
        cams = {c.name: np.zeros((1, *c.shape), np.uint8) for c in spec.cameras}
        noise = self.initial_noise(0)
        out = self.infer(states, cams, [spec.instruction], None if noise is None else noise[None])
        if out.shape != (1, self.chunk_len, self.action_dim):
            raise CheckpointError(
                f"warm-up: expected actions [1, {self.chunk_len}, {self.action_dim}], got {list(out.shape)}"
            )
        if not np.isfinite(out).all():
            raise CheckpointError("warm-up: the model produced NaN or inf actions on a blank observation")


# ----------------------------------------------------------------------------------------------- batching
@dataclass
class _Pending:
    """One decoded request waiting for its batch."""

    state: np.ndarray
    cameras: dict[str, np.ndarray]
    instruction: str
    seed: int
    noise: np.ndarray | None
    deadline: float | None  # time.monotonic() after which nobody waits for the answer
    enqueued_ns: int
    peer: str = ""  # the connection it came on: one robot, for the adaptive batching wait
    future: concurrent.futures.Future[_Result] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class _Result:
    actions: np.ndarray
    commit: str
    n_exec: int
    batch_size: int
    queue_us: int
    inference_us: int
    uncertainty: float = float("nan")  # NaN = not available
    uncertainty_kind: str = ""


class LatencyWindow:
    """Answered requests' latencies over the last ``window_s`` seconds: p50 / p99 in ms and the request
    rate (over the last ``rate_window_s``), for GetInfo. Bounded: at most ``max_samples`` are kept (the
    oldest dropped first), so a busy server's window is the newest ``max_samples`` requests."""

    def __init__(self, window_s: float = 60.0, rate_window_s: float = 10.0, max_samples: int = 8192) -> None:
        self.window_s, self.rate_window_s = window_s, rate_window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, latency_ms: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, latency_ms))

    def summary(self, now: float | None = None) -> tuple[float, float, float]:
        """(p50 ms, p99 ms, requests per second); zeros when nothing was answered in the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            samples = list(self._samples)
        if not samples:
            return 0.0, 0.0, 0.0
        lat = np.array([ms for _, ms in samples])
        recent = sum(1 for t, _ in samples if t >= now - self.rate_window_s)
        return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), recent / self.rate_window_s


class ModelSlot:
    """One model id: its serving version (plus previous and staged ones), bounded queue and batcher thread."""

    def __init__(
        self,
        model_id: str,
        version: ServedVersion,
        *,
        max_batch: int,
        max_wait_us: int,
        max_queue: int,
        adaptive_wait: bool = True,
        activity_window_s: float = 1.0,
        max_peer_queued: int = DEFAULT_MAX_PEER_QUEUED,
    ) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_us < 0:
            raise ValueError(
                f"need max_batch >= 1, max_queue >= 1, max_wait_us >= 0; got {max_batch}, {max_queue}, {max_wait_us}"
            )
        self.model_id = model_id
        self.active = version
        self.previous: ServedVersion | None = None
        self.staged: ServedVersion | None = None
        self.max_batch, self.max_wait_us, self.max_queue = max_batch, max_wait_us, max_queue
        self.adaptive_wait, self.activity_window_s = adaptive_wait, activity_window_s
        self.max_peer_queued = max_peer_queued
        self._usage: dict[str, tuple[float, float]] = {}  # peer -> (decayed requests served, at time)
        self._last_seen: dict[str, float] = {}  # peer -> time.monotonic() of its last request
        self._queued_peers: collections.Counter[str] = collections.Counter()
        self.last_load_error = ""  # public (GetInfo without a token): no file names, contents or hashes
        self.last_load_error_detail = ""  # the full reason: server log, and GetInfo with the control token
        self.last_failed_commit = ""
        self.followed_ref = ""
        self.served = self.batches = self.dropped_expired = self.rejected_full = self.non_finite = 0
        self.latency = LatencyWindow()  # answered requests (GetInfo's p50 / p99 / requests per second)
        self.load_lock = threading.Lock()  # one load per model at a time
        self._cond = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"batcher-{model_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in pending:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(RequestError(grpc.StatusCode.UNAVAILABLE, "server shutting down"))
        self._thread.join(timeout=10)

    def submit(self, item: _Pending) -> None:
        """Queue ``item`` or raise RESOURCE_EXHAUSTED at once (backpressure, not unbounded latency)."""
        with self._cond:
            if self._stopping:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server shutting down")
            if len(self._queue) >= self.max_queue:
                self.rejected_full += 1
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model {self.model_id!r}: request queue full ({self.max_queue} waiting); retry with backoff",
                )
            if self._queued_peers[item.peer] >= self.max_peer_queued:
                self.rejected_full += 1
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model {self.model_id!r}: this connection already has {self.max_peer_queued} requests "
                    "waiting (max_peer_queued); retry with backoff",
                )
            self._queue.append(item)
            self._last_seen[item.peer] = time.monotonic()
            self._queued_peers[item.peer] += 1
            self._cond.notify()

    # -- swaps: all under the batcher's lock, so they land between batches
    def swap_in(self, version: ServedVersion) -> ServedVersion:
        with self._cond:
            old, self.active = self.active, version
            self.previous = old
            return old

    def stage(self, version: ServedVersion) -> None:
        with self._cond:
            self.staged = version

    def promote(self) -> ServedVersion:
        with self._cond:
            if self.staged is None:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"model {self.model_id!r}: nothing staged"
                )
            self.previous, self.active, self.staged = self.active, self.staged, None
            return self.active

    def rollback(self) -> ServedVersion:
        with self._cond:
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
        with self._cond:
            return len(self._queue)

    def active_clients(self) -> int:
        """Connections that sent a request within the last ``activity_window_s`` (or have one queued)."""
        with self._cond:
            self._forget_idle_peers()
            return len(self._last_seen)

    def _forget_idle_peers(self) -> None:
        cutoff = time.monotonic() - self.activity_window_s
        for peer in [p for p, t in self._last_seen.items() if t < cutoff and not self._queued_peers[p]]:
            del self._last_seen[peer]
            del self._queued_peers[peer]

    def _nobody_else_expected(self) -> bool:
        """Every recently active connection already has a request queued: waiting longer cannot grow the
        batch (a closed-loop robot sends its next request only after this reply), so dispatch now."""
        self._forget_idle_peers()
        return all(self._queued_peers[p] for p in self._last_seen)

    def _take_batch(self) -> tuple[list[_Pending], ServedVersion] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            # Gather up to max_batch, waiting at most max_wait_us after the oldest request arrived: a
            # crowd fills the batch without waiting. With adaptive_wait a lone robot (or a batch that
            # already holds every active robot) goes at once instead of paying max_wait_us.
            until = self._queue[0].enqueued_ns / 1e9 + self.max_wait_us / 1e6
            while len(self._queue) < self.max_batch and not self._stopping:
                if self.adaptive_wait and self._nobody_else_expected():
                    break
                remaining = until - time.perf_counter_ns() / 1e9
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch = self._pick(min(self.max_batch, len(self._queue)))
            for item in batch:
                self._queued_peers[item.peer] -= 1
            return batch, self.active  # the version is read once per batch: swaps land between batches

    USAGE_HALF_LIFE_S = 1.0

    def _usage_of(self, peer: str, now: float) -> float:
        value, at = self._usage.get(peer, (0.0, now))
        return value * 0.5 ** ((now - at) / self.USAGE_HALF_LIFE_S)

    def _pick(self, n: int) -> list[_Pending]:
        """Take ``n`` queued requests. When more are waiting than fit, the connections served least
        recently (decayed count, half-life USAGE_HALF_LIFE_S) go first, FIFO among equals: a flood of
        requests from some connections (e.g. streams that never read their replies) cannot push a robot
        asking at its control rate behind them."""
        now = time.monotonic()
        if n >= len(self._queue):
            batch = list(self._queue)
            self._queue.clear()
        else:
            batch = self._least_served(n, now)
        for item in batch:
            self._usage[item.peer] = (self._usage_of(item.peer, now) + 1.0, now)
        return batch

    def _least_served(self, n: int, now: float) -> list[_Pending]:
        if len(self._usage) > 4 * self.max_queue:
            self._usage = {
                p: (self._usage_of(p, now), now) for p in self._usage if self._usage_of(p, now) > 0.01
            }
        items = list(self._queue)
        order = sorted(range(len(items)), key=lambda i: (self._usage_of(items[i].peer, now), i))
        chosen = set(order[:n])
        self._queue = collections.deque(it for i, it in enumerate(items) if i not in chosen)
        return [it for i, it in enumerate(items) if i in chosen]

    def _run(self) -> None:
        while True:
            taken = self._take_batch()
            if taken is None:
                return
            batch, version = taken
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
            actions, scores = version.infer_scored(states, cams, [it.instruction for it in live], noise)
            infer_us = (time.perf_counter_ns() - t0) // 1000
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
                )
            )


# ----------------------------------------------------------------------------------------------- service
class _Service(pb_grpc.PolicyServiceServicer):
    def __init__(self, server: PolicyServer) -> None:
        self.s = server

    # -- inference
    def _decode(self, req: pb.ActRequest, context: grpc.aio.ServicerContext) -> tuple[ModelSlot, _Pending]:
        slot = self.s.slot(req.model_id)
        spec = slot.active.spec
        noise_shape = slot.active.noise_shape
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            raise SpecError(
                "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters", f"{len(req.request_id)}"
            )
        obs = req.observation
        if spec.state_dim == 0 and not obs.state.dtype:
            state = np.zeros((0,), np.float32)
        else:
            state = from_tensor(obs.state, "observation.state", dtype="float32", shape=(spec.state_dim,))
        spec.check_state(state, name="observation.state")  # finite
        if state.size and float(np.abs(state).max()) > self.s.max_state_abs:
            raise SpecError(
                "observation.state",
                f"values within +-{self.s.max_state_abs:g} (max_state_abs)",
                f"max |x| {float(np.abs(state).max()):.3g}",
            )
        cams: dict[str, np.ndarray] = {}
        for name, img in obs.cameras.items():
            try:
                cam = spec.camera(name)
            except KeyError:
                raise SpecError(
                    f"observation.cameras.{name}",
                    f"only cameras {list(spec.camera_names)}",
                    "an unknown camera",
                ) from None
            cams[name] = decode_image(img, f"observation.cameras.{name}", cam.height, cam.width)
        spec.check_images(cams, prefix="observation.cameras")
        if len(obs.instruction) > MAX_INSTRUCTION_CHARS:
            raise SpecError(
                "observation.instruction",
                f"at most {MAX_INSTRUCTION_CHARS} characters",
                f"{len(obs.instruction)}",
            )
        noise = None
        if req.noise.dtype or req.noise.shape or req.noise.data:
            if req.HasField("seed"):
                raise SpecError("noise", "either seed or noise, not both", "both")
            if noise_shape is None:
                raise SpecError(
                    "noise",
                    f"no noise: {slot.active.model.policy_type} takes no initial noise (send a seed or nothing)",
                    "a noise tensor",
                )
            noise = from_tensor(req.noise, "noise", dtype="float32", shape=noise_shape)
            if not np.isfinite(noise).all():
                raise SpecError("noise", "finite values", "NaN or inf")
            if noise.size and float(np.abs(noise).max()) > self.s.max_noise_abs:
                raise SpecError(
                    "noise",
                    f"standard-normal values within +-{self.s.max_noise_abs:g} (max_noise_abs)",
                    f"max |x| {float(np.abs(noise).max()):.3g}",
                )
        seed = req.seed if req.HasField("seed") else (0 if noise is not None else secrets.randbits(63))
        deadline = None
        remaining = context.time_remaining()
        if remaining is not None:
            deadline = time.monotonic() + remaining
        if req.timeout_ms:
            mine = time.monotonic() + req.timeout_ms / 1000
            deadline = mine if deadline is None else min(deadline, mine)
        item = _Pending(
            state=state,
            cameras=cams,
            instruction=obs.instruction or spec.instruction,
            seed=seed,
            noise=noise,
            deadline=deadline,
            enqueued_ns=0,
            peer=context.peer() or "",
        )
        return slot, item

    def _refuse_undecodable(self, req: Undecodable, context: grpc.aio.ServicerContext) -> RequestError:
        peer = context.peer() or ""
        self.s.ratelog.warning(peer, "undecodable", "undecodable request", error=req.message)
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, req.message)

    async def _act(
        self, req: pb.ActRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ActResponse:
        t0 = time.perf_counter_ns()
        if isinstance(req, Undecodable):
            raise self._refuse_undecodable(req, context)
        try:
            slot, item = self._decode(req, context)
        except SpecError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except RequestError:
            raise
        except Exception as e:  # a decoder bug must cost one request, never the stream or a traceback flood
            self.s.ratelog.warning(
                context.peer() or "", "decode-error", "request decoding failed", exc_info=True
            )
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"observation: could not be decoded ({type(e).__name__})"
            ) from None
        decode_us = (time.perf_counter_ns() - t0) // 1000
        item.enqueued_ns = time.perf_counter_ns()
        slot.submit(item)
        try:
            res = await asyncio.wrap_future(item.future)
        except asyncio.CancelledError:
            item.future.cancel()
            raise
        total_us = (time.perf_counter_ns() - t0) // 1000
        slot.latency.add(total_us / 1000.0)
        reply = pb.ActResponse(
            request_id=req.request_id,
            model_id=slot.model_id,
            actions=to_tensor(res.actions),
            commit=res.commit,
            timing=pb.Timing(
                queue_us=res.queue_us, decode_us=decode_us, inference_us=res.inference_us, total_us=total_us
            ),
            batch_size=res.batch_size,
            seed=item.seed,
            explicit_noise=item.noise is not None,
            n_exec=res.n_exec,
        )
        if res.uncertainty_kind:  # unset = not available (the field is optional)
            reply.uncertainty = res.uncertainty
            reply.uncertainty_kind = res.uncertainty_kind
        return reply

    async def Act(self, request: pb.ActRequest, context: grpc.aio.ServicerContext) -> pb.ActResponse:
        try:
            return await self._act(request, context)
        except RequestError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("unreachable") from None

    async def _stream_reply(
        self, req: pb.ActRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ActResponse:
        """The reply to one stream request: actions, or an ActResponse with ``error`` (never an exception)."""
        try:
            return await self._act(req, context)
        except RequestError as e:
            code, message = e.code, e.message
        except Exception:  # a bug here must not end the robot's stream
            self.s.ratelog.warning(
                context.peer() or "", "stream-error", "stream request failed", exc_info=True
            )
            code, message = grpc.StatusCode.INTERNAL, "request failed inside the server (logged)"
        ids = ("", "") if isinstance(req, Undecodable) else (req.request_id, req.model_id)
        return pb.ActResponse(
            request_id=ids[0], model_id=ids[1], error=pb.ActError(code=code.value[0], message=message)
        )

    async def StreamAct(
        self, request_iterator: AsyncIterator[pb.ActRequest | Undecodable], context: grpc.aio.ServicerContext
    ) -> None:
        """Requests answered in order, one at a time. A bad request gets an error reply and the stream stays
        open. A robot that does not read its replies stops being served: its next request is not read while
        a reply waits in the transport, and a reply that cannot be written within stream_write_timeout_s
        ends the stream (RESOURCE_EXHAUSTED), so it cannot take batch slots from robots that do read."""
        write_timeout = self.s.stream_write_timeout_s
        async for req in request_iterator:
            reply = await self._stream_reply(req, context)
            try:
                await asyncio.wait_for(context.write(reply), write_timeout)
            except TimeoutError:
                self.s.ratelog.warning(context.peer() or "", "slow-reader", "stream closed: replies not read")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"replies not read for {write_timeout:g} s (stream_write_timeout_s); stream closed",
                )
            if self.s.draining:  # answered; the robot reopens its stream on a replica that is serving
                return

    async def GetInfo(
        self, request: pb.GetInfoRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.GetInfoResponse:
        try:
            if isinstance(request, Undecodable):
                raise self._refuse_undecodable(request, context)
            slots = [self.s.slot(request.model_id)] if request.model_id else list(self.s.slots.values())
        except RequestError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("unreachable") from None
        detailed = self.s.authorized(context.invocation_metadata())
        return pb.GetInfoResponse(
            models=[self.s.model_info(s, detailed=detailed) for s in slots], server_version=__version__
        )

    # -- control
    async def _control(
        self,
        request: Any,
        context: grpc.aio.ServicerContext,
        fn: Callable[[threading.Event], Any],
        pool: concurrent.futures.Executor | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        cancel = threading.Event()
        try:
            if isinstance(request, Undecodable):
                raise self._refuse_undecodable(request, context)
            self.s.authorize(context.invocation_metadata())
            fut = asyncio.get_running_loop().run_in_executor(pool or self.s.control_pool, fn, cancel)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            except TimeoutError:
                cancel.set()  # the load stops at its next check; the pool thread comes back
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"load did not finish within load_timeout_s ({self.s.load_timeout_s:g} s); abandoned",
                ) from None
            except asyncio.CancelledError:
                cancel.set()
                raise
        except RequestError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("unreachable") from None

    async def LoadCheckpoint(
        self, request: pb.LoadCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadCheckpointResponse:
        def work(cancel: threading.Event) -> pb.LoadCheckpointResponse:
            t0 = time.perf_counter_ns()
            model_id = request.model_id or self.s.only_model_id()
            slot = self.s.load(
                model_id, request.ref, force=request.force, stage_only=request.stage_only, cancel=cancel
            )
            served = not (request.stage_only and slot.staged is not None)
            version = slot.active if served else slot.staged
            assert version is not None
            return pb.LoadCheckpointResponse(
                model_id=model_id,
                commit=version.commit,
                previous_commit=slot.previous.commit if slot.previous else "",
                serving=served,
                load_us=(time.perf_counter_ns() - t0) // 1000,
            )

        return await self._control(
            request, context, work, pool=self.s.load_pool, timeout_s=self.s.load_timeout_s + 5.0
        )

    async def Promote(self, request: pb.ModelRequest, context: grpc.aio.ServicerContext) -> pb.SwapResponse:
        def work(_: threading.Event) -> pb.SwapResponse:
            slot = self.s.slot(request.model_id)
            v = slot.promote()
            log.info("promoted", extra={"model_id": slot.model_id, "commit": v.commit})
            return self.s.swap_response(slot)

        return await self._control(request, context, work)

    async def Rollback(self, request: pb.ModelRequest, context: grpc.aio.ServicerContext) -> pb.SwapResponse:
        def work(_: threading.Event) -> pb.SwapResponse:
            slot = self.s.slot(request.model_id)
            v = slot.rollback()
            log.warning("rolled back", extra={"model_id": slot.model_id, "commit": v.commit})
            return self.s.swap_response(slot)

        return await self._control(request, context, work)


def add_service(service: _Service, server: grpc.aio.Server) -> None:
    """Register ``service`` like the generated ``add_PolicyServiceServicer_to_server``, but with
    deserializers that return :class:`Undecodable` instead of raising on garbage bytes."""
    rpc = {
        "Act": grpc.unary_unary_rpc_method_handler(
            service.Act, _safe_deserializer(pb.ActRequest), pb.ActResponse.SerializeToString
        ),
        "StreamAct": grpc.stream_stream_rpc_method_handler(
            service.StreamAct, _safe_deserializer(pb.ActRequest), pb.ActResponse.SerializeToString
        ),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            service.GetInfo, _safe_deserializer(pb.GetInfoRequest), pb.GetInfoResponse.SerializeToString
        ),
        "LoadCheckpoint": grpc.unary_unary_rpc_method_handler(
            service.LoadCheckpoint,
            _safe_deserializer(pb.LoadCheckpointRequest),
            pb.LoadCheckpointResponse.SerializeToString,
        ),
        "Promote": grpc.unary_unary_rpc_method_handler(
            service.Promote, _safe_deserializer(pb.ModelRequest), pb.SwapResponse.SerializeToString
        ),
        "Rollback": grpc.unary_unary_rpc_method_handler(
            service.Rollback, _safe_deserializer(pb.ModelRequest), pb.SwapResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, rpc),))


# ----------------------------------------------------------------------------------------------- server
class PolicyServer:
    """Host one or more checkpoints behind the ``vla_rl.v1.PolicyService`` gRPC service.

    ``models`` maps model id -> checkpoint reference (``hub://org/name@rev`` or a folder). ``follow`` maps
    model id -> a reference to poll every ``follow_interval_s`` (often the same ref, e.g. ``...@prod``);
    a new commit there is loaded and swapped in as LoadCheckpoint would. ``start()`` runs the server on a
    background thread (tests, embedding); :func:`serve` runs it in the foreground.
    """

    def __init__(
        self,
        models: Mapping[str, str | os.PathLike[str]],
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        max_batch: int = 16,
        max_wait_us: int = 2000,
        max_queue: int = 256,
        token: str | None = None,
        follow: Mapping[str, str] | None = None,
        follow_interval_s: float = 30.0,
        device: str = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        max_message_bytes: int | None = None,
        torch_threads: int | None = None,
        adaptive_wait: bool = True,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.limits = lim = limits or ServerLimits()
        if max_message_bytes is not None and max_message_bytes < MESSAGE_SLACK_BYTES:
            raise ValueError(f"max_message_bytes: expected >= {MESSAGE_SLACK_BYTES}, got {max_message_bytes}")
        self.load_timeout_s, self.max_file_bytes = lim.load_timeout_s, lim.max_file_bytes
        self.max_concurrent_rpcs, self.max_peer_queued = lim.max_concurrent_rpcs, lim.max_peer_queued
        self.stream_write_timeout_s = lim.stream_write_timeout_s
        self.max_noise_abs, self.max_state_abs = lim.max_noise_abs, lim.max_state_abs
        self.ratelog = RateLimitedLog(lim.log_interval_s)
        if not models:
            raise ValueError("PolicyServer needs at least one model (model id -> checkpoint reference)")
        unknown = set(follow or {}) - set(models)
        if unknown:
            raise ValueError(f"follow names model ids that are not served: {sorted(unknown)}")
        self.host, self.port = host, port
        self.batching = {
            "max_batch": max_batch,
            "max_wait_us": max_wait_us,
            "max_queue": max_queue,
            "adaptive_wait": adaptive_wait,
            "max_peer_queued": lim.max_peer_queued,
        }
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert (PEM certificate chain) and tls_key (PEM private key)")
        self.tls: tuple[bytes, bytes] | None = None
        if tls_cert is not None and tls_key is not None:
            self.tls = (Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())
        self.token = token
        self.device = device
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.max_message_bytes = max_message_bytes
        self._message_limit: int | None = None  # set at start
        self.follow = dict(follow or {})
        self.follow_interval_s = follow_interval_s
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.slots: dict[str, ModelSlot] = {}
        self._slots_lock = threading.Lock()
        # Promote/Rollback never wait behind a load: loads have their own pool, each bounded by load_timeout_s.
        self.control_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="policy-control")
        self.load_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="policy-load")
        self._initial = {k: str(v) for k, v in models.items()}
        self._stop = threading.Event()
        self._followers: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._aio: grpc.aio.Server | None = None
        self._health: Any = None
        self.draining = False  # set by drain(): health says NOT_SERVING, streams end after their next reply
        self._stop_requested: asyncio.Event | None = None
        self._grace_s = 1.0

    # -- models
    def slot(self, model_id: str) -> ModelSlot:
        if not model_id:
            model_id = self.only_model_id()
        s = self.slots.get(model_id)
        if s is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"model_id: expected one of {sorted(self.slots)}, got {model_id!r}"
            )
        return s

    def only_model_id(self) -> str:
        if len(self.slots) != 1:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model_id: required when several models are served ({sorted(self.slots)})",
            )
        return next(iter(self.slots))

    def load(
        self,
        model_id: str,
        ref: str,
        *,
        force: bool = False,
        stage_only: bool = False,
        cancel: threading.Event | None = None,
    ) -> ModelSlot:
        """Load, verify, check and warm up ``ref``, then serve it as ``model_id`` (or stage it).

        Runs on the caller's thread (a control or follower thread), never the batcher's. On failure the
        serving version is untouched, the error is recorded for GetInfo and logged, and RequestError raised.
        Bounded by ``load_timeout_s`` (checked between file blocks) and ``max_file_bytes``; ``cancel``
        (or the server stopping) abandons it at the next check.
        """
        if not ref:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "ref: expected hub://org/name[@rev] or a folder"
            )
        slot = self.slots.get(model_id)
        lock = slot.load_lock if slot is not None else self._slots_lock
        if not lock.acquire(timeout=self.load_timeout_s):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {model_id!r}: another load is still running after load_timeout_s "
                f"({self.load_timeout_s:g} s); retry later",
            )
        try:
            limits = LoadLimits(
                max_file_bytes=self.max_file_bytes,
                deadline=time.monotonic() + self.load_timeout_s,
                cancelled=_AnySet(self._stop, *(() if cancel is None else (cancel,))),
            )
            t0 = time.perf_counter()
            try:
                version = self._load_version(ref, slot, force, limits)
            except RequestError as e:
                if slot is not None:
                    stamp = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {ref}"
                    # GetInfo is unauthenticated: no file names, contents or hashes there.
                    slot.last_load_error = (
                        f"{stamp}: checkpoint refused ({e.code.name}); the reason is in the server log "
                        "and in GetInfo for control-token holders"
                    )
                    slot.last_load_error_detail = f"{stamp}: {e.message}"
                log.error(
                    "checkpoint refused; still serving the previous one",
                    extra={"model_id": model_id, "ref": ref, "error": e.message},
                )
                raise
            if slot is None:
                slot = ModelSlot(model_id, version, **self.batching)
                slot.start()
                self.slots[model_id] = slot
            elif stage_only:
                slot.stage(version)
            else:
                slot.swap_in(version)
            slot.last_load_error = slot.last_load_error_detail = ""
            log.info(
                "checkpoint staged" if stage_only else "checkpoint serving",
                extra={
                    "model_id": model_id,
                    "ref": ref,
                    "commit": version.commit,
                    "load_s": round(time.perf_counter() - t0, 3),
                },
            )
            return slot
        finally:
            lock.release()

    def _load_version(
        self, ref: str, slot: ModelSlot | None, force: bool, limits: LoadLimits | None = None
    ) -> ServedVersion:
        try:
            version = ServedVersion(
                load_servable(ref, device=self.device, cache_dir=self.cache_dir, limits=limits)
            )
        except CheckpointError as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint refused: {e}") from None
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"ref: {e}") from None
        except Exception as e:  # network, Hub, ... errors: report, keep serving
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, f"could not load {ref}: {type(e).__name__}: {e}"
            ) from None
        if slot is not None and not force:
            problems = spec_problems(slot.active.spec, version.spec)
            if problems:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"checkpoint refused: robot spec incompatible with the serving model ({'; '.join(problems)}); "
                    "pass force to swap anyway",
                )
        if self._message_limit is not None:
            need = request_bytes_for(version.spec, version.noise_shape)
            if need > self._message_limit:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"checkpoint refused: its robot spec needs requests of up to {need} bytes, over the "
                    f"server's max_message_bytes ({self._message_limit}); restart with a larger limit",
                )
        try:
            version.warm_up()
        except Exception as e:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint refused: warm-up failed: {e}"
            ) from None
        return version

    def authorized(self, metadata: Any) -> bool:
        """Whether ``metadata`` carries the control token (never raises)."""
        try:
            self.authorize(metadata)
        except RequestError:
            return False
        return True

    def authorize(self, metadata: Any) -> None:
        if not self.token:
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED, "control calls are disabled: the server has no token"
            )
        got = ""
        for key, value in metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode()
        want = f"Bearer {self.token}"
        if not hmac.compare_digest(got.encode(), want.encode()):
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization: expected metadata 'authorization: Bearer <token>'"
                + (", got a wrong token" if got else ", got none"),
            )

    def model_info(self, s: ModelSlot, detailed: bool = False) -> pb.ModelInfo:
        v = s.active
        p50, p99, rate = s.latency.summary()
        return pb.ModelInfo(
            model_id=s.model_id,
            ref=v.model.ref,
            commit=v.commit,
            previous_commit=s.previous.commit if s.previous else "",
            staged_commit=s.staged.commit if s.staged else "",
            followed_ref=self.follow.get(s.model_id, ""),
            robot_spec_json=v.spec.to_json(),
            chunk_len=v.chunk_len,
            n_exec=v.n_exec,
            control_hz=v.spec.control_hz,
            policy_type=v.model.policy_type,
            device=str(v.model.device),
            last_load_error=s.last_load_error_detail if detailed else s.last_load_error,
            served=s.served,
            batches=s.batches,
            dropped_expired=s.dropped_expired,
            rejected_full=s.rejected_full,
            max_batch=s.max_batch,
            max_wait_us=s.max_wait_us,
            max_queue=s.max_queue,
            adaptive_wait=s.adaptive_wait,
            active_clients=s.active_clients(),
            latency_p50_ms=p50,
            latency_p99_ms=p99,
            requests_per_s=rate,
        )

    def swap_response(self, s: ModelSlot) -> pb.SwapResponse:
        return pb.SwapResponse(
            model_id=s.model_id,
            commit=s.active.commit,
            previous_commit=s.previous.commit if s.previous else "",
        )

    # -- following a ref
    def _follow_loop(self, model_id: str, ref: str) -> None:
        from vla_rl.hub.registry import resolve

        while not self._stop.wait(self.follow_interval_s):
            slot = self.slots.get(model_id)
            if slot is None:
                continue
            try:
                commit = resolve(ref)
            except Exception as e:  # e.g. the ref is mid-move: keep serving, retry later
                log.warning("could not resolve followed ref", extra={"ref": ref, "error": str(e)})
                continue
            if commit in (slot.active.commit, slot.last_failed_commit):
                continue
            log.info("followed ref moved", extra={"model_id": model_id, "ref": ref, "commit": commit})
            try:
                self.load(model_id, ref)
            except RequestError:
                slot.last_failed_commit = commit  # do not retry the same broken revision every poll
            else:
                slot.last_failed_commit = ""

    # -- lifecycle
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def message_limit(self) -> int:
        """The receive limit: ``max_message_bytes`` if given, else what the served specs need."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        need = max(request_bytes_for(s.active.spec, s.active.noise_shape) for s in self.slots.values())
        return max(need, MIN_DERIVED_MESSAGE_BYTES)

    async def _start_async(self) -> None:
        self._message_limit = self.message_limit()
        opts = [
            ("grpc.max_receive_message_length", self._message_limit),
            ("grpc.max_send_message_length", max(self._message_limit, 4 * 1024 * 1024)),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it silently
            ("grpc.keepalive_time_ms", 30_000),  # notice half-open robot streams
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
        self._aio = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.max_concurrent_rpcs)
        add_service(_Service(self), self._aio)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._aio)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._aio
        )
        if self.tls is not None:
            creds = grpc.ssl_server_credentials([self.tls])
            port = self._aio.add_secure_port(f"{self.host}:{self.port}", creds)
        else:
            if self.token and self.host not in ("127.0.0.1", "localhost", "::1"):
                log.warning(
                    "control token sent in clear text: bind 127.0.0.1 or give --tls-cert/--tls-key",
                    extra={"host": self.host},
                )
            port = self._aio.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"could not bind the policy server to {self.host}:{self.port}")
        self.port = port
        await self._aio.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _load_initial(self) -> None:
        for model_id, ref in self._initial.items():
            if model_id not in self.slots:
                self.load(model_id, ref)
        for model_id, ref in self.follow.items():
            t = threading.Thread(
                target=self._follow_loop, args=(model_id, ref), name=f"follow-{model_id}", daemon=True
            )
            t.start()
            self._followers.append(t)

    def start(self, timeout_s: float = 120.0) -> PolicyServer:
        """Load the models, then serve on a background thread; returns once the port is bound."""
        self._load_initial()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            # One coroutine owns the server from start to stop: stopping a grpc.aio server from a
            # second coroutine while another awaits wait_for_termination() hung in grpcio 1.85.
            self._loop = asyncio.get_running_loop()
            self._stop_requested = asyncio.Event()
            try:
                await self._start_async()
            except BaseException as e:  # surfaced to start()'s caller
                failure.append(e)
                ready.set()
                return
            ready.set()
            await self._stop_requested.wait()
            assert self._aio is not None
            await self._health.enter_graceful_shutdown()
            await self._aio.stop(self._grace_s)

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), name="policy-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError("policy server did not start")
        if failure:
            self._shutdown_models()
            raise failure[0]
        log.info("policy server listening", extra={"address": self.address, "models": sorted(self.slots)})
        return self

    def drain(self, timeout_s: float = 5.0) -> None:
        """Stop taking new work without refusing any: the health service says NOT_SERVING (for the whole
        server and for the policy service), so balanced clients (a list of replicas, ``round_robin`` with
        health checking) send their next calls to the other replicas, and each open stream ends after its
        next reply (its robot reopens it elsewhere). Calls that still arrive are answered. ``stop()`` ends
        the rest; ``vla-rl serve`` drains for ``--drain`` seconds on SIGTERM before it stops."""
        self.draining = True
        if self._loop is None or self._health is None:
            return

        async def not_serving() -> None:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        asyncio.run_coroutine_threadsafe(not_serving(), self._loop).result(timeout_s)
        log.info("draining: health NOT_SERVING, streams close after their next reply")

    def _shutdown_models(self) -> None:
        self._stop.set()
        for s in list(self.slots.values()):
            s.stop()
        self.control_pool.shutdown(wait=False, cancel_futures=True)
        self.load_pool.shutdown(wait=False, cancel_futures=True)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting calls, let in-flight ones finish for ``grace_s``, then stop the batchers."""
        if self._loop is not None and self._stop_requested is not None and self._thread is not None:
            self._grace_s = grace_s
            self._loop.call_soon_threadsafe(self._stop_requested.set)
            self._thread.join(grace_s + 10)
        self._shutdown_models()

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    checkpoint: str | os.PathLike[str],
    *,
    follow: bool | str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    max_batch: int = 16,
    max_wait_us: int = 2000,
    token: str | None = None,
    model_id: str = "default",
    max_queue: int = 256,
    follow_interval_s: float = 30.0,
    device: str = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
    adaptive_wait: bool = True,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    max_message_bytes: int | None = None,
    limits: ServerLimits | None = None,
    drain_s: float = DEFAULT_DRAIN_S,
) -> None:
    """Serve ``checkpoint`` as ``model_id`` until interrupted (what ``vla-rl serve`` runs).

    ``checkpoint`` is a vla-rl checkpoint or a LeRobot policy folder (picked by its ``config.json``).
    ``follow=True`` polls ``checkpoint`` itself for new revisions (use a moving ref such as
    ``hub://org/name@prod``); a string follows that ref instead. ``token`` enables the control calls.
    ``tls_cert``/``tls_key`` (PEM files) serve over TLS. ``max_message_bytes`` (None = derived from the
    robot spec) and ``limits`` bound what one client can make the server do. SIGTERM first drains for
    ``drain_s`` seconds (:meth:`PolicyServer.drain`: balanced clients move to the other replicas), then
    stops; Ctrl-C, or a second signal, stops at once.
    """
    if isinstance(drain_s, bool) or not isinstance(drain_s, int | float) or not 0 <= drain_s < float("inf"):
        raise ValueError(f"drain_s: expected a number of seconds >= 0, got {drain_s!r}")
    follow_ref = str(checkpoint) if follow is True else (follow or None)
    server = PolicyServer(
        {model_id: checkpoint},
        host=host,
        port=port,
        max_batch=max_batch,
        max_wait_us=max_wait_us,
        max_queue=max_queue,
        token=token,
        follow={model_id: follow_ref} if follow_ref else None,
        follow_interval_s=follow_interval_s,
        device=device,
        cache_dir=cache_dir,
        adaptive_wait=adaptive_wait,
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_message_bytes=max_message_bytes,
        limits=limits,
    )
    server.start()
    previous = _stop_on_sigterm()
    grace_s = 1.0  # Ctrl-C stops at once: calls in flight get a second, open streams are cancelled
    try:
        try:
            while server._thread is not None and server._thread.is_alive():
                server._thread.join(1.0)
        except KeyboardInterrupt as stop:
            if isinstance(stop, _Terminate) and drain_s > 0:
                log.info("stop requested: draining first", extra={"drain_s": drain_s})
                grace_s = 5.0
                try:
                    server.drain()
                    # not Thread.join: after a join interrupted by the signal, is_alive() can say False
                    time.sleep(drain_s)
                except KeyboardInterrupt:
                    log.info("second stop request: stopping now")
                    grace_s = 1.0
            log.info("stopping policy server")
    finally:
        server.stop(grace_s=grace_s)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminate(KeyboardInterrupt):
    """SIGTERM: stop :func:`serve` after draining (Ctrl-C stops it at once)."""


def _raise_terminate(signum: int, frame: Any) -> None:
    raise _Terminate(f"signal {signum}")


def _stop_on_sigterm() -> Any:
    """Make SIGTERM (``docker stop``, Kubernetes, systemd) stop :func:`serve`: drain, then stop. Returns
    the previous handler (None when not on the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminate)

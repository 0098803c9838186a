"""Slim synchronous client for the policy server (numpy, grpcio, Pillow; no torch).

Every call has a deadline (``timeout_s``), because a robot blocked forever on a dead server is worse than
one that gets an error and stops safely (LeRobot #3979: ``Ready()`` without a deadline hangs). Errors come
back as :class:`PolicyError` with the gRPC status code and the server's message, which names the field.

When the server goes away (restart, rolling update) a call keeps retrying UNAVAILABLE with exponential
backoff and jitter (:class:`Backoff`) *within its deadline*, so a robot rides out a restart shorter than its
budget and gets an error, not a hang, for a longer one. Inference calls are safe to repeat (no state on the
server); control calls are never retried. The channel's own reconnect backoff is capped at the same maximum,
so a server that comes back is found within ``Backoff.max_s`` (gRPC's default cap is 120 s).

:mod:`server.aio_client` is the asyncio twin; :mod:`server.action_queue` turns chunks into a steady
action stream for a control loop.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from server.codec import encode_image, from_tensor, to_tensor
from server.proto import policy_service_pb2 as pb
from server.proto import policy_service_pb2_grpc as pb_grpc

__all__ = [
    "ActResult",
    "ActStream",
    "Backoff",
    "PolicyClient",
    "PolicyError",
    "Timing",
    "build_request",
    "channel_credentials",
    "channel_options",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter for retrying UNAVAILABLE: ``initial_s * multiplier**n``, capped at
    ``max_s``, each delay scaled by a random factor in ``[1 - jitter, 1 + jitter]`` so that a fleet of robots
    does not reconnect in lock-step."""

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s) or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError(
                f"Backoff needs 0 < initial_s <= max_s, multiplier >= 1, 0 <= jitter < 1; got {self}"
            )

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * (1.0 + self.jitter * (2.0 * (rng or random).random() - 1.0))


RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
DEFAULT_BACKOFF = Backoff()


def channel_options(max_message_bytes: int, backoff: Backoff | None) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    if backoff is not None:  # the channel's own reconnect attempts, capped like ours
        opts += [
            ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(backoff.max_s * 1000))),
        ]
    return opts


def channel_credentials(tls_ca: str | os.PathLike[str] | bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM root certificate(s) ``tls_ca`` (a path or the bytes); None = plaintext."""
    if tls_ca is None:
        return None
    pem = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


class PolicyError(Exception):
    """A call failed: ``code`` is the gRPC status, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> PolicyError:
        return cls(e.code(), e.details() or "")  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Timing:
    """Server-side microseconds (see ``Timing`` in the proto) plus the client's round trip."""

    queue_us: int
    decode_us: int
    inference_us: int
    total_us: int
    round_trip_us: int


@dataclass(frozen=True)
class ActResult:
    """One action chunk and where it came from."""

    actions: np.ndarray  # float32 [H, A]
    commit: str
    timing: Timing
    batch_size: int
    seed: int
    n_exec: int
    model_id: str
    request_id: str


def build_request(
    obs: Mapping[str, Any],
    *,
    model_id: str = "",
    seed: int | None = None,
    noise: np.ndarray | None = None,
    request_id: str = "",
    image_format: str = "raw",
    timeout_ms: int = 0,
) -> pb.ActRequest:
    """An ``ActRequest`` from ``{"state": float32[S], "cameras": {name: uint8[H, W, 3]}, "instruction": str}``."""
    o = pb.Observation(instruction=str(obs.get("instruction") or ""))
    if obs.get("state") is not None:
        o.state.CopyFrom(to_tensor(np.asarray(obs["state"])))
    for name, img in (obs.get("cameras") or {}).items():
        o.cameras[name].CopyFrom(encode_image(np.asarray(img), image_format))
    req = pb.ActRequest(model_id=model_id, request_id=request_id, observation=o, timeout_ms=timeout_ms)
    if seed is not None:
        req.seed = int(seed)
    if noise is not None:
        req.noise.CopyFrom(to_tensor(np.asarray(noise, dtype=np.float32)))
    return req


def _result(resp: pb.ActResponse, t0: int) -> ActResult:
    if resp.HasField("error"):
        raise PolicyError(grpc.StatusCode(_CODES[resp.error.code]), resp.error.message)
    t = resp.timing
    return ActResult(
        actions=from_tensor(resp.actions, "actions", dtype="float32"),
        commit=resp.commit,
        timing=Timing(
            t.queue_us, t.decode_us, t.inference_us, t.total_us, (time.perf_counter_ns() - t0) // 1000
        ),
        batch_size=resp.batch_size,
        seed=resp.seed,
        n_exec=resp.n_exec,
        model_id=resp.model_id,
        request_id=resp.request_id,
    )


_CODES = {c.value[0]: c.value for c in grpc.StatusCode}
_ids = itertools.count()


class ActStream:
    """One robot's ``StreamAct`` stream: send an observation, wait for its chunk, repeat.

    Requests are answered in order; a bad request raises :class:`PolicyError` but the stream stays open.
    Each request carries its budget (``timeout_ms``) so the server drops it unanswered-for rather than run
    it late, and the client waits at most that long (plus a margin for the reply to travel): a stream
    whose reply does not come in time is cancelled, since a later reply could no longer be matched.
    A stream that the server closes (restart) is reopened on the next ``act`` with the client's backoff,
    within that call's budget; the request is sent again on the new stream.
    """

    _END = object()
    _MARGIN_S = 1.0

    def __init__(self, stub: pb_grpc.PolicyServiceStub, client: PolicyClient, model_id: str) -> None:
        self._stub = stub
        self._client = client
        self._model_id = model_id
        self._lock = threading.Lock()
        self._broken: PolicyError | None = None
        self._closed = False
        self.reopened = 0
        self._open()

    def _open(self) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._replies: queue.Queue[pb.ActResponse | PolicyError] = queue.Queue()
        self._call = self._stub.StreamAct(iter(self._requests.get, self._END))
        self._reader = threading.Thread(
            target=self._read, args=(self._call, self._replies), name="act-stream-reader", daemon=True
        )
        self._reader.start()

    @staticmethod
    def _read(call: Any, replies: queue.Queue[Any]) -> None:
        try:
            for resp in call:
                replies.put(resp)
            replies.put(PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed by the server"))
        except grpc.RpcError as e:
            replies.put(PolicyError.from_rpc(e))

    def act(
        self,
        obs: Mapping[str, Any],
        seed: int | None = None,
        noise: np.ndarray | None = None,
        timeout_s: float | None = None,
    ) -> ActResult:
        timeout = self._client.timeout_s if timeout_s is None else timeout_s
        req = build_request(
            obs,
            model_id=self._model_id,
            seed=seed,
            noise=noise,
            request_id=f"s{next(_ids)}",
            image_format=self._client.image_format,
            timeout_ms=max(1, int(timeout * 1000)),
        )
        deadline = time.monotonic() + timeout + self._MARGIN_S
        backoff = self._client.backoff
        attempt = 0
        with self._lock:
            while True:
                if self._broken is not None:
                    delay = backoff.delay(attempt) if backoff is not None else 0.0
                    if (
                        self._closed
                        or backoff is None
                        or self._broken.code not in RETRYABLE
                        or time.monotonic() + delay >= deadline
                    ):
                        raise self._broken
                    time.sleep(delay)
                    attempt += 1
                    self._call.cancel()
                    self._open()
                    self._broken = None
                    self.reopened += 1
                    self._client.retries += 1
                t0 = time.perf_counter_ns()
                self._requests.put(req)
                try:
                    reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self._broken = PolicyError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout + self._MARGIN_S:.1f} s"
                    )
                    self._requests.put(self._END)
                    self._call.cancel()
                    raise self._broken from None
                if isinstance(reply, PolicyError):
                    self._broken = reply
                    continue  # reopen (UNAVAILABLE, within the budget) or raise, at the top
                break
        if reply.request_id != req.request_id:  # cannot happen with an in-order server; never mis-route
            raise PolicyError(
                grpc.StatusCode.INTERNAL, f"reply for {reply.request_id!r} to request {req.request_id!r}"
            )
        return _result(reply, t0)

    def close(self) -> None:
        self._closed = True
        self._requests.put(self._END)
        self._call.cancel()

    def __enter__(self) -> ActStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PolicyClient:
    """Blocking client: ``act`` for chunks, ``info`` for the served models, control calls with a token.

    ``tls_ca`` (PEM root certificate, path or bytes) connects over TLS; ``backoff=None`` turns retries off.
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        *,
        model_id: str = "",
        image_format: str = "raw",
        max_message_bytes: int = 64 * 1024 * 1024,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        backoff: Backoff | None = DEFAULT_BACKOFF,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.model_id = model_id
        self.image_format = image_format
        self.backoff = backoff
        self.retries = 0  # calls repeated after UNAVAILABLE (and streams reopened)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        opts = channel_options(max_message_bytes, backoff)
        creds = channel_credentials(tls_ca)
        self._channel = (
            grpc.secure_channel(address, creds, options=opts)
            if creds is not None
            else grpc.insecure_channel(address, options=opts)
        )
        self._stub = pb_grpc.PolicyServiceStub(self._channel)

    def act(
        self,
        obs: Mapping[str, Any],
        seed: int | None = None,
        *,
        noise: np.ndarray | None = None,
        model_id: str | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ActResult:
        """One action chunk [H, A] for ``obs`` (seeded or explicit initial noise for reproducibility)."""
        req = build_request(
            obs,
            model_id=self.model_id if model_id is None else model_id,
            seed=seed,
            noise=noise,
            request_id=request_id if request_id is not None else f"u{next(_ids)}",
            image_format=self.image_format,
        )
        return self.act_request(req, timeout_s)

    def act_request(self, req: pb.ActRequest, timeout_s: float | None = None) -> ActResult:
        """Send a prepared ``ActRequest`` (lets tests and tools send what ``build_request`` would refuse)."""
        t0 = time.perf_counter_ns()
        resp = self._retrying(lambda t: self._stub.Act(req, timeout=t), timeout_s)
        return _result(resp, t0)

    def _retrying(self, call: Callable[[float], T], timeout_s: float | None) -> T:
        """``call(remaining_s)``, repeated after UNAVAILABLE with backoff until the deadline."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            try:
                return call(max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                err = PolicyError.from_rpc(e)
            if self.backoff is None or err.code not in RETRYABLE:
                raise err
            delay = self.backoff.delay(attempt)
            if time.monotonic() + delay >= deadline:
                raise err
            time.sleep(delay)
            attempt += 1
            self.retries += 1

    def stream(self, model_id: str | None = None) -> ActStream:
        return ActStream(self._stub, self, self.model_id if model_id is None else model_id)

    def info(self, model_id: str = "", timeout_s: float | None = None) -> dict[str, pb.ModelInfo]:
        """Served models by id: commit, spec JSON, chunk length, n_exec, last load error, counters."""
        req = pb.GetInfoRequest(model_id=model_id)
        resp = self._retrying(
            lambda t: self._stub.GetInfo(req, timeout=t, metadata=self._metadata), timeout_s
        )
        return {m.model_id: m for m in resp.models}

    def load_checkpoint(
        self,
        ref: str,
        model_id: str | None = None,
        *,
        force: bool = False,
        stage_only: bool = False,
        timeout_s: float = 300.0,
    ) -> pb.LoadCheckpointResponse:
        """Load ``ref`` (verified, spec-checked, warmed up) and serve it; returns once it serves (or is staged)."""
        req = pb.LoadCheckpointRequest(
            model_id=self.model_id if model_id is None else model_id,
            ref=ref,
            force=force,
            stage_only=stage_only,
        )
        return self._call(self._stub.LoadCheckpoint, req, timeout_s)

    def promote(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        req = pb.ModelRequest(model_id=self.model_id if model_id is None else model_id)
        return self._call(self._stub.Promote, req, timeout_s)

    def rollback(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        req = pb.ModelRequest(model_id=self.model_id if model_id is None else model_id)
        return self._call(self._stub.Rollback, req, timeout_s)

    def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """The standard health service's status name for ``service`` ("" = the whole server)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _call(self, method: Any, req: Any, timeout_s: float | None) -> Any:
        """A call that is not repeated (control calls change state; health is a probe)."""
        try:
            return method(req, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise PolicyError.from_rpc(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

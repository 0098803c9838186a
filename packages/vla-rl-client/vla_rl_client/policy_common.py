"""What the blocking (:mod:`vla_rl_client.policy_client`) and asyncio (:mod:`vla_rl_client.aio_policy_client`) clients share.

Everything here is independent of how a call waits: the retry policy (:class:`Backoff` and one call's
:class:`RetryBudget`), channel options and TLS, building requests (:func:`build_request` and the control
requests) and turning replies into :class:`ActResult` or :class:`PolicyError`. The two clients add only the
waiting (``time.sleep`` / ``await asyncio.sleep``, threads / ``grpc.aio``). Like the clients, this imports
numpy, grpcio, Pillow and the generated protobuf code only (no torch).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import random
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from vla_rl_client.codec import fill_image, fill_tensor, from_tensor
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_BACKOFF",
    "HEALTH_SERVICE",
    "RETRYABLE",
    "ActResult",
    "Backoff",
    "ChannelTarget",
    "ClientBase",
    "PolicyError",
    "RetryBudget",
    "Timing",
    "balanced_service_config",
    "build_request",
    "channel_credentials",
    "channel_options",
    "channel_target",
    "check_reply",
    "parse_response",
    "serialize",
]


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


class PolicyError(Exception):
    """A call failed: ``code`` is the gRPC status, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> PolicyError:
        return cls(e.code(), e.details() or "")  # type: ignore[attr-defined]


class RetryBudget:
    """One call's deadline and retries: after an error, :meth:`delay_or_raise` says how long to pause before
    repeating it, or raises the error when it is not retryable, retries are off (``backoff=None``) or the
    pause would pass the deadline. The caller does the waiting (blocking or awaited)."""

    def __init__(self, backoff: Backoff | None, budget_s: float) -> None:
        self.backoff = backoff
        self.deadline = time.monotonic() + budget_s
        self.attempt = 0

    def remaining(self, floor: float = 0.001) -> float:
        return max(floor, self.deadline - time.monotonic())

    def delay_or_raise(self, err: PolicyError) -> float:
        if self.backoff is None or err.code not in RETRYABLE:
            raise err
        delay = self.backoff.delay(self.attempt)
        if time.monotonic() + delay >= self.deadline:
            raise err
        self.attempt += 1
        return delay


HEALTH_SERVICE = pb.DESCRIPTOR.services_by_name["PolicyService"].full_name
"""The ``grpc.health.v1`` service name a balanced channel watches on each replica (the policy server sets it
SERVING once it serves and NOT_SERVING when it drains)."""

_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock")
_BALANCED_SCHEMES = ("dns", "ipv4", "ipv6")
ADDRESS_HELP = (
    "host:port, a comma-separated list of them (replicas), or a gRPC target such as dns:///name:port"
)


@dataclass(frozen=True)
class ChannelTarget:
    """What a client's ``address`` becomes: the gRPC ``target``, whether the channel balances over several
    servers (``round_robin`` with health checking) and, for a list, the ``authority`` it names (the first
    entry's ``host:port``: what a TLS certificate must be valid for)."""

    target: str
    balanced: bool
    authority: str | None = None


def _split_host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: each server in a list is host:port (port 1-65535); got {entry!r}")
    return host, int(port)


def _ip_of(host: str, port: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address: a literal as is, ``localhost`` as 127.0.0.1, a name looked up once."""
    if host == "localhost":
        return ipaddress.IPv4Address("127.0.0.1")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(
            f"address: could not resolve {host!r} ({e}); give IP addresses, or dns:///{host}:{port} "
            "to let gRPC resolve (and re-resolve) the name"
        ) from None
    return ipaddress.ip_address(infos[0][4][0])


def channel_target(address: str) -> ChannelTarget:
    """The gRPC target for ``address`` (see :data:`ADDRESS_HELP`); ``ValueError`` naming it when it is not one.

    * ``host:port``: one server, as given (gRPC's default resolver, ``pick_first``).
    * ``a:1,b:2``: replicas, through gRPC's static resolver (``ipv4:``/``ipv6:``; a host name in the list is
      looked up once, here) and balanced.
    * ``dns:///name:port`` (every address the name resolves to, re-resolved by gRPC), ``ipv4:...`` and
      ``ipv6:...``: balanced; ``unix:`` and other schemes: as given.
    """
    address = address.strip() if isinstance(address, str) else address
    if not isinstance(address, str) or not address:
        raise ValueError(f"address: expected {ADDRESS_HELP}; got {address!r}")
    scheme = address.split(":", 1)[0]
    if scheme in _SCHEMES:
        return ChannelTarget(address, balanced=scheme in _BALANCED_SCHEMES)
    if "," not in address:
        return ChannelTarget(address, balanced=False)
    entries = [e.strip() for e in address.split(",")]
    if "" in entries:
        raise ValueError(f"address: an empty entry in the list {address!r}; expected {ADDRESS_HELP}")
    resolved = []
    for entry in entries:
        host, port = _split_host_port(entry)
        resolved.append((_ip_of(host, port), port))
    versions = {ip.version for ip, _ in resolved}
    if len(versions) > 1:
        raise ValueError(
            f"address: {address!r} mixes IPv4 and IPv6 servers; gRPC's static resolver takes one family"
        )
    parts = [f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}" for ip, port in resolved]
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise ValueError(f"address: {address!r} lists {', '.join(dupes)} more than once")
    return ChannelTarget(f"ipv{versions.pop()}:{','.join(parts)}", balanced=True, authority=entries[0])


def balanced_service_config() -> str:
    """The channel's service config for replicas: gRPC's ``round_robin`` over every address, each checked with
    the standard health service (:data:`HEALTH_SERVICE`), so a replica that is down or NOT_SERVING (draining)
    gets no new calls until it reports SERVING again. Retries are the client's own loop (:class:`RetryBudget`),
    not a gRPC ``retryPolicy``: one budget covers a call and a stream alike."""
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": HEALTH_SERVICE},
        }
    )


def channel_options(
    max_message_bytes: int,
    backoff: Backoff | None,
    *,
    balanced: bool = False,
    authority: str | None = None,
) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        # One client = one connection = one robot to the server's adaptive batching wait. Without this,
        # gRPC shares a TCP connection among a process's channels to the same address (the global
        # subchannel pool), and a simulator driving N robots in one process looks like one robot.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if backoff is not None:  # the channel's own reconnect attempts, capped like ours
        opts += [
            ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(backoff.initial_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(backoff.max_s * 1000))),
        ]
    if balanced:
        opts.append(("grpc.service_config", balanced_service_config()))
    if authority is not None:  # a static list: TLS checks the certificate against its first name
        opts.append(("grpc.default_authority", authority))
    return opts


def channel_credentials(tls_ca: str | os.PathLike[str] | bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM root certificate(s) ``tls_ca`` (a path or the bytes); None = plaintext."""
    if tls_ca is None:
        return None
    pem = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


@dataclass(frozen=True)
class Timing:
    """Where one chunk's time went, in microseconds: the server's stages (``Timing`` in the proto: decode,
    queue, batch, inference = prefix + denoise, wake, encode; all within ``total_us``) and the client's own.

    ``round_trip_us`` runs from the request handed to gRPC to the reply received; ``network_us`` is the part
    of it the server did not account for (gRPC on both ends, loopback or the network, thread wake-ups).
    ``ttfa_us`` (time to first action) runs from the call (before the observation was encoded) to the
    decoded chunk: ``client_encode_us`` + ``round_trip_us`` + ``client_decode_us``. Servers older than the
    stage fields report them as 0; a request sent prepared (``act_request``) has ``client_encode_us`` 0.
    """

    queue_us: int
    decode_us: int
    inference_us: int
    total_us: int
    round_trip_us: int
    prefix_us: int = 0
    denoise_us: int = 0
    batch_us: int = 0
    wake_us: int = 0
    encode_us: int = 0
    client_encode_us: int = 0
    client_decode_us: int = 0
    ttfa_us: int = 0

    @property
    def network_us(self) -> int:
        """Round trip minus the server's own time (never negative)."""
        return max(0, self.round_trip_us - self.total_us)

    @property
    def overhead_us(self) -> int:
        """Everything but the model's forward: time to first action minus ``inference_us``."""
        return max(0, self.ttfa_us - self.inference_us)


@dataclass(frozen=True)
class RTCInput:
    """Real-time chunking for one request (docs/serving.md): ``queued`` float32 [n, A], the actions still
    queued for the control steps from this observation's on (env units; None or empty: nothing queued yet,
    so no RTC), ``delay`` of which the robot executes before the reply arrives (control steps)."""

    delay: int
    queued: np.ndarray | None = None

    def __post_init__(self) -> None:
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 0:
            raise ValueError(f"delay: expected an integer >= 0 (control steps), got {self.delay!r}")


@dataclass(frozen=True)
class RTCInfo:
    """How real-time chunking shaped a reply's chunk (``ActResponse.rtc``)."""

    mode: str  # "guided" or "trained"
    inference_delay: int
    queued: int
    execution_horizon: int
    max_guidance_weight: float


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
    uncertainty: float = float("nan")
    """The chunk's uncertainty from its own denoising path (higher = less sure; flow_vla: the ``accel``
    score, docs/algorithms.md §6a); NaN when the model cannot score its chunks (LeRobot policies) or the server
    predates the field."""
    uncertainty_kind: str = ""
    """What :attr:`uncertainty` is ("accel"); "" when it is not available."""
    rtc: RTCInfo | None = None
    """How real-time chunking shaped the chunk; None when it did not (not asked, or a server without it)."""
    failure: float = float("nan")
    """The learned failure predictor's P(failure or takeover soon) for this chunk (docs/algorithms.md §6c);
    NaN when the served checkpoint has no predictor (or the server predates the field)."""
    failure_alarm: bool = False
    """:attr:`failure` is above the predictor's calibrated threshold: time to ask for help."""


def build_request(
    obs: Mapping[str, Any],
    *,
    model_id: str = "",
    seed: int | None = None,
    noise: np.ndarray | None = None,
    request_id: str = "",
    image_format: str = "raw",
    timeout_ms: int = 0,
    rtc: RTCInput | None = None,
) -> pb.ActRequest:
    """An ``ActRequest`` from ``{"state": float32[S], "cameras": {name: uint8[H, W, 3]}, "instruction": str}``.

    Every array is written into its field in place (:func:`~vla_rl_client.codec.fill_tensor`): the pixels are
    copied once, not once per enclosing message."""
    req = pb.ActRequest(model_id=model_id, request_id=request_id, timeout_ms=timeout_ms)
    o = req.observation
    o.instruction = str(obs.get("instruction") or "")
    if obs.get("state") is not None:
        fill_tensor(o.state, np.asarray(obs["state"]))
    for name, img in (obs.get("cameras") or {}).items():
        fill_image(o.cameras[name], np.asarray(img), image_format)
    if seed is not None:
        req.seed = int(seed)
    if noise is not None:
        fill_tensor(req.noise, np.asarray(noise, dtype=np.float32))
    if rtc is not None:
        req.inference_delay = rtc.delay
        if rtc.queued is not None and len(rtc.queued):
            fill_tensor(req.queued_actions, np.ascontiguousarray(rtc.queued, dtype=np.float32))
    return req


_CODES = {c.value[0]: c.value for c in grpc.StatusCode}


def serialize(msg: Any) -> bytes:
    """A request for the wire: a message serialised, or bytes (serialised already) as they are."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def parse_response(resp: pb.ActResponse, t0: int, started_ns: int | None = None) -> ActResult:
    """The chunk in ``resp`` (sent at ``time.perf_counter_ns() == t0``; the call started, before encoding, at
    ``started_ns``, default ``t0``), or its error as :class:`PolicyError`."""
    received = time.perf_counter_ns()
    if resp.HasField("error"):
        raise PolicyError(grpc.StatusCode(_CODES[resp.error.code]), resp.error.message)
    t = resp.timing
    actions = from_tensor(resp.actions, "actions", dtype="float32")
    started = t0 if started_ns is None else started_ns
    done = time.perf_counter_ns()
    return ActResult(
        actions=actions,
        commit=resp.commit,
        timing=Timing(
            t.queue_us,
            t.decode_us,
            t.inference_us,
            t.total_us,
            (received - t0) // 1000,
            prefix_us=t.prefix_us,
            denoise_us=t.denoise_us,
            batch_us=t.batch_us,
            wake_us=t.wake_us,
            encode_us=t.encode_us,
            client_encode_us=(t0 - started) // 1000,
            client_decode_us=(done - received) // 1000,
            ttfa_us=(done - started) // 1000,
        ),
        batch_size=resp.batch_size,
        seed=resp.seed,
        n_exec=resp.n_exec,
        model_id=resp.model_id,
        request_id=resp.request_id,
        uncertainty=resp.uncertainty if resp.HasField("uncertainty") else float("nan"),
        uncertainty_kind=resp.uncertainty_kind if resp.HasField("uncertainty") else "",
        rtc=_rtc_info(resp),
        failure=resp.failure if resp.HasField("failure") else float("nan"),
        failure_alarm=resp.failure_alarm if resp.HasField("failure") else False,
    )


def _rtc_info(resp: pb.ActResponse) -> RTCInfo | None:
    if not resp.HasField("rtc"):
        return None
    r = resp.rtc
    return RTCInfo(r.mode, r.inference_delay, r.queued, r.execution_horizon, r.max_guidance_weight)


def check_reply(
    reply: pb.ActResponse, req: pb.ActRequest, t0: int, started_ns: int | None = None
) -> ActResult:
    """A stream's reply to ``req``: cannot be another request's with an in-order server; never mis-route."""
    if reply.request_id != req.request_id:
        raise PolicyError(
            grpc.StatusCode.INTERNAL, f"reply for {reply.request_id!r} to request {req.request_id!r}"
        )
    return parse_response(reply, t0, started_ns)


_ids = itertools.count()
SMALL_REQUEST_BYTES = 64 * 1024
"""A request this small fits any server (the least ``max_message_bytes`` it takes): no need to ask its limit."""


def request_size_error(size: int, server_limit: int, channel_limit: int) -> PolicyError | None:
    """Why a request of ``size`` bytes cannot be sent (RESOURCE_EXHAUSTED), or None: over the server's limit
    (``GetInfo.max_request_bytes``; 0 = unknown) or this client's own ``max_message_bytes``. Sent anyway,
    gRPC itself would refuse it, ending a stream."""
    if server_limit and size > server_limit:
        return PolicyError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request: {size} bytes, over the server's limit of {server_limit} (GetInfo.max_request_bytes, "
            "derived from the robot spec it serves): send the cameras the spec names at its size, or as "
            "JPEG/PNG (image_format), or raise the server's --max-message-bytes",
        )
    if size > channel_limit:
        return PolicyError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request: {size} bytes, over this client's max_message_bytes ({channel_limit})",
        )
    return None


class ClientBase:
    """Settings, channel and request building of both clients; subclasses set ``_grpc`` (``grpc`` or
    ``grpc.aio``) and add the calls.

    ``address`` is one server (``host:port``) or several replicas (``a:1,b:2`` or ``dns:///name:port``, see
    :func:`channel_target`): calls are then spread over the replicas that are up and report SERVING, by
    gRPC's ``round_robin`` with health checking, and a call that fails UNAVAILABLE is retried (on the next
    replica) within its budget. ``tls_ca`` (PEM root certificate, path or bytes) connects over TLS;
    ``backoff=None`` turns retries off.
    """

    _grpc: Any = grpc

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
        target = channel_target(address)
        self.address = address
        self.target = target.target
        self.balanced = target.balanced
        self.timeout_s = timeout_s
        self.model_id = model_id
        self.image_format = image_format
        self.backoff = backoff
        self.retries = 0  # calls repeated after UNAVAILABLE (and streams reopened)
        self.max_message_bytes = max_message_bytes
        self._server_limit: int | None = None  # GetInfo.max_request_bytes, asked once a request is large
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        opts = channel_options(
            max_message_bytes, backoff, balanced=target.balanced, authority=target.authority
        )
        creds = channel_credentials(tls_ca)
        self._channel = (
            self._grpc.secure_channel(target.target, creds, options=opts)
            if creds is not None
            else self._grpc.insecure_channel(target.target, options=opts)
        )
        self._stub = pb_grpc.PolicyServiceStub(self._channel)
        # Act and StreamAct also take a request already serialised: a client serialises each request once,
        # for its size check and for the wire (a camera frame's bytes are not copied twice)
        method = f"/{pb.DESCRIPTOR.services_by_name['PolicyService'].full_name}/"
        self._stub.Act = self._channel.unary_unary(
            method + "Act", request_serializer=serialize, response_deserializer=pb.ActResponse.FromString
        )
        self._stub.StreamAct = self._channel.stream_stream(
            method + "StreamAct",
            request_serializer=serialize,
            response_deserializer=pb.ActResponse.FromString,
        )

    def _budget(self, timeout_s: float | None) -> RetryBudget:
        return RetryBudget(self.backoff, timeout_s or self.timeout_s)

    def _model(self, model_id: str | None) -> str:
        return self.model_id if model_id is None else model_id

    def _act_request(
        self,
        obs: Mapping[str, Any],
        seed: int | None,
        noise: np.ndarray | None,
        model_id: str | None,
        request_id: str | None,
        prefix: str,
        timeout_s: float | None = None,
        rtc: RTCInput | None = None,
    ) -> pb.ActRequest:
        """``build_request`` with this client's defaults; ``timeout_s`` (streams) goes along as the budget."""
        return build_request(
            obs,
            model_id=self._model(model_id),
            seed=seed,
            noise=noise,
            request_id=request_id if request_id is not None else f"{prefix}{next(_ids)}",
            image_format=self.image_format,
            timeout_ms=0 if timeout_s is None else max(1, int(timeout_s * 1000)),
            rtc=rtc,
        )

    def _size_error(
        self, req: pb.ActRequest | bytes, fetch_limit: Callable[[], int] | None
    ) -> PolicyError | None:
        """:func:`request_size_error` for ``req`` (a message or its serialised bytes); a large one first learns
        the server's limit through ``fetch_limit`` (once; None: the async client has already done so). A
        server that cannot be asked leaves it unknown (0), and is not asked again: the server's own refusal
        stays."""
        size = len(req) if isinstance(req, bytes) else req.ByteSize()
        if size <= SMALL_REQUEST_BYTES:
            return None
        if self._server_limit is None and fetch_limit is not None:
            self._server_limit = 0
            with contextlib.suppress(PolicyError):
                self._server_limit = fetch_limit()
        return request_size_error(size, self._server_limit or 0, self.max_message_bytes)

    def _load_request(
        self, ref: str, model_id: str | None, force: bool, stage_only: bool
    ) -> pb.LoadCheckpointRequest:
        return pb.LoadCheckpointRequest(
            model_id=self._model(model_id), ref=ref, force=force, stage_only=stage_only
        )

    def _health_check(self, service: str) -> tuple[Any, Any]:
        """The health service's ``Check`` method on this channel and its request for ``service``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        return health_pb2_grpc.HealthStub(self._channel).Check, health_pb2.HealthCheckRequest(service=service)

    @staticmethod
    def _health_name(resp: Any) -> str:
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

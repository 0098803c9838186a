"""Slim synchronous client for the policy server (numpy, grpcio, Pillow; no torch).

Every call has a deadline (``timeout_s``), because a robot blocked forever on a dead server is worse than
one that gets an error and stops safely (LeRobot #3979: ``Ready()`` without a deadline hangs). Errors come
back as :class:`PolicyError` with the gRPC status code and the server's message, which names the field.

When the server goes away (restart, rolling update) a call keeps retrying UNAVAILABLE with exponential
backoff and jitter (:class:`Backoff`) *within its deadline*, so a robot rides out a restart shorter than its
budget and gets an error, not a hang, for a longer one. Inference calls are safe to repeat (no state on the
server); control calls are never retried. The channel's own reconnect backoff is capped at the same maximum,
so a server that comes back is found within ``Backoff.max_s`` (gRPC's default cap is 120 s).

:mod:`vla_rl_client.aio_policy_client` is the asyncio twin (both build requests, parse replies and decide retries with
:mod:`vla_rl_client.policy_common`); :mod:`vla_rl_client.action_queue` turns chunks into a steady action stream for a
control loop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grpc
import numpy as np

from vla_rl_client.policy_common import (
    DEFAULT_BACKOFF,
    RETRYABLE,
    ActResult,
    Backoff,
    ClientBase,
    PolicyError,
    RetryBudget,
    RTCInfo,
    RTCInput,
    Timing,
    build_request,
    channel_credentials,
    channel_options,
    check_reply,
    parse_response,
)
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc

# the shared pieces are re-exported: ``from vla_rl_client.policy_client import Backoff, PolicyError, ...`` is the API
__all__ = [
    "DEFAULT_BACKOFF",
    "RETRYABLE",
    "ActResult",
    "ActStream",
    "Backoff",
    "PolicyClient",
    "PolicyError",
    "RTCInfo",
    "RTCInput",
    "Timing",
    "build_request",
    "channel_credentials",
    "channel_options",
]

T = TypeVar("T")


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
        *,
        rtc: RTCInput | None = None,
    ) -> ActResult:
        started = time.perf_counter_ns()
        timeout = self._client.timeout_s if timeout_s is None else timeout_s
        req = self._client._act_request(
            obs, seed, noise, self._model_id, None, "s", timeout_s=timeout, rtc=rtc
        )
        data = req.SerializeToString()
        self._client.check_size(data)  # an over-size request would end the stream
        budget = RetryBudget(self._client.backoff, timeout + self._MARGIN_S)
        with self._lock:
            while True:
                if self._broken is not None:
                    if self._closed:
                        raise self._broken
                    time.sleep(budget.delay_or_raise(self._broken))
                    self._call.cancel()
                    self._open()
                    self._broken = None
                    self.reopened += 1
                    self._client.retries += 1
                t0 = time.perf_counter_ns()
                self._requests.put(data)
                try:
                    reply = self._replies.get(timeout=budget.remaining(0.0))
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
        return check_reply(reply, req, t0, started)

    def close(self) -> None:
        self._closed = True
        self._requests.put(self._END)
        self._call.cancel()

    def __enter__(self) -> ActStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PolicyClient(ClientBase):
    """Blocking client: ``act`` for chunks, ``info`` for the served models, control calls with a token.

    ``tls_ca`` (PEM root certificate, path or bytes) connects over TLS; ``backoff=None`` turns retries off.
    """

    def act(
        self,
        obs: Mapping[str, Any],
        seed: int | None = None,
        *,
        noise: np.ndarray | None = None,
        model_id: str | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        rtc: RTCInput | None = None,
    ) -> ActResult:
        """One action chunk [H, A] for ``obs`` (seeded or explicit initial noise for reproducibility; ``rtc``:
        real-time chunking, a chunk that continues the queued actions). A request over the server's size
        limit raises :class:`PolicyError` (RESOURCE_EXHAUSTED) without being sent."""
        started = time.perf_counter_ns()
        data = self._act_request(obs, seed, noise, model_id, request_id, "u", rtc=rtc).SerializeToString()
        self.check_size(data)  # serialised once: for this check and for the wire
        return self.act_request(data, timeout_s, started_ns=started)

    def check_size(self, req: pb.ActRequest | bytes) -> None:
        """Raise :class:`PolicyError` (RESOURCE_EXHAUSTED) for a request (message or serialised bytes) the
        server would refuse for its size (``GetInfo.max_request_bytes``, asked once, when a request is first
        over 64 KiB)."""
        err = self._size_error(req, lambda: self.get_info(timeout_s=self.timeout_s).max_request_bytes)
        if err is not None:
            raise err

    def act_request(
        self, req: pb.ActRequest | bytes, timeout_s: float | None = None, *, started_ns: int | None = None
    ) -> ActResult:
        """Send a prepared ``ActRequest`` or its serialised bytes, unchecked (lets tests and tools send what
        ``build_request`` or the size check would refuse). ``started_ns``: when the caller began building it
        (``time.perf_counter_ns()``), so the reply's timing counts the encoding (``client_encode_us``,
        ``ttfa_us``)."""
        t0 = time.perf_counter_ns()
        resp = self._retrying(lambda t: self._stub.Act(req, timeout=t), timeout_s)
        return parse_response(resp, t0, t0 if started_ns is None else started_ns)

    def _retrying(self, call: Callable[[float], T], timeout_s: float | None) -> T:
        """``call(remaining_s)``, repeated after UNAVAILABLE with backoff until the deadline."""
        budget = self._budget(timeout_s)
        while True:
            try:
                return call(budget.remaining())
            except grpc.RpcError as e:
                err = PolicyError.from_rpc(e)
            time.sleep(budget.delay_or_raise(err))
            self.retries += 1

    def stream(self, model_id: str | None = None) -> ActStream:
        return ActStream(self._stub, self, self._model(model_id))

    def info(self, model_id: str = "", timeout_s: float | None = None) -> dict[str, pb.ModelInfo]:
        """Served models by id: commit, spec JSON, chunk length, n_exec, last load error, counters."""
        return {m.model_id: m for m in self.get_info(model_id, timeout_s).models}

    def get_info(self, model_id: str = "", timeout_s: float | None = None) -> pb.GetInfoResponse:
        """The whole GetInfo reply: every served model ("" = all) and the server's version."""
        req = pb.GetInfoRequest(model_id=model_id)
        return self._retrying(
            lambda t: self._stub.GetInfo(req, timeout=t, metadata=self._metadata), timeout_s
        )

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
        return self._call(
            self._stub.LoadCheckpoint, self._load_request(ref, model_id, force, stage_only), timeout_s
        )

    def promote(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        return self._call(self._stub.Promote, pb.ModelRequest(model_id=self._model(model_id)), timeout_s)

    def rollback(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        return self._call(self._stub.Rollback, pb.ModelRequest(model_id=self._model(model_id)), timeout_s)

    def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """The standard health service's status name for ``service`` ("" = the whole server)."""
        return self._health_name(self._call(*self._health_check(service), timeout_s))

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

"""asyncio client for the policy server (``grpc.aio``): the twin of :class:`server.client.PolicyClient`.

For robot stacks built on asyncio (ROS 2 executors, web dashboards, many simulated robots in one process):
nothing blocks the event loop, every call has a deadline, UNAVAILABLE is retried with the same
:class:`~server.client.Backoff` within that deadline, TLS and the control token work the same way.
Create it inside a running event loop (``async with AsyncPolicyClient(...) as c``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
import numpy as np

from server.client import (
    DEFAULT_BACKOFF,
    RETRYABLE,
    ActResult,
    Backoff,
    PolicyError,
    _result,
    build_request,
    channel_credentials,
    channel_options,
)
from server.proto import policy_service_pb2 as pb
from server.proto import policy_service_pb2_grpc as pb_grpc

__all__ = ["AsyncActStream", "AsyncPolicyClient"]

T = TypeVar("T")
_ids = itertools.count()


class AsyncActStream:
    """One robot's ``StreamAct`` stream on asyncio: ``await s.act(obs)`` -> its chunk, in order.

    Like :class:`server.client.ActStream`: a bad request raises but keeps the stream; a stream the server
    closes is reopened on the next ``act`` with backoff, within that call's budget.
    """

    _MARGIN_S = 1.0

    def __init__(self, client: AsyncPolicyClient, model_id: str) -> None:
        self._client = client
        self._model_id = model_id
        self._lock = asyncio.Lock()
        self._call: Any = None
        self.reopened = 0

    def _open(self) -> None:
        self._call = self._client._stub.StreamAct()

    async def act(
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
            request_id=f"a{next(_ids)}",
            image_format=self._client.image_format,
            timeout_ms=max(1, int(timeout * 1000)),
        )
        deadline = time.monotonic() + timeout + self._MARGIN_S
        backoff = self._client.backoff
        attempt = 0
        async with self._lock:
            while True:
                if self._call is None:
                    self._open()
                t0 = time.perf_counter_ns()
                try:
                    await asyncio.wait_for(self._call.write(req), max(0.001, deadline - time.monotonic()))
                    reply = await asyncio.wait_for(self._call.read(), max(0.001, deadline - time.monotonic()))
                except TimeoutError:
                    self._reset()  # a late reply could no longer be matched to its request
                    raise PolicyError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout + self._MARGIN_S:.1f} s"
                    ) from None
                except (grpc.RpcError, asyncio.InvalidStateError) as e:
                    err = (
                        PolicyError.from_rpc(e)
                        if isinstance(e, grpc.RpcError)
                        else PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed")
                    )
                    reply = err
                if reply is grpc.aio.EOF:
                    reply = PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed by the server")
                if isinstance(reply, PolicyError):
                    self._reset()
                    delay = backoff.delay(attempt) if backoff is not None else 0.0
                    if backoff is None or reply.code not in RETRYABLE or time.monotonic() + delay >= deadline:
                        raise reply
                    await asyncio.sleep(delay)
                    attempt += 1
                    self.reopened += 1
                    self._client.retries += 1
                    continue
                break
        if reply.request_id != req.request_id:
            raise PolicyError(
                grpc.StatusCode.INTERNAL, f"reply for {reply.request_id!r} to request {req.request_id!r}"
            )
        return _result(reply, t0)

    def _reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    async def close(self) -> None:
        if self._call is not None:
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
                await self._call.done_writing()
        self._reset()

    async def __aenter__(self) -> AsyncActStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncPolicyClient:
    """``await client.act(obs)`` and friends; see :class:`server.client.PolicyClient` for the semantics."""

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
        self.retries = 0
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        opts = channel_options(max_message_bytes, backoff)
        creds = channel_credentials(tls_ca)
        self._channel = (
            grpc.aio.secure_channel(address, creds, options=opts)
            if creds is not None
            else grpc.aio.insecure_channel(address, options=opts)
        )
        self._stub = pb_grpc.PolicyServiceStub(self._channel)

    async def _retrying(self, call: Callable[[float], Awaitable[T]], timeout_s: float | None) -> T:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        attempt = 0
        while True:
            try:
                return await call(max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                err = PolicyError.from_rpc(e)
            if self.backoff is None or err.code not in RETRYABLE:
                raise err
            delay = self.backoff.delay(attempt)
            if time.monotonic() + delay >= deadline:
                raise err
            await asyncio.sleep(delay)
            attempt += 1
            self.retries += 1

    async def act(
        self,
        obs: Mapping[str, Any],
        seed: int | None = None,
        *,
        noise: np.ndarray | None = None,
        model_id: str | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ActResult:
        req = build_request(
            obs,
            model_id=self.model_id if model_id is None else model_id,
            seed=seed,
            noise=noise,
            request_id=request_id if request_id is not None else f"ua{next(_ids)}",
            image_format=self.image_format,
        )
        return await self.act_request(req, timeout_s)

    async def act_request(self, req: pb.ActRequest, timeout_s: float | None = None) -> ActResult:
        t0 = time.perf_counter_ns()
        resp = await self._retrying(lambda t: self._stub.Act(req, timeout=t), timeout_s)
        return _result(resp, t0)

    def stream(self, model_id: str | None = None) -> AsyncActStream:
        return AsyncActStream(self, self.model_id if model_id is None else model_id)

    async def info(self, model_id: str = "", timeout_s: float | None = None) -> dict[str, pb.ModelInfo]:
        req = pb.GetInfoRequest(model_id=model_id)
        resp = await self._retrying(lambda t: self._stub.GetInfo(req, timeout=t), timeout_s)
        return {m.model_id: m for m in resp.models}

    async def load_checkpoint(
        self,
        ref: str,
        model_id: str | None = None,
        *,
        force: bool = False,
        stage_only: bool = False,
        timeout_s: float = 300.0,
    ) -> pb.LoadCheckpointResponse:
        req = pb.LoadCheckpointRequest(
            model_id=self.model_id if model_id is None else model_id,
            ref=ref,
            force=force,
            stage_only=stage_only,
        )
        return await self._call(self._stub.LoadCheckpoint, req, timeout_s)

    async def promote(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        req = pb.ModelRequest(model_id=self.model_id if model_id is None else model_id)
        return await self._call(self._stub.Promote, req, timeout_s)

    async def rollback(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        req = pb.ModelRequest(model_id=self.model_id if model_id is None else model_id)
        return await self._call(self._stub.Rollback, req, timeout_s)

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        resp = await self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def _call(self, method: Any, req: Any, timeout_s: float | None) -> Any:
        try:
            return await method(req, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise PolicyError.from_rpc(e) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

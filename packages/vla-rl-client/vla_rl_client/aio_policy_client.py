"""asyncio client for the policy server (``grpc.aio``): the twin of :class:`vla_rl_client.policy_client.PolicyClient`.

For robot stacks built on asyncio (ROS 2 executors, web dashboards, many simulated robots in one process):
nothing blocks the event loop, every call has a deadline, UNAVAILABLE is retried with the same
:class:`~vla_rl_client.policy_client.Backoff` within that deadline, TLS and the control token work the same way.
Create it inside a running event loop (``async with AsyncPolicyClient(...) as c``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np

from vla_rl_client.policy_common import (
    SMALL_REQUEST_BYTES,
    ActResult,
    ClientBase,
    PolicyError,
    RetryBudget,
    RTCInput,
    check_reply,
    parse_response,
)
from vla_rl_client.proto import policy_service_pb2 as pb

__all__ = ["AsyncActStream", "AsyncPolicyClient"]

T = TypeVar("T")


# grpc.aio reports a write to a stream the server has already ended (a replica that stopped or drained) as
# INTERNAL "Internal error from Core", overwriting the status the server sent (grpc/grpc#36066). It is the
# stream closing, not a server's answer: our server never sends that text.
_AIO_ENDED_STREAM = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def _stream_error(e: grpc.RpcError | asyncio.InvalidStateError) -> PolicyError:
    if not isinstance(e, grpc.RpcError):
        return PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed")
    err = PolicyError.from_rpc(e)
    if (err.code, err.message) == _AIO_ENDED_STREAM:
        return PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed by the server (write after its end)")
    return err


class AsyncActStream:
    """One robot's ``StreamAct`` stream on asyncio: ``await s.act(obs)`` -> its chunk, in order.

    Like :class:`vla_rl_client.policy_client.ActStream`: a bad request raises but keeps the stream; a stream the server
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
        *,
        rtc: RTCInput | None = None,
    ) -> ActResult:
        started = time.perf_counter_ns()
        timeout = self._client.timeout_s if timeout_s is None else timeout_s
        req = self._client._act_request(
            obs, seed, noise, self._model_id, None, "a", timeout_s=timeout, rtc=rtc
        )
        data = req.SerializeToString()  # once: for the size check and the wire
        await self._client.check_size(data)  # an over-size request would end the stream
        budget = RetryBudget(self._client.backoff, timeout + self._MARGIN_S)
        async with self._lock:
            while True:
                if self._call is None:
                    self._open()
                t0 = time.perf_counter_ns()
                try:
                    await asyncio.wait_for(self._call.write(data), budget.remaining())
                    reply = await asyncio.wait_for(self._call.read(), budget.remaining())
                except TimeoutError:
                    self._reset()  # a late reply could no longer be matched to its request
                    raise PolicyError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout + self._MARGIN_S:.1f} s"
                    ) from None
                except (grpc.RpcError, asyncio.InvalidStateError) as e:
                    reply = _stream_error(e)
                if reply is grpc.aio.EOF:
                    reply = PolicyError(grpc.StatusCode.UNAVAILABLE, "stream closed by the server")
                if isinstance(reply, PolicyError):
                    self._reset()
                    await asyncio.sleep(budget.delay_or_raise(reply))
                    self.reopened += 1
                    self._client.retries += 1
                    continue
                break
        return check_reply(reply, req, t0, started)

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


class AsyncPolicyClient(ClientBase):
    """``await client.act(obs)`` and friends; see :class:`vla_rl_client.policy_client.PolicyClient` for the semantics."""

    _grpc = grpc.aio

    async def _retrying(self, call: Callable[[float], Awaitable[T]], timeout_s: float | None) -> T:
        budget = self._budget(timeout_s)
        while True:
            try:
                return await call(budget.remaining())
            except grpc.RpcError as e:
                err = PolicyError.from_rpc(e)
            await asyncio.sleep(budget.delay_or_raise(err))
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
        rtc: RTCInput | None = None,
    ) -> ActResult:
        started = time.perf_counter_ns()
        data = self._act_request(obs, seed, noise, model_id, request_id, "ua", rtc=rtc).SerializeToString()
        await self.check_size(data)  # serialised once: for this check and for the wire
        return await self.act_request(data, timeout_s, started_ns=started)

    async def check_size(self, req: pb.ActRequest | bytes) -> None:
        """Raise :class:`PolicyError` (RESOURCE_EXHAUSTED) for a request (message or serialised bytes) the server
        would refuse for its size (see :meth:`vla_rl_client.policy_client.PolicyClient.check_size`)."""
        size = len(req) if isinstance(req, bytes) else req.ByteSize()
        if self._server_limit is None and size > SMALL_REQUEST_BYTES:
            self._server_limit = 0  # asked once (see ClientBase._size_error)
            with contextlib.suppress(PolicyError):
                self._server_limit = (await self.get_info(timeout_s=self.timeout_s)).max_request_bytes
        err = self._size_error(req, None)
        if err is not None:
            raise err

    async def act_request(
        self, req: pb.ActRequest | bytes, timeout_s: float | None = None, *, started_ns: int | None = None
    ) -> ActResult:
        """Send a prepared ``ActRequest`` or its bytes, unchecked (see ``PolicyClient.act_request``)."""
        t0 = time.perf_counter_ns()
        resp = await self._retrying(lambda t: self._stub.Act(req, timeout=t), timeout_s)
        return parse_response(resp, t0, t0 if started_ns is None else started_ns)

    def stream(self, model_id: str | None = None) -> AsyncActStream:
        return AsyncActStream(self, self._model(model_id))

    async def info(self, model_id: str = "", timeout_s: float | None = None) -> dict[str, pb.ModelInfo]:
        return {m.model_id: m for m in (await self.get_info(model_id, timeout_s)).models}

    async def get_info(self, model_id: str = "", timeout_s: float | None = None) -> pb.GetInfoResponse:
        """The whole GetInfo reply: every served model ("" = all) and the server's version."""
        req = pb.GetInfoRequest(model_id=model_id)
        return await self._retrying(
            lambda t: self._stub.GetInfo(req, timeout=t, metadata=self._metadata), timeout_s
        )

    async def load_checkpoint(
        self,
        ref: str,
        model_id: str | None = None,
        *,
        force: bool = False,
        stage_only: bool = False,
        timeout_s: float = 300.0,
    ) -> pb.LoadCheckpointResponse:
        return await self._call(
            self._stub.LoadCheckpoint, self._load_request(ref, model_id, force, stage_only), timeout_s
        )

    async def promote(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        return await self._call(
            self._stub.Promote, pb.ModelRequest(model_id=self._model(model_id)), timeout_s
        )

    async def rollback(self, model_id: str | None = None, timeout_s: float | None = None) -> pb.SwapResponse:
        return await self._call(
            self._stub.Rollback, pb.ModelRequest(model_id=self._model(model_id)), timeout_s
        )

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        return self._health_name(await self._call(*self._health_check(service), timeout_s))

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

"""The ``vla_rl.v1.PolicyService`` servicer: Act and StreamAct (decode, queue, await the batch), GetInfo and
the control calls (LoadCheckpoint, Promote, Rollback), registered with deserializers that never raise."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from vla_rl_client.codec import fill_tensor
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc
from vla_rl_client.spec import SpecError

from server.batching import _Pending
from server.config import ServerConfig
from server.guard import PeerSlots, decode_request
from server.slots import ModelSlot
from vla_rl.core.rpc import RateLimitedLog, RequestError, Undecodable, abort, stream_handler, unary_handler
from vla_rl.core.version import __version__

log = logging.getLogger("vla_rl.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PolicyService"].full_name


class PolicyHost(Protocol):
    """What the servicer needs of the server that hosts it (:class:`server.policy_server.PolicyServer`)."""

    config: ServerConfig
    slots: dict[str, ModelSlot]
    ratelog: RateLimitedLog
    peer_slots: PeerSlots
    max_request_bytes: int
    draining: bool
    control_pool: concurrent.futures.Executor
    load_pool: concurrent.futures.Executor

    def slot(self, model_id: str) -> ModelSlot: ...
    def only_model_id(self) -> str: ...
    def load(
        self,
        model_id: str,
        ref: str,
        *,
        force: bool = False,
        stage_only: bool = False,
        cancel: threading.Event | None = None,
    ) -> ModelSlot: ...
    def authorize(self, metadata: Any) -> None: ...
    def authorized(self, metadata: Any) -> bool: ...
    def model_info(self, s: ModelSlot, detailed: bool = False) -> pb.ModelInfo: ...
    def swap_response(self, s: ModelSlot) -> pb.SwapResponse: ...


class _Service(pb_grpc.PolicyServiceServicer):
    def __init__(self, server: PolicyHost) -> None:
        self.s = server

    # -- inference
    def _decode(self, req: pb.ActRequest, context: grpc.aio.ServicerContext) -> tuple[ModelSlot, _Pending]:
        slot = self.s.slot(req.model_id)
        item = decode_request(
            req,
            slot.active,
            self.s.config,
            time_remaining=context.time_remaining(),
            peer=context.peer() or "",
        )
        return slot, item

    def _refuse_undecodable(self, req: Undecodable, context: grpc.aio.ServicerContext) -> RequestError:
        peer = context.peer() or ""
        self.s.ratelog.warning(peer, "undecodable", "undecodable request", error=req.message)
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, req.message)

    def _served_lone(self, slot: ModelSlot, item: _Pending) -> bool:
        """Run ``item`` here, on the event loop, when it is the only robot the server is serving
        (:meth:`ModelSlot.serve_lone`, ``lone_inline_ms``); False = it goes to the batcher."""
        max_ms = self.s.config.lone_inline_ms
        if max_ms <= 0 or any(s.active_clients() for s in self.s.slots.values() if s is not slot):
            return False
        return slot.serve_lone(item, int(max_ms * 1000))

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
        if self._served_lone(slot, item):
            res = item.future.result()  # answered already (raises the RequestError it was refused with)
        else:
            slot.submit(item)
            try:
                res = await asyncio.wrap_future(item.future)
            except asyncio.CancelledError:
                item.future.cancel()
                raise
        resumed = time.perf_counter_ns()
        reply = pb.ActResponse(
            request_id=req.request_id,
            model_id=slot.model_id,
            commit=res.commit,
            batch_size=res.batch_size,
            seed=item.seed,
            explicit_noise=item.noise is not None,
            n_exec=res.n_exec,
        )
        fill_tensor(reply.actions, res.actions)
        if res.uncertainty_kind:  # unset = not available (the field is optional)
            reply.uncertainty = res.uncertainty
            reply.uncertainty_kind = res.uncertainty_kind
        if res.rtc is not None:  # unset = real-time chunking did not shape this chunk
            r, out = res.rtc, reply.rtc
            out.mode, out.inference_delay, out.queued = r.mode, r.delay, r.queued
            out.execution_horizon, out.max_guidance_weight = r.execution_horizon, r.max_guidance_weight
        if math.isfinite(res.failure):  # unset = no failure predictor served
            reply.failure, reply.failure_alarm = res.failure, res.failure_alarm
        done = time.perf_counter_ns()
        total_us = (done - t0) // 1000
        slot.latency.add(total_us / 1000.0)
        timing = reply.timing
        timing.queue_us, timing.decode_us, timing.inference_us = res.queue_us, decode_us, res.inference_us
        timing.total_us, timing.batch_us, timing.encode_us = total_us, res.batch_us, (done - resumed) // 1000
        timing.prefix_us, timing.denoise_us = res.prefix_us, res.denoise_us
        timing.wake_us = max(0, resumed - res.done_ns) // 1000 if res.done_ns else 0
        return reply

    async def Act(self, request: pb.ActRequest, context: grpc.aio.ServicerContext) -> pb.ActResponse:
        try:
            async with self.s.peer_slots.hold(context.peer() or ""):
                return await self._act(request, context)
        except RequestError as e:
            await abort(context, e)

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
        ends the stream (RESOURCE_EXHAUSTED), so it cannot take batch slots from robots that do read. Each
        request holds one of its connection's max_peer_in_flight slots until its reply is written, so a
        connection's streams that do not read stop being served together once their writes back up."""
        write_timeout = self.s.config.stream_write_timeout
        peer = context.peer() or ""
        async for req in request_iterator:
            async with self.s.peer_slots.hold(peer):
                reply = await self._stream_reply(req, context)
                try:
                    await asyncio.wait_for(context.write(reply), write_timeout)
                except TimeoutError:
                    self.s.ratelog.warning(peer, "slow-reader", "stream closed: replies not read")
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
            await abort(context, e)
        detailed = self.s.authorized(context.invocation_metadata())
        return pb.GetInfoResponse(
            models=[self.s.model_info(s, detailed=detailed) for s in slots],
            server_version=__version__,
            max_request_bytes=self.s.max_request_bytes,
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
                    f"load did not finish within load_timeout_s ({self.s.config.load_timeout:g} s); abandoned",
                ) from None
            except asyncio.CancelledError:
                cancel.set()
                raise
        except RequestError as e:
            await abort(context, e)

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
            request, context, work, pool=self.s.load_pool, timeout_s=self.s.config.load_timeout + 5.0
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
        "Act": unary_handler(service.Act, pb.ActRequest, pb.ActResponse),
        "StreamAct": stream_handler(service.StreamAct, pb.ActRequest, pb.ActResponse),
        "GetInfo": unary_handler(service.GetInfo, pb.GetInfoRequest, pb.GetInfoResponse),
        "LoadCheckpoint": unary_handler(
            service.LoadCheckpoint, pb.LoadCheckpointRequest, pb.LoadCheckpointResponse
        ),
        "Promote": unary_handler(service.Promote, pb.ModelRequest, pb.SwapResponse),
        "Rollback": unary_handler(service.Rollback, pb.ModelRequest, pb.SwapResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, rpc),))

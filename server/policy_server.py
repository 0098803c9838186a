"""gRPC policy server: dynamic batching across robots, several models, live checkpoint swaps.

Why it is built this way (what LeRobot's async server and openpi's server get wrong; their issues are
named where each point is made):

* **Every chunk answers its own observation.** A request becomes a :class:`_Pending` item holding its
  own future; the batcher resolves exactly that future with exactly that row of the batch. There is no
  shared "latest observation" slot.
* **Nothing blocks the event loop.** The service runs on ``grpc.aio``: streams cost no threads (LeRobot's
  4-thread pool starves at 16 clients), and the model runs in one batcher thread per model, whose result
  reaches the handler through a future. The one exception is a lone robot (``lone_inline_ms``): its
  request, a batch of one anyway, runs on the event loop and skips the two thread hand-offs, as long as
  the model's forward is short enough not to hold up anything else for long. Checkpoint loads run in
  another thread pool, so a reload never stalls inference (openpi #717).
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
* **Bounded by** the limits of :class:`~server.config.ServerConfig`. A checkpoint only opens its own
  regular files, each under ``max_file_mb``, and a load stops at ``load_timeout``; loads run in their
  own pool, so Promote/Rollback never wait behind them. The config's implied tensor shapes are checked
  against the safetensors header before anything is built. Requests are capped in size (derived from
  the robot spec, reported in GetInfo), in number (``max_concurrent_rpcs``, ``max_peer_queued``, and
  ``max_peer_in_flight`` per connection, replies not yet read included) and in values
  (``max_noise_abs``, ``max_state_abs``). Bytes that do not parse are INVALID_ARGUMENT naming the field,
  logged once per peer per ``log_interval``. When requests wait, the connections served least recently
  go first, and a stream reply the robot does not read within ``stream_write_timeout`` closes that
  stream. A non-finite chunk is an error reply and is never sent as actions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from vla_rl_client.proto import policy_service_pb2 as pb

from policies.loading import load_servable
from policies.rtc import RTCSettings
from server.batching import BatchQueue
from server.config import ServerConfig
from server.guard import MIN_DERIVED_MESSAGE_BYTES, PeerSlots, request_bytes_for
from server.service import SERVICE_NAME, _Service, add_service
from server.slots import ModelSlot, ServedVersion, spec_problems
from vla_rl.core.rpc import RateLimitedLog, RequestError, SigtermFlag, echo, require_bearer, wait_for_stop
from vla_rl.hub.checkpoint import CheckpointError, LoadLimits

log = logging.getLogger("vla_rl.server")


class _AnySet:
    """``is_set()`` of several events (a load's own cancel flag and the server's stop)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


# ----------------------------------------------------------------------------------------------- server
class PolicyServer:
    """Host one or more checkpoints behind the ``vla_rl.v1.PolicyService`` gRPC service, as ``config`` says.

    By default it serves ``config.checkpoint`` as ``config.model_id`` (following ``config.follow``).
    ``models`` (model id -> checkpoint reference, ``hub://org/name@rev`` or a folder) serves several
    instead; then ``follow`` maps model id -> a reference to poll every ``config.follow_interval`` seconds
    (often the same ref, e.g. ``...@prod``), and ``config``'s checkpoint, model id and follow are not used.
    A new commit at a followed ref is loaded and swapped in as LoadCheckpoint would. ``token`` enables
    the control calls (never part of the config: secrets are not saved with it). ``start()`` runs the
    server on a background thread (tests, embedding); :func:`serve` runs it in the foreground.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        models: Mapping[str, str | os.PathLike[str]] | None = None,
        follow: Mapping[str, str] | None = None,
        token: str | None = None,
    ) -> None:
        self.config = config
        if models is None:
            if follow is not None:
                raise ValueError("follow: a follow map goes with models=...; one model follows config.follow")
            models, follow = config.models(), config.follow_map()
        elif config.follow is not None:
            raise ValueError(
                f"follow: config.follow ({config.follow!r}) names no model of models=...; "
                "pass follow={id: ref}"
            )
        if not models:
            raise ValueError("PolicyServer needs at least one model (model id -> checkpoint reference)")
        unknown = set(follow or {}) - set(models)
        if unknown:
            raise ValueError(f"follow names model ids that are not served: {sorted(unknown)}")
        self.ratelog = RateLimitedLog(log, config.log_interval)
        self.peer_slots = PeerSlots(config.max_peer_in_flight)
        self.host, self.port = config.host, config.port  # port: the bound one once started
        self.tls: tuple[bytes, bytes] | None = None
        if config.tls_cert is not None and config.tls_key is not None:
            self.tls = (config.tls_key.read_bytes(), config.tls_cert.read_bytes())
        self.token = token
        self._message_limit: int | None = None  # set at start
        self.follow = dict(follow or {})
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.slots: dict[str, ModelSlot] = {}
        self._slots_lock = threading.Lock()
        # Promote/Rollback never wait behind a load: loads have their own pool, each bounded by load_timeout.
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
                grpc.StatusCode.NOT_FOUND,
                f"model_id: expected one of {sorted(self.slots)}, got {echo(model_id)}",
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
        Bounded by ``config.load_timeout`` (checked between file blocks) and ``config.max_file_mb``;
        ``cancel`` (or the server stopping) abandons it at the next check.
        """
        if not ref:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "ref: expected hub://org/name[@rev] or a folder"
            )
        slot = self.slots.get(model_id)
        lock = slot.load_lock if slot is not None else self._slots_lock
        if not lock.acquire(timeout=self.config.load_timeout):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"model {model_id!r}: another load is still running after load_timeout_s "
                f"({self.config.load_timeout:g} s); retry later",
            )
        try:
            limits = LoadLimits(
                max_file_bytes=self.config.max_file_bytes,
                deadline=time.monotonic() + self.config.load_timeout,
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
                    "checkpoint refused; still serving the previous one"
                    if slot is not None
                    else "checkpoint refused; nothing to serve",
                    extra={"model_id": model_id, "ref": ref, "error": e.message},
                )
                raise
            if slot is None:
                slot = ModelSlot(model_id, version, self._new_queue(model_id))
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

    def _new_queue(self, model_id: str) -> BatchQueue:
        """The batch queue of a newly served model id, bounded and paced as the config says."""
        c = self.config
        return BatchQueue(
            model_id,
            max_batch=c.max_batch,
            max_wait_us=c.max_wait_us,
            max_queue=c.max_queue,
            adaptive_wait=c.adaptive_wait,
            max_peer_queued=c.max_peer_queued,
        )

    def _load_version(
        self, ref: str, slot: ModelSlot | None, force: bool, limits: LoadLimits | None = None
    ) -> ServedVersion:
        try:
            version = ServedVersion(
                load_servable(ref, device=self.config.device, cache_dir=self.config.cache_dir, limits=limits)
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
        if version.rtc_mode:
            version.model.rtc_settings = RTCSettings(  # type: ignore[attr-defined]
                self.config.rtc_execution_horizon, self.config.rtc_max_guidance_weight
            )
        try:
            version.warm_up()
        except Exception as e:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint refused: warm-up failed: {e}"
            ) from None
        version.start_compiled(
            self.config.compile, self.config.max_batch
        )  # background; eager serves meanwhile
        return version

    def authorized(self, metadata: Any) -> bool:
        """Whether ``metadata`` carries the control token (never raises)."""
        try:
            self.authorize(metadata)
        except RequestError:
            return False
        return True

    def authorize(self, metadata: Any) -> None:
        """Raise UNAUTHENTICATED unless ``metadata`` carries the control token (none configured: never)."""
        if not self.token:
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED, "control calls are disabled: the server has no token"
            )
        require_bearer(metadata, self.token)

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
            max_batch=s.queue.max_batch,
            max_wait_us=s.queue.max_wait_us,
            max_queue=s.queue.max_queue,
            adaptive_wait=s.queue.adaptive_wait,
            active_clients=s.active_clients(),
            latency_p50_ms=p50,
            latency_p99_ms=p99,
            requests_per_s=rate,
            rtc_mode=v.rtc_mode,
            rtc_max_delay=v.rtc_max_delay,
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

        while not self._stop.wait(self.config.follow_interval):
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

    @property
    def max_request_bytes(self) -> int:
        """The largest request this server takes (GetInfo reports it; 0 before it started)."""
        return self._message_limit or 0

    def message_limit(self) -> int:
        """The receive limit: ``max_message_bytes`` if given, else what the served specs need."""
        if self.config.max_message_bytes is not None:
            return self.config.max_message_bytes
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
        self._aio = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
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


def serve(config: ServerConfig, *, token: str | None = None) -> None:
    """Serve ``config.checkpoint`` as ``config.model_id`` until interrupted (what ``vla-rl serve`` runs).

    The checkpoint is a vla-rl checkpoint or a LeRobot policy folder (picked by its ``config.json``).
    ``token`` enables the control calls (the CLI reads it from ``config.token_file`` or the environment).
    SIGTERM first drains for ``config.drain`` seconds (:meth:`PolicyServer.drain`: balanced clients move to
    the other replicas), then stops; Ctrl-C, or a second signal, stops at once.
    """
    server = PolicyServer(config, token=token)
    server.start()
    with SigtermFlag() as sigterm:
        drained = False
        try:
            drained = wait_for_stop(
                lambda: server._thread is not None and server._thread.is_alive(),
                sigterm,
                drain=server.drain,
                drain_s=config.drain,
                logger=log,
            )
            log.info("stopping policy server")
        finally:
            # Ctrl-C stops at once: calls in flight get a second, open streams are cancelled
            server.stop(grace_s=5.0 if drained else 1.0)

"""The collector's gRPC shell: the service's methods (:class:`_Service`), a stream's session, credential
checks (:func:`authorize`), refusals (:class:`RequestError`; :func:`undecodable_reject` for bytes that are
not a ``RobotMessage``), rate-limited logging of what peers get wrong, the event loop every collector of a
process shares, SIGTERM handling and the credential files.

Everything the collector needs of gRPC around its episode logic is here, in one module, so that it can
move to a shell shared with the policy server in one place."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import RobotSpec
from vla_rl_client.wire import WireTensor

from fleet.collector.config import _ID_RE
from fleet.wal import Unavailable, parse_message
from vla_rl.core.secrets import read_secret_file

log = logging.getLogger("vla_rl.collector")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Collector"].full_name
SC = grpc.StatusCode


class RequestError(Exception):
    """A message is refused (a ``Reject`` with this code; nothing of it is stored)."""

    def __init__(self, code: grpc.StatusCode, message: str, episode_id: str = "") -> None:
        self.code = code
        self.message = message
        self.episode_id = episode_id
        super().__init__(f"{code.name}: {message}")


@dataclass
class _Session:
    """One stream: the robot it announced."""

    robot_id: str = ""
    identity: str | None = None  # the robot its credential is bound to (None: the shared token)
    peer: str = ""
    task: str = ""
    spec: RobotSpec | None = None
    raw: bytes | None = None  # the message being handled, as received
    cameras: dict[str, WireTensor] | None = None  # its cameras, when parse_message split them off


class _RateLimitedLog:
    """A warning logged at most once per key (a peer) per interval, with how many were held back; no
    traceback (an attacker's garbage must not flood the log)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, **extra: Any) -> bool:
        now = time.monotonic()
        with self._lock:
            last, held = self._last.get(key, (-math.inf, 0))
            if now - last < self.interval_s:
                self._last[key] = (last, held + 1)
                return False
            if len(self._last) > 10_000:  # many peers: forget the old ones
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval_s}
            self._last[key] = (now, 0)
        log.warning(message, extra={**extra, "peer": key, "suppressed": held})
        return True


def _episode_of(msg: pb.RobotMessage) -> str:
    body = msg.WhichOneof("body")
    return getattr(msg, body).episode_id if body in ("start", "frames", "segment", "end") else ""


def authorize(metadata: Any, token: str | None, robot_tokens: Mapping[str, str]) -> str | None:
    """Check a call's ``authorization: Bearer <token>`` metadata: the robot id its credential is bound to
    (one of ``robot_tokens``), or None when it may speak as any robot (``token``, the shared credential,
    or no authentication configured). Anything else is a :class:`RequestError` (``UNAUTHENTICATED``)."""
    if not token and not robot_tokens:
        return None
    got = ""
    for key, value in metadata or ():
        if key == "authorization":
            got = value if isinstance(value, str) else value.decode()
    presented = got.encode()
    if token and hmac.compare_digest(presented, f"Bearer {token}".encode()):
        return None
    robot = None
    for rid, tok in robot_tokens.items():  # every entry compared: the time says nothing
        if hmac.compare_digest(presented, f"Bearer {tok}".encode()):
            robot = rid
    if robot is not None:
        return robot
    raise RequestError(
        SC.UNAUTHENTICATED,
        "authorization: expected metadata 'authorization: Bearer <token>'"
        + (", got a wrong token" if got else ", got none"),
    )


def undecodable_reject(e: BaseException, msg: pb.RobotMessage | None = None) -> pb.CollectorMessage:
    """The ``Reject`` (``INVALID_ARGUMENT``) of bytes that are not a ``RobotMessage`` (``msg`` None), or of
    a message whose content could not be decoded; it names the part and the error."""
    body = msg.WhichOneof("body") if msg is not None else None
    where = f"{body}" if body else "message"
    text = f"{where}: not a RobotMessage that can be decoded ({type(e).__name__}: {str(e)[:200]})"
    return pb.CollectorMessage(
        reject=pb.Reject(
            msg_id=msg.msg_id if msg is not None else 0,
            episode_id=_episode_of(msg) if msg is not None else "",
            code=SC.INVALID_ARGUMENT.value[0],
            message=text,
        )
    )


class _Handler(Protocol):
    """What the service calls on its collector."""

    def authorize(self, metadata: Any) -> str | None: ...

    def handle(
        self,
        session: _Session,
        msg: pb.RobotMessage,
        raw: bytes | None = None,
        cameras: dict[str, WireTensor] | None = None,
    ) -> pb.CollectorMessage: ...

    def undecodable(
        self, session: _Session, e: BaseException, msg: pb.RobotMessage | None = None
    ) -> pb.CollectorMessage: ...

    async def wait_for_room(self, context: grpc.aio.ServicerContext) -> None: ...

    def stats(self, only: str | None = None) -> pb.StatsResponse: ...

    def disconnected(self, session: _Session) -> None: ...


class _Service:
    """The gRPC methods. ``Stream`` takes raw bytes (no request deserializer) so the log can keep them."""

    def __init__(self, c: _Handler) -> None:
        self.c = c

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.Stream,
                    request_deserializer=None,
                    response_serializer=pb.CollectorMessage.SerializeToString,
                ),
                "GetStats": grpc.unary_unary_rpc_method_handler(
                    self.GetStats,
                    request_deserializer=pb.StatsRequest.FromString,
                    response_serializer=pb.StatsResponse.SerializeToString,
                ),
            },
        )

    async def Stream(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CollectorMessage]:
        try:
            identity = self.c.authorize(context.invocation_metadata())
        except RequestError as e:
            await context.abort(e.code, e.message)
        session = _Session(identity=identity, peer=context.peer() or "")
        try:
            async for raw in request_iterator:
                await self.c.wait_for_room(context)
                try:
                    msg, cams = parse_message(raw)
                except Exception as e:  # protobuf's DecodeError; never crash a stream on bytes
                    yield self.c.undecodable(session, e)
                    continue
                try:
                    if msg.WhichOneof("body") == "start":
                        # Creating an episode (Zarr arrays, commit record) takes ~50 ms of file work;
                        # on the event loop, a fleet whose episodes start together stalled every
                        # robot's acks for seconds. A thread keeps the other streams flowing (starts
                        # are serialised by Collector._start_lock; the rest of handle is thread-safe).
                        reply = await asyncio.to_thread(self.c.handle, session, msg, raw, cams)
                    else:
                        reply = self.c.handle(session, msg, raw, cams)
                except (ValueError, TypeError, OverflowError, UnicodeError, IndexError) as e:
                    # Bytes that parse but that nothing above expected: a Reject, not a dead stream.
                    reply = self.c.undecodable(session, e, msg)
                except Unavailable as e:
                    log.error("cannot make a message durable; ending the stream", extra={"error": str(e)})
                    await context.abort(
                        SC.UNAVAILABLE, f"collector cannot write now ({e}); reconnect and resend"
                    )
                yield reply
        finally:
            self.c.disconnected(session)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        try:
            identity = self.c.authorize(context.invocation_metadata())
        except RequestError as e:
            await context.abort(e.code, e.message)
        return self.c.stats(only=identity)


@functools.cache
def _aio_loop() -> asyncio.AbstractEventLoop:
    """The event loop of every collector in this process (grpc.aio binds itself to one loop; never closed)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="collector-grpc", daemon=True).start()
    return loop


os.register_at_fork(after_in_child=_aio_loop.cache_clear)  # the loop's thread does not survive a fork


class _AioServer:
    """The aio server, stopped from any thread: ``stop(grace).wait()`` as with a ``grpc.Server``."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    def stop(self, grace: float | None) -> _Stopping:
        return _Stopping(asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop))


class _Stopping:
    def __init__(self, fut: concurrent.futures.Future[None]) -> None:
        self.fut = fut

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The shared collector token kept in a file (see :func:`vla_rl.core.secrets.read_secret_file`)."""
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise ValueError(f"token_file: {e}") from None


def load_robot_tokens(path: str | os.PathLike[str]) -> dict[str, str]:
    """Per-robot credentials: a JSON object ``{"robot_id": "token"}`` or lines ``robot_id: token``
    (``#`` comments and blank lines ignored). Each token must be unique: it is the robot's identity."""
    text = Path(path).read_text()
    out: dict[str, str] = {}
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"robot_tokens_file: {path}: expected a JSON object robot id -> token")
        out = {str(k): v.strip() for k, v in data.items()}
    else:
        for i, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            rid, sep, tok = line.partition(":")
            if not sep or not rid.strip() or not tok.strip():
                raise ValueError(f"robot_tokens_file: {path}:{i}: expected 'robot_id: token'")
            if rid.strip() in out:
                raise ValueError(f"robot_tokens_file: {path}:{i}: robot {rid.strip()!r} listed twice")
            out[rid.strip()] = tok.strip()
    for rid, tok in out.items():
        if not _ID_RE.match(rid) or len(tok) < 16:
            raise ValueError(
                f"robot_tokens_file: {path}: robot {rid!r}: expected an id {_ID_RE.pattern} and a token "
                "of at least 16 characters"
            )
    if len(set(out.values())) != len(out):
        raise ValueError(f"robot_tokens_file: {path}: two robots share a token")
    return out


def stop_on_sigterm() -> threading.Event:
    """An event that SIGTERM sets (instead of killing the process), so a service drains when stopped."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def wait_for(stop: threading.Event) -> None:
    """Block until ``stop`` is set or Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt):
        while not stop.wait(0.2):
            pass

"""The collector's gRPC service on the shell it shares with the policy server (:mod:`vla_rl.core.rpc`): the
service's methods (:class:`_Service`), a stream's session, credential checks (:func:`authorize`), refusals
(:class:`RequestError`, which adds the episode; :func:`undecodable_reject` for bytes that are not a
``RobotMessage``), the event loop every collector of a process shares, and the credential files.

Status errors, rate-limited warnings, requests that do not parse, bearer tokens and SIGTERM are the
shared module's; what is here is what only the collector has (robot credentials, episode ids, raw bytes
kept for the log)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import threading
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
from vla_rl.core import rpc
from vla_rl.core.secrets import read_secret_file

log = logging.getLogger("vla_rl.collector")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Collector"].full_name
SC = grpc.StatusCode


class RequestError(rpc.RequestError):
    """A message is refused (a ``Reject`` with this code; nothing of it is stored); ``episode_id``: the
    episode the ``Reject`` names when the message itself does not (a collector-made refusal)."""

    def __init__(self, code: grpc.StatusCode, message: str, episode_id: str = "") -> None:
        super().__init__(code, message)
        self.episode_id = episode_id


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


def _episode_of(msg: pb.RobotMessage) -> str:
    body = msg.WhichOneof("body")
    return getattr(msg, body).episode_id if body in ("start", "frames", "segment", "end") else ""


def authorize(metadata: Any, token: str | None, robot_tokens: Mapping[str, str]) -> str | None:
    """Check a call's ``authorization: Bearer <token>`` metadata: the robot id its credential is bound to
    (one of ``robot_tokens``), or None when it may speak as any robot (``token``, the shared credential,
    or no authentication configured). Anything else raises :func:`vla_rl.core.rpc.unauthenticated`."""
    if not token and not robot_tokens:
        return None
    got = rpc.bearer_credential(metadata)
    if token and rpc.bearer_matches(got, token):
        return None
    robot = None
    for rid, tok in robot_tokens.items():  # every entry compared: the time says nothing
        if rpc.bearer_matches(got, tok):
            robot = rid
    if robot is not None:
        return robot
    raise rpc.unauthenticated(got)


def undecodable_reject(
    e: BaseException, msg: pb.RobotMessage | None = None, raw: bytes | None = None
) -> pb.CollectorMessage:
    """The ``Reject`` (``INVALID_ARGUMENT``) of bytes that are not a ``RobotMessage`` (``msg`` None), or of
    a message whose content could not be decoded; it names the part and the error, and for bytes that
    did not parse (``raw``) the first broken field when :func:`vla_rl.core.rpc.bad_field` finds it."""
    body = msg.WhichOneof("body") if msg is not None else None
    where = f"{body}" if body else "message"
    broken = rpc.bad_field(raw, pb.RobotMessage.DESCRIPTOR) if msg is None and raw is not None else None
    at = f"broken at {broken}; " if broken else ""
    text = f"{where}: not a RobotMessage that can be decoded ({at}{type(e).__name__}: {str(e)[:200]})"
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
        self,
        session: _Session,
        e: BaseException,
        msg: pb.RobotMessage | None = None,
        raw: bytes | None = None,
    ) -> pb.CollectorMessage: ...

    def undecodable_request(
        self, peer: str, identity: str | None, request: rpc.Undecodable
    ) -> rpc.RequestError: ...

    async def wait_for_room(self, context: grpc.aio.ServicerContext) -> None: ...

    def stats(self, only: str | None = None) -> pb.StatsResponse: ...

    def request_help(self, ask: pb.HelpAsk, identity: str | None) -> pb.HelpState: ...

    def get_help(self, query: pb.HelpQuery, identity: str | None) -> pb.HelpState: ...

    def claim_help(self, claim: pb.HelpClaim, identity: str | None) -> pb.HelpState: ...

    def resolve_help(self, done: pb.HelpResolve, identity: str | None) -> pb.HelpState: ...

    def disconnected(self, session: _Session) -> None: ...


class _Service:
    """The gRPC methods. ``Stream`` takes raw bytes (no request deserializer) so the log can keep them;
    ``GetStats`` gets an :class:`~vla_rl.core.rpc.Undecodable` for bytes that are not a ``StatsRequest``."""

    def __init__(self, c: _Handler) -> None:
        self.c = c

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Stream": rpc.stream_handler(self.Stream, None, pb.CollectorMessage),
                "GetStats": rpc.unary_handler(self.GetStats, pb.StatsRequest, pb.StatsResponse),
                "RequestHelp": rpc.unary_handler(self.RequestHelp, pb.HelpAsk, pb.HelpState),
                "GetHelp": rpc.unary_handler(self.GetHelp, pb.HelpQuery, pb.HelpState),
                "ClaimHelp": rpc.unary_handler(self.ClaimHelp, pb.HelpClaim, pb.HelpState),
                "ResolveHelp": rpc.unary_handler(self.ResolveHelp, pb.HelpResolve, pb.HelpState),
            },
        )

    async def Stream(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CollectorMessage]:
        try:
            identity = self.c.authorize(context.invocation_metadata())
        except rpc.RequestError as e:
            await rpc.abort(context, e)
        session = _Session(identity=identity, peer=context.peer() or "")
        try:
            async for raw in request_iterator:
                await self.c.wait_for_room(context)
                try:
                    msg, cams = parse_message(raw)
                except Exception as e:  # protobuf's DecodeError; never crash a stream on bytes
                    yield self.c.undecodable(session, e, raw=raw)
                    continue
                try:
                    if msg.WhichOneof("body") == "start":
                        # Creating an episode (Zarr arrays, commit record) is file work; on the event
                        # loop, a fleet whose episodes start together stalled every robot's acks for
                        # seconds (docs/store.md, Write-path costs behind the design). A thread keeps
                        # the other streams flowing (starts are serialised by Collector._start_lock;
                        # the rest of handle is thread-safe).
                        reply = await asyncio.to_thread(self.c.handle, session, msg, raw, cams)
                    else:
                        reply = self.c.handle(session, msg, raw, cams)
                except (ValueError, TypeError, OverflowError, UnicodeError, IndexError) as e:
                    # Bytes that parse but that nothing above expected: a Reject, not a dead stream.
                    reply = self.c.undecodable(session, e, msg)
                except Unavailable as e:
                    log.error("cannot make a message durable; ending the stream", extra={"error": str(e)})
                    await rpc.abort(
                        context,
                        rpc.RequestError(
                            SC.UNAVAILABLE, f"collector cannot write now ({e}); reconnect and resend"
                        ),
                    )
                yield reply
        finally:
            self.c.disconnected(session)

    async def GetStats(
        self, request: pb.StatsRequest | rpc.Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        """The counters the caller's credential may see. The credential is checked first: a caller without
        one learns nothing of its request, and cannot fill the log with it."""
        try:
            identity = self.c.authorize(context.invocation_metadata())
            if isinstance(request, rpc.Undecodable):
                raise self.c.undecodable_request(context.peer() or "", identity, request)
        except rpc.RequestError as e:
            await rpc.abort(context, e)
        return self.c.stats(only=identity)

    async def RequestHelp(
        self, request: pb.HelpAsk | rpc.Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.HelpState:
        """Open a help request (:mod:`fleet.collector.help`); the DB write runs off the event loop."""
        return await self._help(self.c.request_help, request, context)

    async def GetHelp(
        self, request: pb.HelpQuery | rpc.Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.HelpState:
        """Poll (or withdraw) a help request."""
        return await self._help(self.c.get_help, request, context)

    async def ClaimHelp(
        self, request: pb.HelpClaim | rpc.Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.HelpState:
        """An operator takes a help request (the shared credential only)."""
        return await self._help(self.c.claim_help, request, context)

    async def ResolveHelp(
        self, request: pb.HelpResolve | rpc.Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.HelpState:
        """The operator who claimed a help request closes it (the shared credential only)."""
        return await self._help(self.c.resolve_help, request, context)

    async def _help(self, fn: Any, request: Any, context: grpc.aio.ServicerContext) -> pb.HelpState:
        try:
            identity = self.c.authorize(context.invocation_metadata())
            if isinstance(request, rpc.Undecodable):
                raise self.c.undecodable_request(context.peer() or "", identity, request)
            return await asyncio.to_thread(fn, request, identity)
        except rpc.RequestError as e:
            await rpc.abort(context, e)


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
        if not _ID_RE.fullmatch(rid) or len(tok) < 16:
            raise ValueError(
                f"robot_tokens_file: {path}: robot {rid!r}: expected an id {_ID_RE.pattern} and a token "
                "of at least 16 characters"
            )
    if len(set(out.values())) != len(out):
        raise ValueError(f"robot_tokens_file: {path}: two robots share a token")
    return out

"""The policy server's local transport (``--local-socket``): ``ActRequest`` / ``ActResponse`` frames on a Unix
domain socket, served on the server's event loop without gRPC, for robots on the server's host.

The protocol (:mod:`vla_rl_client.local_client` is its client): each side first sends
:data:`~vla_rl_client.local_client.MAGIC`; then every request is a 4-byte little-endian length and a
serialised ``ActRequest``, answered in order by a frame holding its ``ActResponse``. Each request goes
through the handler a gRPC ``StreamAct`` request goes through (:meth:`server.service._Service._stream_reply`):
the same decoding and checks, model routing, lone-robot path and batching, timing fields, and an error
reply (never a dropped connection) for a request it refuses. The server's greeting carries the largest
request it takes, so a client refuses a larger one before sending it. What this adds is bounded like gRPC
is: a frame over that limit is answered RESOURCE_EXHAUSTED and the connection closed (its bytes are not
read), at most ``max_concurrent_rpcs`` connections are served (the next one's first request is answered
RESOURCE_EXHAUSTED and it is closed), a connection holds one of its ``max_peer_in_flight`` slots per request, a reply the robot
does not read within ``stream_write_timeout`` closes the connection, and a client that does not greet
within :data:`GREETING_TIMEOUT_S` or greets wrongly is closed (logged at a bounded rate). Only inference
travels here; the calls that need the control token stay on gRPC. The socket lies under the rules of
:mod:`server.unix_socket` (a folder of the server's own, mode 0600).

Each connection is an :class:`asyncio.BufferedProtocol`: the socket is read straight into the
connection's buffer and a complete request is parsed from it in place; it is answered in a task started
eagerly, so a request the lone-robot path answers at once goes from the socket to its reply without a
trip through the event loop's queue. Reading pauses while a request is answered (one at a time, in
order, as on a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from pathlib import Path

import grpc
from vla_rl_client.local_client import HEADER, MAGIC
from vla_rl_client.proto import policy_service_pb2 as pb

from server.service import PolicyHost, _Service
from server.unix_socket import restrict_socket
from vla_rl.core.rpc import safe_deserializer

log = logging.getLogger("vla_rl.server")

GREETING_TIMEOUT_S = 5.0
"""How long a new connection may take to send :data:`MAGIC`."""
_MIN_BUFFER = 64 * 1024
_parse = safe_deserializer(pb.ActRequest)


class _FrameContext:
    """What the policy handler asks of a gRPC call's context, for a request that came as a frame: the
    connection it came on; no call deadline (the request's ``timeout_ms`` bounds it, as on a stream)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[()]:
        return ()


class LocalTransport:
    """Serve ``host``'s policy service as frames on the socket at ``path`` (absolute, checked by
    :func:`server.unix_socket.prepare_socket_path`).

    Everything here runs on the server's event loop: :meth:`start` binds the loop, :meth:`stop` must be
    awaited on it (it raises elsewhere), and it returns only once every connection is closed and every
    request's task has ended, so no transport, task or future of this transport outlives the loop
    (asyncio's objects are not thread-safe; one touched from another thread, or after its loop closed,
    can corrupt the interpreter)."""

    def __init__(self, host: PolicyHost, path: Path) -> None:
        self.host = host
        self.path = path
        self.service = _Service(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.stopping = False
        self._ids = itertools.count()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_unix_server(
            lambda: _Connection(self, f"local:{next(self._ids)}"), path=str(self.path)
        )
        restrict_socket(self.path)

    async def stop(self, grace_s: float) -> None:
        """Take no more connections and end the open ones: an idle one at once, one answering a request
        after its reply (up to ``grace_s``, then cancelled); every request's task awaited, every
        connection closed (aborted if its replies are not read); the socket removed."""
        if self._server is None:
            return
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("LocalTransport.stop: call it on the server's event loop")
        self.stopping = True
        self._server.close()
        for conn in list(self._connections):
            if not conn.busy:
                conn.close()
        tasks = [c.task for c in self._connections if c.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self._connections):
            conn.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), grace_s)
        except TimeoutError:  # replies nobody reads hold their connections open: dropped
            for conn in list(self._connections):
                conn.abort()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None
        self.path.unlink(missing_ok=True)

    @property
    def max_connections(self) -> int:
        return self.host.config.max_concurrent_rpcs

    def connected(self, conn: _Connection) -> None:
        self._connections.add(conn)

    def disconnected(self, conn: _Connection) -> None:
        self._connections.discard(conn)

    @property
    def connections(self) -> int:
        return len(self._connections)


class _Connection(asyncio.BufferedProtocol):
    """One robot's connection (see the module's docstring): the greeting, then requests answered one at a
    time; ``busy`` while one is being answered, ``task`` its task while it waits (for the batcher, say)."""

    def __init__(self, owner: LocalTransport, peer: str) -> None:
        self.owner = owner
        self.host = owner.host
        self.peer = peer
        self.busy = False
        self.task: asyncio.Task[None] | None = None
        self._ctx = _FrameContext(peer)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()  # protocols are made on the loop, by create_unix_server
        self._buf = bytearray(_MIN_BUFFER)
        self._filled = 0
        self._greeted = False
        self._crowded = False
        self._closed = False
        self._greeting_timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the transport's write buffer is full

    # -- asyncio's protocol calls
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self.owner.stopping:  # accepted just before the listening socket closed
            self.close()
            return
        self.owner.connected(self)
        self._greeting_timer = self._loop.call_later(GREETING_TIMEOUT_S, self._refuse_greeting)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._filled == len(self._buf):  # never an empty buffer: asyncio would take it for the end
            self._grow(self._filled + _MIN_BUFFER)
        return memoryview(self._buf)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self._next()

    def eof_received(self) -> bool:
        return False  # the robot went away: close

    def pause_writing(self) -> None:
        self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._greeting_timer is not None:
            self._greeting_timer.cancel()
        self.resume_writing()
        self.owner.disconnected(self)

    # -- the connection's own
    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.abort()

    def _grow(self, size: int) -> None:
        """A larger buffer holding what this one holds (a new one: the transport may still hold a view)."""
        grown = bytearray(size)
        grown[: self._filled] = memoryview(self._buf)[: self._filled]
        self._buf = grown

    def _consume(self, n: int) -> None:
        """Drop the first ``n`` bytes of the buffer (what follows them, usually nothing, moves up)."""
        rest = self._filled - n
        if rest:
            self._buf[:rest] = self._buf[n : self._filled]
        self._filled = rest

    def _next(self) -> None:
        """Act on what the buffer holds: the greeting, then the next complete request (none while one is
        being answered: reading is paused then)."""
        if self._closed or self.busy:
            return
        if not self._greeted and not self._greet():
            return
        if self._filled < HEADER.size:
            return
        (size,) = HEADER.unpack_from(self._buf)
        limit = self.host.max_request_bytes
        if size > limit:  # its bytes are not read: answered, and the connection closed
            self._last_word(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {size} bytes, over the server's limit of {limit} (GetInfo.max_request_bytes); "
                "connection closed",
            )
            return
        end = HEADER.size + size
        if self._filled < end:
            if len(self._buf) < end:  # grown as the bytes come
                self._grow(min(end, max(2 * len(self._buf), self._filled + _MIN_BUFFER)))
            return
        req = _parse(memoryview(self._buf)[HEADER.size : end])  # parsed into its own memory
        self._consume(end)
        if self._crowded:
            self._last_word(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.owner.max_connections} local connections are open (max_concurrent_rpcs); retry later",
            )
            return
        assert self._transport is not None
        self._transport.pause_reading()  # one request at a time, answered in order
        self.busy = True
        task = asyncio.Task(
            self._answer(req), loop=self._loop, eager_start=True
        )  # runs here up to its first wait
        self.task = None if task.done() else task

    def _greet(self) -> bool:
        """The client's greeting checked (closed if wrong), ours sent back with the largest request this
        server takes; False = not greeted (yet)."""
        n = len(MAGIC)
        if self._buf[: min(n, self._filled)] != MAGIC[: self._filled]:
            self._refuse_greeting()
            return False
        if self._filled < n:
            return False
        self._consume(n)
        self._greeted = True
        if self._greeting_timer is not None:
            self._greeting_timer.cancel()
        self._crowded = self.owner.connections > self.owner.max_connections
        assert self._transport is not None
        self._transport.write(MAGIC + HEADER.pack(self.host.max_request_bytes))
        return True

    def _refuse_greeting(self) -> None:
        if self._greeted or self._closed:
            return
        self.host.ratelog.warning(
            "local", "bad-greeting", "local socket: closed a client that does not speak the frame protocol"
        )
        self.close()

    def _last_word(self, code: grpc.StatusCode, message: str) -> None:
        """An error reply with no request id (the request was not, or not all, read), then closed (once
        the reply is written)."""
        reply = pb.ActResponse(error=pb.ActError(code=code.value[0], message=message)).SerializeToString()
        assert self._transport is not None
        self._transport.write(HEADER.pack(len(reply)) + reply)
        self.close()

    async def _answer(self, req: pb.ActRequest) -> None:
        """Answer ``req``; then read on, unless the reply was not read in time or the server drains or stops
        (the robot reconnects, to a replica that is serving)."""
        transport = self._transport
        assert transport is not None
        try:
            async with self.host.peer_slots.hold(self.peer):
                reply = (await self.owner.service._stream_reply(req, self._ctx)).SerializeToString()  # type: ignore[arg-type]
                transport.write(HEADER.pack(len(reply)) + reply)
                if self._writable is not None and not await self._written():
                    return
        except Exception:  # a bug here costs this connection, never the server
            self.host.ratelog.warning(self.peer, "local-error", "local request failed", exc_info=True)
            self.abort()
            return
        finally:
            self.busy = False
            self.task = None
        if self.host.draining or self.owner.stopping:
            self.close()
        elif not self._closed:
            transport.resume_reading()
            if self._filled:  # a request that came before this reply went out
                self._loop.call_soon(self._next)

    async def _written(self) -> bool:
        """Wait for the robot to read the replies (up to ``stream_write_timeout``); False = it did not: the
        connection is closed."""
        assert self._writable is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._writable), self.host.config.stream_write_timeout)
            return True
        except TimeoutError:
            self.host.ratelog.warning(self.peer, "slow-reader", "local connection closed: replies not read")
            self.abort()
            return False

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


class _Connection:
    """One robot's connection: its writer, and whether a request of it is being answered (``stop()`` lets
    that one finish; an idle connection is closed at once)."""

    __slots__ = ("busy", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.busy = False


class LocalTransport:
    """Serve ``host``'s policy service as frames on the socket at ``path`` (absolute, checked by
    :func:`server.unix_socket.prepare_socket_path`).

    Everything here runs on the server's event loop: :meth:`start` binds the loop, :meth:`stop` must be
    awaited on it (it raises elsewhere), and it returns only once every connection's task has ended, so no
    stream, transport or future of this transport outlives the loop (asyncio's objects are not thread-safe;
    one touched from another thread, or after its loop closed, can corrupt the interpreter)."""

    def __init__(self, host: PolicyHost, path: Path) -> None:
        self.host = host
        self.path = path
        self.service = _Service(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._stopping = False
        self._ids = itertools.count()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_unix_server(self._connection, path=str(self.path))
        restrict_socket(self.path)

    async def stop(self, grace_s: float) -> None:
        """Take no more connections and end the open ones: an idle one at once, one answering a request
        after its reply (up to ``grace_s``, then cancelled); every connection task awaited; the socket
        removed."""
        if self._server is None:
            return
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("LocalTransport.stop: call it on the server's event loop")
        self._stopping = True
        self._server.close()
        for task, conn in list(self._connections.items()):
            if not conn.busy:
                task.cancel()
        tasks = list(self._connections)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), grace_s)
        self._server = None
        self.path.unlink(missing_ok=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._stopping:  # accepted just before the listening socket closed
            writer.close()
            return
        conn = _Connection(writer)
        self._connections[task] = conn
        peer = f"local:{next(self._ids)}"
        try:
            if await self._greeted(reader, writer):
                crowded = len(self._connections) > self._max_connections
                await self._serve(reader, conn, peer, crowded=crowded)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the robot went away
        finally:
            del self._connections[task]
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @property
    def _max_connections(self) -> int:
        return self.host.config.max_concurrent_rpcs

    async def _greeted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The client's greeting checked, ours sent back with the largest request this server takes."""
        try:
            greeting = await asyncio.wait_for(reader.readexactly(len(MAGIC)), GREETING_TIMEOUT_S)
        except TimeoutError:
            greeting = b""
        if greeting != MAGIC:
            self.host.ratelog.warning(
                "local",
                "bad-greeting",
                "local socket: closed a client that does not speak the frame protocol",
            )
            return False
        writer.write(MAGIC + HEADER.pack(self.host.max_request_bytes))
        return True

    async def _serve(
        self, reader: asyncio.StreamReader, conn: _Connection, peer: str, *, crowded: bool
    ) -> None:
        """Requests in order, one at a time, until the robot goes away, a frame is too large, a reply is not
        read in time or the server drains or stops; ``crowded`` (too many connections): the first request is
        answered RESOURCE_EXHAUSTED and the connection closed."""
        ctx = _FrameContext(peer)
        writer = conn.writer
        write_timeout = self.host.config.stream_write_timeout
        while True:
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            conn.busy = True
            limit = self.host.max_request_bytes
            if size > limit:  # its bytes are not read: answered, and the connection closed
                await self._last_word(
                    writer,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request: {size} bytes, over the server's limit of {limit} (GetInfo.max_request_bytes); "
                    "connection closed",
                )
                return
            req = _parse(await reader.readexactly(size))
            if crowded:
                await self._last_word(
                    writer,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._max_connections} local connections are open (max_concurrent_rpcs); retry later",
                )
                return
            async with self.host.peer_slots.hold(peer):
                reply = (await self.service._stream_reply(req, ctx)).SerializeToString()  # type: ignore[arg-type]
                writer.write(HEADER.pack(len(reply)) + reply)
                try:
                    await asyncio.wait_for(writer.drain(), write_timeout)
                except TimeoutError:
                    self.host.ratelog.warning(
                        peer, "slow-reader", "local connection closed: replies not read"
                    )
                    return
            conn.busy = False
            # answered; the robot reconnects (to a replica that is serving)
            if self.host.draining or self._stopping:
                return

    @staticmethod
    async def _last_word(writer: asyncio.StreamWriter, code: grpc.StatusCode, message: str) -> None:
        """An error reply with no request id (the request was not, or not all, read); the caller closes."""
        reply = pb.ActResponse(error=pb.ActError(code=code.value[0], message=message)).SerializeToString()
        writer.write(HEADER.pack(len(reply)) + reply)
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(writer.drain(), 1.0)

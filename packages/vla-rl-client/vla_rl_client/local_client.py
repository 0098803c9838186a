"""Client of the policy server's local transport (``vla-rl serve --local-socket PATH``): action chunks for a
robot on the server's host without gRPC.

The policy service's own messages travel as frames on a Unix domain socket: after a greeting
(:data:`MAGIC` each way, the server's followed by the largest request it takes, as a frame header), every
request is a 4-byte little-endian length and a serialised ``ActRequest``,
and every reply the same with an ``ActResponse``, in order. The server answers them on its event loop with
the same handler as a gRPC stream (the same checks, model routing, batching and timing fields). What is
gone is gRPC's machinery on both ends (its C core, completion-queue threads, HTTP/2), where a request
spent most of its time between the two processes. Only inference travels this way; ``GetInfo``, health
and the control calls (with their token) stay on gRPC.

Like :class:`~vla_rl_client.policy_client.ActStream`: every call has a deadline, a request the server
refuses raises :class:`PolicyError` naming the field and the connection stays open, a connection the
server closes (restart) is reopened with backoff within the call's budget and the request sent again,
and a reply that does not come in time closes the connection (a late reply could no longer be matched).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from vla_rl_client.policy_common import (
    DEFAULT_BACKOFF,
    ActResult,
    Backoff,
    PolicyError,
    RetryBudget,
    RTCInput,
    build_request,
    check_reply,
    parse_response,
)
from vla_rl_client.proto import policy_service_pb2 as pb

__all__ = ["HEADER", "MAGIC", "LocalPolicyClient"]

MAGIC = b"vla-rl-frames/1\n"
"""The greeting each side sends first: the protocol and its version."""
HEADER = struct.Struct("<I")
"""A frame's header: the length of the serialised message that follows."""

_ids = itertools.count()


class LocalPolicyClient:
    """Blocking client of a server's local socket: ``act(obs)`` -> :class:`ActResult`, one request at a time
    (calls from several threads take turns). ``path``: the socket (``--local-socket``), as a path or
    ``unix://`` + path. ``max_message_bytes`` bounds a request and a reply; ``backoff=None`` turns the
    reconnecting off."""

    _MARGIN_S = 1.0

    def __init__(
        self,
        path: str | os.PathLike[str],
        timeout_s: float = 5.0,
        *,
        model_id: str = "",
        image_format: str = "raw",
        max_message_bytes: int = 64 * 1024 * 1024,
        backoff: Backoff | None = DEFAULT_BACKOFF,
    ) -> None:
        text = os.fspath(path)
        self.path = Path(text.removeprefix("unix://"))
        self.timeout_s = timeout_s
        self.model_id = model_id
        self.image_format = image_format
        self.max_message_bytes = max_message_bytes
        self.backoff = backoff
        self.retries = 0  # connections reopened after the server closed one
        self._sock: socket.socket | None = None
        self._server_limit = 0  # the largest request the server takes (its greeting); 0 = not yet known
        self._lock = threading.Lock()

    def act(
        self,
        obs: Mapping[str, Any],
        seed: int | None = None,
        *,
        noise: np.ndarray | None = None,
        model_id: str | None = None,
        timeout_s: float | None = None,
        rtc: RTCInput | None = None,
    ) -> ActResult:
        """One action chunk [H, A] for ``obs``, as :meth:`PolicyClient.act` gives it."""
        started = time.perf_counter_ns()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        req = build_request(
            obs,
            model_id=self.model_id if model_id is None else model_id,
            seed=seed,
            noise=noise,
            request_id=f"l{next(_ids)}",
            image_format=self.image_format,
            timeout_ms=max(1, int(timeout * 1000)),
            rtc=rtc,
        )
        return self.act_request(req, timeout, started_ns=started)

    def act_request(
        self, req: pb.ActRequest, timeout_s: float | None = None, *, started_ns: int | None = None
    ) -> ActResult:
        """Send a prepared ``ActRequest`` (see :meth:`act`); ``started_ns`` as in ``PolicyClient.act_request``."""
        data = req.SerializeToString()
        if len(data) > self.max_message_bytes:
            raise PolicyError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {len(data)} bytes, over this client's max_message_bytes ({self.max_message_bytes})",
            )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        budget = RetryBudget(self.backoff, timeout + self._MARGIN_S)
        with self._lock:
            while True:
                try:
                    t0 = time.perf_counter_ns()
                    reply = self._exchange(data, budget)
                    break
                except PolicyError as err:
                    self._drop()
                    time.sleep(budget.delay_or_raise(err))  # UNAVAILABLE within the budget: reconnect
                    self.retries += 1
        if reply.HasField("error") and not reply.request_id:  # refused before it was read (its size)
            return parse_response(reply, t0, started_ns)
        return check_reply(reply, req, t0, started_ns)

    def _exchange(self, data: bytes, budget: RetryBudget) -> pb.ActResponse:
        """Send one request frame and read its reply (connecting first if need be)."""
        try:
            sock = self._connected(budget)
            if len(data) > self._server_limit:
                raise PolicyError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request: {len(data)} bytes, over the server's limit of {self._server_limit} (derived from "
                    "the robot spec it serves): send the cameras the spec names at its size, or as JPEG/PNG "
                    "(image_format), or raise the server's --max-message-bytes",
                )
            sock.settimeout(budget.remaining())
            _send(sock, HEADER.pack(len(data)), data)
            (size,) = HEADER.unpack(_recv(sock, HEADER.size))
            if size > self.max_message_bytes:
                raise PolicyError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"reply: {size} bytes, over this client's max_message_bytes ({self.max_message_bytes})",
                )
            return pb.ActResponse.FromString(_recv(sock, size))
        except TimeoutError:
            self._drop()  # a late reply could no longer be matched to its request
            raise PolicyError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply from {self.path} within the deadline"
            ) from None
        except (ConnectionError, FileNotFoundError, OSError) as e:
            raise PolicyError(
                grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e.strerror or e}"
            ) from None

    def _connected(self, budget: RetryBudget) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(budget.remaining())
            sock.connect(str(self.path))  # no server there (yet): OSError, UNAVAILABLE in _exchange
            sock.sendall(MAGIC)
            greeting = _recv(sock, len(MAGIC))
            if greeting == MAGIC:
                (self._server_limit,) = HEADER.unpack(_recv(sock, HEADER.size))
        except ConnectionError as e:
            sock.close()
            if isinstance(e, ConnectionRefusedError):
                raise
            raise PolicyError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"local socket {self.path}: closed at the greeting; not a policy server's --local-socket "
                "(a gRPC --unix-socket takes PolicyClient('unix://...') instead)",
            ) from None
        except BaseException:
            sock.close()
            raise
        if greeting != MAGIC:
            sock.close()
            raise PolicyError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"local socket {self.path}: not a policy server's --local-socket (greeted with {greeting[:16]!r})",
            )
        self._sock = sock
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> LocalPolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _send(sock: socket.socket, header: bytes, data: bytes) -> None:
    """The header and ``data`` in one system call when the socket takes them at once (``data`` not copied)."""
    sent = sock.sendmsg([header, data])
    if sent < len(header):
        sock.sendall(header[sent:])
        sock.sendall(data)
    elif sent < len(header) + len(data):
        sock.sendall(memoryview(data)[sent - len(header) :])


def _recv(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the server closed the connection")
        got += k
    return bytes(buf)

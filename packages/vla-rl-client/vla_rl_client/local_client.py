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
A raw camera's pixels go from the caller's array to the socket without a copy (:func:`raw_camera_parts`),
and a reply is read into one buffer the client keeps.
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

from vla_rl_client.codec import WIRE_DTYPES
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

__all__ = ["HEADER", "MAGIC", "LocalPolicyClient", "raw_camera_parts"]

MAGIC = b"vla-rl-frames/1\n"
"""The greeting each side sends first: the protocol and its version."""
HEADER = struct.Struct("<I")
"""A frame's header: the length of the serialised message that follows."""

_ids = itertools.count()
_LEN = 2  # the wire type of a length-delimited field (bytes, string, message)
_OBSERVATION = pb.ActRequest.DESCRIPTOR.fields_by_name["observation"].number
_CAMERAS = pb.Observation.DESCRIPTOR.fields_by_name["cameras"].number
_IMAGE_RAW = pb.Image.DESCRIPTOR.fields_by_name["raw"].number
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_REPLY_BUFFER = 64 * 1024


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
        self._buf = bytearray(_REPLY_BUFFER)  # a reply frame is read into it (grown for a larger one)

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
        cameras = dict(obs.get("cameras") or {})
        raw = cameras if self.image_format == "raw" else {}
        req = build_request(  # all but the raw cameras, whose pixels are sent from the caller's arrays
            {**obs, "cameras": {k: v for k, v in cameras.items() if k not in raw}},
            model_id=self.model_id if model_id is None else model_id,
            seed=seed,
            noise=noise,
            request_id=f"l{next(_ids)}",
            image_format=self.image_format,
            timeout_ms=max(1, int(timeout * 1000)),
            rtc=rtc,
        )
        parts = [req.SerializeToString(), *raw_camera_parts(raw)]
        return self._send(parts, req.request_id, timeout, started)

    def act_request(
        self, req: pb.ActRequest, timeout_s: float | None = None, *, started_ns: int | None = None
    ) -> ActResult:
        """Send a prepared ``ActRequest`` (see :meth:`act`); ``started_ns`` as in ``PolicyClient.act_request``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self._send([req.SerializeToString()], req.request_id, timeout, started_ns)

    def _send(
        self, parts: list[bytes | memoryview], request_id: str, timeout: float, started_ns: int | None
    ) -> ActResult:
        """Send the request whose serialised bytes are ``parts`` joined; its reply as an :class:`ActResult`."""
        size = sum(len(p) for p in parts)
        if size > self.max_message_bytes:
            raise PolicyError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {size} bytes, over this client's max_message_bytes ({self.max_message_bytes})",
            )
        budget = RetryBudget(self.backoff, timeout + self._MARGIN_S)
        with self._lock:
            while True:
                try:
                    t0 = time.perf_counter_ns()
                    reply = self._exchange(parts, size, budget)
                    break
                except PolicyError as err:
                    self._drop()
                    time.sleep(budget.delay_or_raise(err))  # UNAVAILABLE within the budget: reconnect
                    self.retries += 1
        if reply.HasField("error") and not reply.request_id:  # refused before it was read (its size)
            return parse_response(reply, t0, started_ns)
        return check_reply(reply, pb.ActRequest(request_id=request_id), t0, started_ns)

    def _exchange(self, parts: list[bytes | memoryview], size: int, budget: RetryBudget) -> pb.ActResponse:
        """Send one request frame (``size`` bytes in ``parts``) and read its reply (connecting first if need
        be)."""
        try:
            sock = self._connected(budget)
            if size > self._server_limit:
                raise PolicyError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request: {size} bytes, over the server's limit of {self._server_limit} (derived from "
                    "the robot spec it serves): send the cameras the spec names at its size, or as JPEG/PNG "
                    "(image_format), or raise the server's --max-message-bytes",
                )
            sock.settimeout(budget.remaining())
            _send_all(sock, [HEADER.pack(size), *parts])
            return pb.ActResponse.FromString(self._reply(sock))
        except TimeoutError:
            self._drop()  # a late reply could no longer be matched to its request
            raise PolicyError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply from {self.path} within the deadline"
            ) from None
        except (ConnectionError, FileNotFoundError, OSError) as e:
            raise PolicyError(
                grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e.strerror or e}"
            ) from None

    def _reply(self, sock: socket.socket) -> memoryview:
        """The next reply frame's message, read into this client's buffer (valid until the next read)."""
        got = _recv_into(sock, self._buf, 0, HEADER.size)
        (size,) = HEADER.unpack_from(self._buf)
        if size > self.max_message_bytes:
            raise PolicyError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"reply: {size} bytes, over this client's max_message_bytes ({self.max_message_bytes})",
            )
        end = HEADER.size + size
        if len(self._buf) < end:
            self._buf = self._buf[:got] + bytearray(end - got)
        _recv_into(sock, self._buf, got, end)
        return memoryview(self._buf)[HEADER.size : end]

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


def raw_camera_parts(cameras: Mapping[str, Any]) -> list[bytes | memoryview]:
    """The wire bytes of an ``ActRequest`` holding only ``observation.cameras`` (each a RAW image, as
    ``build_request(..., image_format="raw")`` writes it), the pixels as views of the arrays (not copied).

    Appended to another serialised ``ActRequest``, they merge into its observation (protobuf merges a
    message field that comes twice): the bytes parse to the request ``build_request`` would build."""
    parts: list[bytes | memoryview] = []
    for name, image in cameras.items():
        arr = np.asarray(image)
        if arr.dtype.name not in WIRE_DTYPES:
            raise TypeError(f"dtype {arr.dtype} cannot travel on the wire; use one of {sorted(WIRE_DTYPES)}")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        pixels = memoryview(arr).cast("B")
        tensor = pb.Tensor(dtype=arr.dtype.name, shape=arr.shape).SerializeToString()
        tensor += _key(_TENSOR_DATA) + _varint(len(pixels))
        image_head = _key(_IMAGE_RAW) + _varint(len(tensor) + len(pixels)) + tensor
        key = name.encode()
        entry_head = _key(1) + _varint(len(key)) + key + _key(2) + _varint(len(image_head) + len(pixels))
        entry_size = len(entry_head) + len(image_head) + len(pixels)
        head = _key(_CAMERAS) + _varint(entry_size)
        observation = _key(_OBSERVATION) + _varint(len(head) + entry_size)
        parts += [observation + head + entry_head + image_head, pixels]
    return parts


def _key(field: int) -> bytes:
    """A length-delimited field's key."""
    return _varint(field << 3 | _LEN)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """``parts`` in as few system calls as the socket allows (none of them copied)."""
    views = [memoryview(p) for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views:
            views[0] = views[0][sent:]


def _recv_into(sock: socket.socket, buf: bytearray, got: int, n: int) -> int:
    """Read into ``buf`` (holding ``got`` bytes) until it holds at least ``n``; how many it holds then.
    ConnectionError when the peer closes first."""
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the server closed the connection")
        got += k
    return got


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

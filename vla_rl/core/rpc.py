"""The shell our gRPC services share (the policy server, the fleet collector): errors that carry a status,
warnings about one peer's bad calls at a bounded rate, bytes that do not parse answered instead of
raised, bearer-token checks, and SIGTERM turned into a drain.

* :class:`RequestError` is how a handler refuses a call: a status code and a message that names the
  field. :func:`abort` ends a unary call with it; :func:`echo` quotes a client's value in it, cut short.
* :class:`RateLimitedLog` logs at most one warning per (peer, kind) per interval, with how many it held
  back: a flood of garbage from one peer costs a line per interval, not a traceback per call.
* :func:`safe_deserializer` turns bytes that are not a valid request into :class:`Undecodable` (naming
  the first broken field, found by :func:`bad_field`), so the handler answers INVALID_ARGUMENT instead
  of grpc answering UNKNOWN with a logged traceback. :func:`unary_handler` / :func:`stream_handler`
  register methods with it.
* :func:`bearer_credential`, :func:`bearer_matches` and :func:`require_bearer` check
  ``authorization: Bearer <token>`` metadata in constant time; :func:`unauthenticated` is the refusal.
* :class:`SigtermFlag` makes SIGTERM (``docker stop``, Kubernetes, systemd) a flag the main thread
  polls instead of a kill; :func:`wait_for_stop` blocks until a stop is asked and drains first on
  SIGTERM.

Imports only grpc, protobuf and the standard library.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor import FieldDescriptor as FD

log = logging.getLogger("vla_rl.rpc")


# ----------------------------------------------------------------------------------------------- errors
class RequestError(Exception):
    """A call (or one message of a stream) refused with a gRPC status; ``message`` names the field when it
    can. A service may subclass it to carry more (the collector's episode id)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


MAX_DETAILS_CHARS = 2000
"""The longest status message a call ends with: it travels in trailing metadata (8 KiB in all by default)."""


async def abort(context: grpc.aio.ServicerContext, error: RequestError) -> NoReturn:
    """End the call with ``error``'s status and message, cut to :data:`MAX_DETAILS_CHARS` (``context.abort``
    raises; this says so to types)."""
    message = error.message
    if len(message) > MAX_DETAILS_CHARS:
        message = message[: MAX_DETAILS_CHARS - 40] + f"... ({len(message)} characters)"
    await context.abort(error.code, message)
    raise AssertionError("unreachable")  # pragma: no cover


ECHO_CHARS = 64
"""The most of a client's value an error message quotes back (the rest is counted, not echoed)."""


def echo(value: str, limit: int = ECHO_CHARS) -> str:
    """``value`` as an error message quotes it (``repr``), cut to ``limit`` characters with how long it was: a
    refusal names what it refused without handing back megabytes (a reply's message travels in gRPC's
    trailing metadata, whose limit a long echo exceeds, and ends up in logs)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class RateLimitedLog:
    """At most one warning per (peer, kind) per ``interval_s`` on ``logger``; the next one says how many
    were suppressed (``extra``: peer, kind, suppressed, and the caller's fields).

    A flood of garbage from one peer costs one log line per interval, not a traceback per call. At most
    :attr:`MAX_KEYS` keys are remembered: past that, keys quiet for an interval are forgotten.
    """

    MAX_KEYS = 10_000

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not interval_s >= 0:
            raise ValueError(f"interval_s: expected seconds >= 0, got {interval_s!r}")
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, peer: str, kind: str, msg: str, *, exc_info: bool = False, **extra: Any) -> bool:
        """Log ``msg`` unless (``peer``, ``kind``) logged within the interval; returns whether it logged."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get((peer, kind), (-float("inf"), 0))
            if now - last < self.interval_s:
                self._last[(peer, kind)] = (last, suppressed + 1)
                return False
            if len(self._last) >= self.MAX_KEYS:
                cutoff = now - self.interval_s
                self._last = {k: v for k, v in self._last.items() if v[0] >= cutoff}
            self._last[(peer, kind)] = (now, 0)
        self.logger.warning(
            msg, exc_info=exc_info, extra={"peer": peer, "kind": kind, "suppressed": suppressed, **extra}
        )
        return True


# ----------------------------------------------------------------------------------------------- bytes
@dataclass(frozen=True)
class Undecodable:
    """What :func:`safe_deserializer` returns for bytes that are not a valid request message (instead of
    raising, which grpc answers UNKNOWN with a logged traceback)."""

    type_name: str
    field: str
    size: int

    @property
    def message(self) -> str:
        return f"{self.field}: the request is not a valid {self.type_name} protobuf ({self.size} bytes)"


def read_varint(data: bytes | memoryview, pos: int, end: int | None = None) -> tuple[int, int]:
    """The protobuf varint at ``data[pos:]`` and the position after it; ValueError when it runs past ``end``
    (default: the end of ``data``) or beyond 64 bits."""
    end = len(data) if end is None else end
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


MAX_FIELDS_WALKED = 10_000  # fields bad_field reads at most, nested ones included


def bad_field(
    data: bytes, desc: Descriptor, prefix: str = "", depth: int = 0, *, max_fields: int = MAX_FIELDS_WALKED
) -> str | None:
    """The dotted name of the first field whose wire encoding is broken in ``data`` (None if none is
    found): walks the protobuf wire format with the message descriptor, never allocating more than
    ``data``. Nested messages are entered up to 8 deep; strings must be UTF-8.

    At most ``max_fields`` fields are read (nested ones included), then it gives up (None): the walk runs
    in Python on the server's event loop, and a request of millions of tiny fields with a broken tail,
    sent by anyone (deserializing comes before any token check), must cost a bounded time, not seconds.
    """
    left = max_fields

    def walk(data: bytes, desc: Descriptor, prefix: str, depth: int) -> str | None:
        nonlocal left
        i, n = 0, len(data)
        while i < n:
            left -= 1
            if left < 0:
                return None
            try:
                key, i = read_varint(data, i)
            except ValueError:
                return prefix.rstrip(".") or "request"
            num, wire = key >> 3, key & 7
            f = desc.fields_by_number.get(num)
            name = prefix + (f.name if f is not None else f"field {num}")
            try:
                if wire == 0:
                    _, i = read_varint(data, i)
                elif wire == 1:
                    i += 8
                elif wire == 5:
                    i += 4
                elif wire == 2:
                    length, i = read_varint(data, i)
                    chunk = data[i : i + length]
                    i += length
                    if i > n:
                        return name
                    if f is not None and f.type == FD.TYPE_MESSAGE and depth < 8:
                        inner = walk(chunk, f.message_type, name + ".", depth + 1)
                        if inner is not None:
                            return inner
                    elif f is not None and f.type == FD.TYPE_STRING:
                        chunk.decode("utf-8")
                else:
                    return name
            except (ValueError, UnicodeDecodeError):
                return name
            if i > n:
                return name
        return None

    return walk(data, desc, prefix, depth)


def safe_deserializer(cls: Any) -> Callable[[bytes], Any]:
    """A request deserializer for the message class ``cls`` that returns :class:`Undecodable` (naming the
    broken field) instead of raising on bytes that do not parse."""

    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception:
            where = bad_field(data, cls.DESCRIPTOR) or "request"
            return Undecodable(cls.DESCRIPTOR.full_name, where, len(data))

    return deserialize


def unary_handler(fn: Callable[..., Any], request: Any | None, response: Any) -> grpc.RpcMethodHandler:
    """A unary-unary method: requests parsed as ``request`` by :func:`safe_deserializer` (None: the raw
    bytes), replies serialised as ``response``."""
    return grpc.unary_unary_rpc_method_handler(
        fn, _deserializer(request), response_serializer=response.SerializeToString
    )


def stream_handler(fn: Callable[..., Any], request: Any | None, response: Any) -> grpc.RpcMethodHandler:
    """A stream-stream method, with requests and replies as in :func:`unary_handler`."""
    return grpc.stream_stream_rpc_method_handler(
        fn, _deserializer(request), response_serializer=response.SerializeToString
    )


def _deserializer(request: Any | None) -> Callable[[bytes], Any] | None:
    return None if request is None else safe_deserializer(request)


# ----------------------------------------------------------------------------------------------- tokens
def bearer_credential(metadata: Any) -> str:
    """The ``authorization`` value of a call's invocation metadata ("" when there is none)."""
    got = ""
    for key, value in metadata or ():
        if key == "authorization":
            got = value if isinstance(value, str) else value.decode()
    return got


def bearer_matches(presented: str, token: str) -> bool:
    """Whether ``presented`` is ``Bearer <token>``, compared in constant time (the time says nothing)."""
    return hmac.compare_digest(presented.encode(), f"Bearer {token}".encode())


def unauthenticated(presented: str) -> RequestError:
    """The refusal of a call whose credential ``presented`` matched no token."""
    return RequestError(
        grpc.StatusCode.UNAUTHENTICATED,
        "authorization: expected metadata 'authorization: Bearer <token>'"
        + (", got a wrong token" if presented else ", got none"),
    )


def require_bearer(metadata: Any, token: str) -> None:
    """Raise :func:`unauthenticated` unless ``metadata`` carries ``authorization: Bearer <token>``."""
    got = bearer_credential(metadata)
    if not bearer_matches(got, token):
        raise unauthenticated(got)


# ----------------------------------------------------------------------------------------------- stopping
class SigtermFlag:
    """While entered, SIGTERM (``docker stop``, Kubernetes, systemd) only counts itself in :attr:`count`:
    the main thread polls it (:func:`wait_for_stop`) and stops in order instead of being killed. The
    handler touches no lock, so a signal can never deadlock the thread it interrupts. Off the main thread
    (where signals cannot be handled) entering it does nothing. The previous handler is restored on exit.
    """

    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self.count > 0

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __enter__(self) -> SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


def wait_for_stop(
    alive: Callable[[], bool],
    sigterm: SigtermFlag,
    *,
    drain: Callable[[], None] | None = None,
    drain_s: float = 0.0,
    poll_s: float = 0.2,
    logger: logging.Logger = log,
) -> bool:
    """Block while ``alive()`` and no stop was asked; returns whether a drain ran its whole course.

    Ctrl-C returns at once. SIGTERM (counted by ``sigterm``), when ``drain`` is given and ``drain_s`` > 0,
    first calls ``drain()`` (e.g. health NOT_SERVING, so balanced clients move to other replicas) and
    waits ``drain_s`` seconds; a second SIGTERM or Ctrl-C cuts the drain short. The caller stops its
    service afterwards, more gently when this returns True.
    """
    try:
        while alive() and not sigterm.requested:
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return False
    if not sigterm.requested or drain is None or drain_s <= 0:
        return False
    logger.info("stop requested: draining first", extra={"drain_s": drain_s})
    seen = sigterm.count
    try:
        drain()
        deadline = time.monotonic() + drain_s
        while (left := deadline - time.monotonic()) > 0:
            if sigterm.count > seen:
                raise KeyboardInterrupt
            time.sleep(min(poll_s, left))
    except KeyboardInterrupt:
        logger.info("second stop request: stopping now")
        return False
    return True

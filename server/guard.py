"""What a request may be: its size (derived from the robot spec), the server's limits, bytes that do not
parse (:class:`Undecodable`, :func:`bad_field`) and the rate-limited warnings about them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from vla_rl_client.spec import RobotSpec

from vla_rl.hub.checkpoint import DEFAULT_MAX_FILE_BYTES

log = logging.getLogger("vla_rl.server")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # only an upper bound now: the default is derived from the spec
MIN_DERIVED_MESSAGE_BYTES = 1024 * 1024  # headroom for a later checkpoint with a slightly larger spec
MESSAGE_SLACK_BYTES = 64 * 1024  # on top of the spec's pixels, state and noise: ids, instruction, framing
MAX_INSTRUCTION_CHARS = 2000
MAX_REQUEST_ID_CHARS = 200
DEFAULT_LOAD_TIMEOUT_S = 600.0
DEFAULT_MAX_CONCURRENT_RPCS = 256
DEFAULT_MAX_PEER_QUEUED = 64
DEFAULT_STREAM_WRITE_TIMEOUT_S = 10.0
DEFAULT_MAX_NOISE_ABS = 10.0
DEFAULT_MAX_STATE_ABS = 1e6
DEFAULT_LOG_INTERVAL_S = 10.0


class RequestError(Exception):
    """A request (or control call) failed with a gRPC status; ``message`` names the field when it can."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


@dataclass(frozen=True)
class ServerLimits:
    """What one client (or one checkpoint) can make the server do; every error names the field."""

    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # one checkpoint load, then it is abandoned
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # one checkpoint file
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS  # calls + open streams; more: RESOURCE_EXHAUSTED
    max_peer_queued: int = DEFAULT_MAX_PEER_QUEUED  # requests one connection may have waiting
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S  # an unread reply ends its stream
    max_noise_abs: float = DEFAULT_MAX_NOISE_ABS  # |explicit initial noise|
    max_state_abs: float = DEFAULT_MAX_STATE_ABS  # |observation.state|
    log_interval_s: float = DEFAULT_LOG_INTERVAL_S  # one warning per peer and kind per interval

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")


def request_bytes_for(spec: RobotSpec, noise_shape: tuple[int, int] | None) -> int:
    """The largest ActRequest a robot with ``spec`` needs to send: every camera raw (or encoded, up to 2x
    raw for incompressible JPEG/PNG), the state, explicit noise, plus :data:`MESSAGE_SLACK_BYTES`."""
    pixels = sum(c.height * c.width * 3 for c in spec.cameras)
    noise = 4 * noise_shape[0] * noise_shape[1] if noise_shape else 0
    return 2 * pixels + 4 * spec.state_dim + noise + MESSAGE_SLACK_BYTES


class RateLimitedLog:
    """At most one warning per (peer, kind) per ``interval_s``; the next one says how many were suppressed.

    A flood of garbage from one peer costs one log line per interval, not a traceback per call.
    """

    MAX_KEYS = 10_000

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, peer: str, kind: str, msg: str, *, exc_info: bool = False, **extra: Any) -> bool:
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
        log.warning(
            msg, exc_info=exc_info, extra={"peer": peer, "kind": kind, "suppressed": suppressed, **extra}
        )
        return True


@dataclass(frozen=True)
class Undecodable:
    """What the server's deserializers return for bytes that are not a valid request message (instead of
    raising, which grpc answers UNKNOWN with a logged traceback)."""

    type_name: str
    field: str
    size: int

    @property
    def message(self) -> str:
        return f"{self.field}: the request is not a valid {self.type_name} protobuf ({self.size} bytes)"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def bad_field(data: bytes, desc: Any, prefix: str = "", depth: int = 0) -> str | None:
    """The dotted name of the first field whose wire encoding is broken in ``data`` (None if none is
    found): walks the protobuf wire format with the message descriptor, never allocating more than
    ``data``."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    i, n = 0, len(data)
    while i < n:
        try:
            key, i = _varint(data, i)
        except ValueError:
            return prefix.rstrip(".") or "request"
        num, wire = key >> 3, key & 7
        f = desc.fields_by_number.get(num)
        name = prefix + (f.name if f is not None else f"field {num}")
        try:
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                length, i = _varint(data, i)
                chunk = data[i : i + length]
                i += length
                if i > n:
                    return name
                if f is not None and f.type == FD.TYPE_MESSAGE and depth < 8:
                    inner = bad_field(chunk, f.message_type, name + ".", depth + 1)
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


def _safe_deserializer(cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception:
            where = bad_field(data, cls.DESCRIPTOR) or "request"
            return Undecodable(cls.DESCRIPTOR.full_name, where, len(data))

    return deserialize

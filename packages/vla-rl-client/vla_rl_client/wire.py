"""Camera pixels of a ``FrameBatch`` without protobuf copies: the encoding the robot builds, and a scanner.

A batch of eight frames of two 224 px cameras is 2.4 MB, nearly all of it pixels. Through the protobuf
runtime every megabyte is copied several times: into the message when built, again to serialise it (and
``ByteSize`` serialises too), into the parsed message, and once more each time a ``bytes`` field is read.
On two shared cores those copies were a large share of a frame's CPU (measured: docs/benchmarks.md,
Fleet collector, the stage table). So both ends handle the camera map entries of ``FrameBatch`` (field
3, ``map<string, Tensor>``) at the wire level and leave the rest to protobuf:

* the robot serialises the small fields with protobuf and joins the camera entries (encoded here) onto
  them: one copy of the pixels, and the result is what goes on the wire (:func:`frames_message`);
* the collector walks the received bytes (:func:`split_cameras`): the small fields go to protobuf, the
  pixels stay where they are, as ``memoryview`` slices of the received message.

Field order does not matter to protobuf parsers, so these bytes are an ordinary ``RobotMessage`` to
any other reader (the write-ahead log replays them with the same scanner). Anything the scanner does
not expect (another body, an unknown field inside a camera entry, a bad length) makes it return None,
and the caller parses the whole message with protobuf, whose errors then apply.

Both ends also keep messages on disk in the same framing, records ``[u32 length][u32 crc32][payload]``:
the collector's write-ahead log (``fleet/wal.py``) and the robot's spool (``packages/vla-rl-client/vla_rl_client/robot_client.py``);
:func:`record_head` and :func:`parse_records` are that framing.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

_FRAMES = 4  # RobotMessage.frames
_CAMERAS = 3  # FrameBatch.cameras


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload_len: int) -> bytes:
    """Tag and length of a length-delimited field."""
    return varint(number << 3 | 2) + varint(payload_len)


def camera_entry(name: str, shape: Sequence[int], data_len: int) -> bytes:
    """Everything of one ``cameras`` map entry (uint8 tensor) up to its pixels, which follow it on the wire."""
    dims = b"".join(varint(d) for d in shape)
    head = _field(1, 5) + b"uint8" + _field(2, len(dims)) + dims + _field(3, data_len)
    key = name.encode()
    value_len = len(head) + data_len
    entry_len = len(_field(1, len(key))) + len(key) + len(_field(2, value_len)) + value_len
    return _field(_CAMERAS, entry_len) + _field(1, len(key)) + key + _field(2, value_len) + head


def frames_message(msg_id: int, small: bytes, cameras: Sequence[tuple[bytes, bytes | memoryview]]) -> bytes:
    """A serialised ``RobotMessage(msg_id, frames=...)``: ``small`` is the ``FrameBatch`` without its cameras
    (serialised by protobuf), ``cameras`` (entry head from :func:`camera_entry`, pixels) are appended."""
    fb_len = len(small) + sum(len(h) + memoryview(d).nbytes for h, d in cameras)
    parts: list[bytes | memoryview] = [b"\x08" + varint(msg_id), _field(_FRAMES, fb_len), small]
    for head, data in cameras:
        parts += (head, data)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A ``Tensor`` whose ``data`` is a slice of the received message (no copy)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


class _Bad(Exception):
    pass


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Bad
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of the field, start of its value, end) for each field in buf[pos:end]."""
    out = []
    while pos < end:
        start = pos
        tag, pos = _varint(buf, pos, end)
        number, wt = tag >> 3, tag & 7
        if number == 0:
            raise _Bad
        if wt == 0:
            _, vend = _varint(buf, pos, end)
        elif wt == 2:
            n, pos = _varint(buf, pos, end)
            vend = pos + n
        elif wt == 1:
            vend = pos + 8
        elif wt == 5:
            vend = pos + 4
        else:
            raise _Bad  # groups: never produced by proto3
        if vend > end:
            raise _Bad
        out.append((number, wt, start, pos, vend))
        pos = vend
    return out


def _tensor(buf: memoryview, pos: int, end: int) -> WireTensor:
    dtype, shape, data = "", [], buf[pos:pos]
    for number, wt, _, v, vend in _fields(buf, pos, end):
        if number == 1 and wt == 2:
            dtype = bytes(buf[v:vend]).decode()
        elif number == 2 and wt == 2:  # packed
            p = v
            while p < vend:
                d, p = _varint(buf, p, vend)
                shape.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif number == 2 and wt == 0:
            d, _ = _varint(buf, v, vend)
            shape.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif number == 3 and wt == 2:
            data = buf[v:vend]
        else:
            raise _Bad
    return WireTensor(dtype, tuple(shape), data)


def split_cameras(raw: bytes) -> tuple[bytes, dict[str, WireTensor]] | None:
    """A ``FrameBatch`` message as (the message without its camera entries, {camera: tensor over ``raw``}).

    None when ``raw`` is not a well-formed frames message of the expected shape (parse it whole then).
    """
    buf = memoryview(raw)
    try:
        top = _fields(buf, 0, len(buf))
        frames = [f for f in top if f[0] == _FRAMES]
        if len(frames) != 1 or frames[0][1] != 2 or any(f[0] not in (1, _FRAMES) for f in top):
            return None
        _, _, _, fb_pos, fb_end = frames[0]
        cams: dict[str, WireTensor] = {}
        rest: list[bytes | memoryview] = []
        for number, wt, start, v, vend in _fields(buf, fb_pos, fb_end):
            if number != _CAMERAS:
                rest.append(buf[start:vend])
                continue
            if wt != 2:
                return None
            key, value = "", WireTensor("", (), buf[v:v])
            for en, ewt, _, ev, evend in _fields(buf, v, vend):
                if en == 1 and ewt == 2:
                    key = bytes(buf[ev:evend]).decode()
                elif en == 2 and ewt == 2:
                    value = _tensor(buf, ev, evend)
                else:
                    return None
            cams[key] = value  # a repeated key: the last one wins, as in protobuf
        small = b"".join(rest)
        head = [bytes(buf[s:e]) for n, _, s, _, e in top if n != _FRAMES]
        return b"".join([*head, _field(_FRAMES, len(small)), small]), cams
    except (_Bad, UnicodeDecodeError):
        return None


RECORD_HEAD = struct.Struct("<II")  # a log record's payload length and crc32(payload)


def record_head(payload: bytes) -> bytes:
    """The head of the log record holding ``payload`` (written just before it)."""
    return RECORD_HEAD.pack(len(payload), zlib.crc32(payload))


def parse_records(data: bytes) -> tuple[list[bytes], int]:
    """The intact records at the start of ``data`` (log bytes from a record boundary), and where they end:
    a torn or corrupt tail (a write cut short by a kill) starts there."""
    out: list[bytes] = []
    pos = 0
    while pos + RECORD_HEAD.size <= len(data):
        n, crc = RECORD_HEAD.unpack_from(data, pos)
        end = pos + RECORD_HEAD.size + n
        payload = data[pos + RECORD_HEAD.size : end]
        if end > len(data) or zlib.crc32(payload) != crc:
            break
        out.append(payload)
        pos = end
    return out, pos


def keep_freed_memory() -> None:
    """Let glibc keep and reuse freed big buffers instead of returning them to the OS (process-wide).

    For processes that move many megabyte buffers: the collector (every received batch, chunk block and
    compressed chunk) and streaming robots. By default glibc maps each from the OS and unmaps it when
    freed, so each new one page-faults in fresh zeroed pages, a measurable share of the collector's CPU
    (docs/benchmarks.md, Fleet collector). For a long-running service whose memory is bounded anyway
    (``max_pending_bytes``), reusing them is the better trade. No-op where glibc is not the allocator.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 64 * 1024 * 1024)  # above a chunk block (128 x 150 kB)
        libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)
    except (OSError, AttributeError):
        pass

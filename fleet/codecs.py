"""Camera codecs of the episode store: lossless zstd or JPEG per frame, chosen per camera at recording.

``--camera-codec`` (the collector, ``sim demos``, ``store import-lerobot``) takes comma-separated items:
``CODEC`` sets the default for every camera, ``CAMERA=CODEC`` one camera's, where CODEC is

* ``lossless``: zstd (the store's default, and every store written before codecs existed);
* ``jpeg`` or ``jpeg:Q``: each frame a baseline JPEG (4:2:0, libjpeg-turbo through OpenCV) at quality
  ``Q`` in 1..100 (default :data:`DEFAULT_JPEG_QUALITY`).

e.g. ``jpeg:85``, ``lossless,wrist=jpeg:80``. The choice is recorded in each camera array's Zarr
metadata (its codec), so readers need no flag.

The JPEG codec is a Zarr v3 array -> bytes codec registered under :data:`JPEG_CODEC_ID` when this
module is imported (``import fleet.codecs`` before ``zarr.open_array`` on such an array). A chunk of
``T`` frames ``[T, H, W, 3]`` uint8 is stored as::

    b"VJPG" | u32 T | T x u32 byte length | the T JPEGs, concatenated (all little-endian)

A length of 0 is a frame equal to the fill value (0) everywhere (the rows of a last chunk past the
array's end), so those cost 4 bytes. Frames are independent: a reader can take frame ``t``'s JPEG out
of its chunk without decoding anything (:func:`stored_jpeg`, the dashboard passes it through), and
the store's writer appends frames to a partly written chunk without re-encoding (no generational
loss; :func:`merge_chunk`).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import cv2
import numpy as np
import zarr
from zarr.abc.codec import ArrayBytesCodec
from zarr.registry import register_codec

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer

JPEG_CODEC_ID = "vla_rl.jpeg"
DEFAULT_JPEG_QUALITY = 90
_MAGIC = b"VJPG"
_HEAD = struct.Struct("<4sI")
KINDS = ("lossless", "jpeg")


class CodecError(ValueError):
    """A ``--camera-codec`` value that does not parse (the message names the option and what it wants)."""


@dataclass(frozen=True)
class CameraCodec:
    """One camera's codec: ``lossless`` (zstd) or ``jpeg`` at ``quality`` (1..100)."""

    kind: str = "lossless"
    quality: int = DEFAULT_JPEG_QUALITY

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CodecError(f"--camera-codec: expected lossless, jpeg or jpeg:QUALITY, got {self.kind!r}")
        if not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise CodecError(f"--camera-codec: JPEG quality must be an integer 1..100, got {self.quality!r}")

    @classmethod
    def parse(cls, text: str) -> CameraCodec:
        """``lossless`` | ``jpeg`` | ``jpeg:Q``."""
        kind, sep, q = text.strip().partition(":")
        if kind == "lossless" and not sep:
            return cls("lossless")
        if kind == "jpeg":
            if not sep:
                return cls("jpeg")
            if not q.strip().isdigit():
                raise CodecError(f"--camera-codec: JPEG quality must be an integer 1..100, got {q!r}")
            return cls("jpeg", int(q))
        raise CodecError(f"--camera-codec: expected lossless, jpeg or jpeg:QUALITY, got {text.strip()!r}")

    def __str__(self) -> str:
        return self.kind if self.kind == "lossless" else f"jpeg:{self.quality}"


@dataclass(frozen=True)
class CameraCodecs:
    """The codec of every camera: a default and per-camera exceptions (hashable, for template caches)."""

    default: CameraCodec = CameraCodec()
    per_camera: tuple[tuple[str, CameraCodec], ...] = ()

    @classmethod
    def parse(cls, value: str | CameraCodecs | None) -> CameraCodecs:
        """``"jpeg:85"``, ``"lossless,wrist=jpeg:80"``, ... (see the module docstring); None = lossless."""
        if value is None:
            return cls()
        if isinstance(value, CameraCodecs):
            return value
        if not isinstance(value, str) or not value.strip():
            raise CodecError(
                f"--camera-codec: expected e.g. lossless, jpeg:90 or wrist=jpeg:85, got {value!r}"
            )
        default: CameraCodec | None = None
        per: dict[str, CameraCodec] = {}
        for item in value.split(","):
            name, eq, codec = item.strip().rpartition("=")
            if not eq:
                if default is not None:
                    raise CodecError(f"--camera-codec: more than one default codec in {value!r}")
                default = CameraCodec.parse(codec)
                continue
            name = name.strip()
            if not name or not name.replace("_", "").isalnum():
                raise CodecError(
                    f"--camera-codec: expected CAMERA=CODEC with a camera name, got {item.strip()!r}"
                )
            if name in per:
                raise CodecError(f"--camera-codec: camera {name!r} given twice")
            per[name] = CameraCodec.parse(codec)
        return cls(default or CameraCodec(), tuple(sorted(per.items())))

    def check(self, cameras: Sequence[str]) -> CameraCodecs:
        """Refuse per-camera codecs for cameras the robot does not have; returns self."""
        unknown = sorted({n for n, _ in self.per_camera} - set(cameras))
        if unknown:
            raise CodecError(
                f"--camera-codec: no camera {unknown[0]!r} (the cameras are {', '.join(cameras) or 'none'})"
            )
        return self

    def restrict(self, cameras: Sequence[str]) -> CameraCodecs:
        """Only the per-camera codecs of these cameras (a collector's choice spans robots of many specs)."""
        return CameraCodecs(self.default, tuple((n, c) for n, c in self.per_camera if n in cameras))

    def of(self, camera: str) -> CameraCodec:
        return dict(self.per_camera).get(camera, self.default)

    @property
    def lossless(self) -> bool:
        """Every camera lossless (what a store wrote before codecs existed)."""
        return self.default.kind == "lossless" and all(c.kind == "lossless" for _, c in self.per_camera)

    def __str__(self) -> str:
        return ",".join([str(self.default), *(f"{n}={c}" for n, c in self.per_camera)])


# ------------------------------------------------------------------------------------ frames <-> bytes
def encode_jpeg(frame: np.ndarray, quality: int) -> bytes:
    """One RGB uint8 [H, W, 3] frame as a baseline JPEG (libjpeg-turbo; OpenCV releases the GIL)."""
    ok, buf = cv2.imencode(
        ".jpg", cv2.cvtColor(frame, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)]
    )
    if not ok:
        raise ValueError(f"JPEG encoding failed for a frame of shape {list(frame.shape)}")
    return buf.tobytes()


def decode_jpeg(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    """A JPEG back to RGB uint8 of ``shape`` ([H, W, 3]); ValueError for bytes that are not one."""
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    if img is None or img.shape != tuple(shape):
        got = "undecodable bytes" if img is None else f"shape {list(img.shape)}"
        raise ValueError(f"JPEG chunk: expected a frame of shape {list(shape)}, got {got}")
    return img


def _payloads(frames: np.ndarray, quality: int, skip_fill: bool) -> list[bytes]:
    """Each frame's JPEG; with ``skip_fill``, b"" for a frame that is 0 everywhere (zarr pads a partial
    chunk with such rows; the store's writer never hands them over, so it skips the check)."""
    return [b"" if skip_fill and not f.any() else encode_jpeg(f, quality) for f in frames]


def pack(payloads: Sequence[bytes | memoryview]) -> bytes:
    """Payloads -> one chunk's bytes (header, lengths, payloads)."""
    n = len(payloads)
    lengths = np.array([len(p) for p in payloads], "<u4")
    return b"".join([_HEAD.pack(_MAGIC, n), lengths.tobytes(), *payloads])


def unpack(data: bytes | memoryview, frames: int | None = None) -> list[memoryview]:
    """One chunk's bytes -> its payloads (views); ValueError naming what is wrong for corrupt bytes."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise ValueError(f"JPEG chunk: {len(view)} bytes, shorter than its header")
    magic, n = _HEAD.unpack_from(view)
    if magic != _MAGIC or (frames is not None and n != frames):
        want = "" if frames is None else f" of {frames} frames"
        raise ValueError(
            f"JPEG chunk: expected a {_MAGIC.decode()} chunk{want}, got magic {magic!r}, {n} frames"
        )
    at = _HEAD.size + 4 * n
    if len(view) < at:
        raise ValueError(f"JPEG chunk: {len(view)} bytes, too short for {n} frame lengths")
    lengths = np.frombuffer(view[_HEAD.size : at], "<u4")
    if at + int(lengths.sum(dtype=np.int64)) != len(view):
        raise ValueError(
            f"JPEG chunk: frame lengths sum to {int(lengths.sum())}, {len(view) - at} bytes follow"
        )
    out = []
    for length in lengths.tolist():
        out.append(view[at : at + length])
        at += length
    return out


def encode_chunk(frames: np.ndarray, quality: int, skip_fill: bool = False) -> bytes:
    """A chunk of frames [T, H, W, 3] uint8 -> its stored bytes (``skip_fill``: see :func:`_payloads`)."""
    return pack(_payloads(frames, quality, skip_fill))


def decode_chunk(
    data: bytes | memoryview, shape: tuple[int, ...], out: np.ndarray | None = None
) -> np.ndarray:
    """Stored bytes -> the chunk's frames, uint8 ``shape`` = [T, H, W, 3] (zeros where a frame is empty)."""
    payloads = unpack(data, shape[0])
    arr = np.zeros(shape, np.uint8) if out is None else out
    for i, p in enumerate(payloads):
        if len(p):
            arr[i] = decode_jpeg(p, shape[1:])
        elif out is not None:
            arr[i] = 0
    return arr


def merge_chunk(old: bytes | None, offset: int, frames: np.ndarray, chunk_len: int, quality: int) -> bytes:
    """A chunk with rows ``[offset, offset + len(frames))`` replaced by ``frames``, encoded, and every other
    row's JPEG kept byte for byte from ``old`` (None: empty rows): appending to a partly written chunk
    never re-encodes (and never degrades) the frames already there."""
    rows: list[bytes | memoryview] = list(unpack(old, chunk_len)) if old is not None else [b""] * chunk_len
    rows[offset : offset + len(frames)] = _payloads(frames, quality, skip_fill=False)
    return pack(rows)


# ------------------------------------------------------------------------------------ the zarr codec
@dataclass(frozen=True)
class JpegCodec(ArrayBytesCodec):
    """Zarr v3 array -> bytes codec: a chunk of RGB frames [T, H, W, 3] uint8, one JPEG per frame."""

    is_fixed_size = False
    quality: int = DEFAULT_JPEG_QUALITY

    def __init__(self, *, quality: int = DEFAULT_JPEG_QUALITY) -> None:
        CameraCodec("jpeg", quality)  # validates
        object.__setattr__(self, "quality", quality)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:  # type: ignore[override]
        config = data.get("configuration") or {}
        if data.get("name") != JPEG_CODEC_ID or set(config) - {"quality"}:
            raise ValueError(f"{JPEG_CODEC_ID}: unexpected codec metadata {data!r}")
        return cls(quality=int(config.get("quality", DEFAULT_JPEG_QUALITY)))

    def to_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"name": JPEG_CODEC_ID, "configuration": {"quality": self.quality}}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        native = dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else np.dtype(dtype)
        chunks = getattr(chunk_grid, "chunk_shape", None)
        if native != np.uint8 or len(shape) != 4 or shape[-1] != 3:
            raise ValueError(
                f"{JPEG_CODEC_ID}: expected uint8 frames [T, H, W, 3], got {native}{list(shape)}"
            )
        if chunks is not None and tuple(chunks[1:]) != tuple(shape[1:]):
            raise ValueError(
                f"{JPEG_CODEC_ID}: chunks must hold whole frames, got {list(chunks)} for {list(shape)}"
            )

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        arr = decode_chunk(chunk_bytes.as_numpy_array().data, tuple(chunk_spec.shape))
        return chunk_spec.prototype.nd_buffer.from_numpy_array(arr)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        frames = np.ascontiguousarray(chunk_array.as_numpy_array(), dtype=np.uint8)
        return chunk_spec.prototype.buffer.from_bytes(encode_chunk(frames, self.quality, skip_fill=True))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError  # variable size (only fixed-size codecs are asked)


register_codec(JPEG_CODEC_ID, JpegCodec)


def jpeg_codec(arr: zarr.Array) -> JpegCodec | None:
    """The array's JPEG codec if it is stored as JPEG frames (and nothing else), else None."""
    codecs = arr.metadata.codecs if arr.metadata.zarr_format == 3 else ()
    return codecs[0] if len(codecs) == 1 and isinstance(codecs[0], JpegCodec) else None


def array_codec(arr: zarr.Array) -> str:
    """``jpeg:Q`` or ``lossless`` for a camera array (what ``store info`` reports)."""
    j = jpeg_codec(arr)
    return "lossless" if j is None else str(CameraCodec("jpeg", j.quality))


def stored_jpeg(arr: zarr.Array, t: int, max_quality: int = 100) -> bytes | None:
    """Frame ``t``'s JPEG exactly as stored (no decoding, no re-encoding), or None when the array is not
    JPEG, its quality is above ``max_quality`` (a caller wanting smaller files re-encodes), or the frame
    is not stored (an empty row)."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    codec = jpeg_codec(arr)
    if codec is None or codec.quality > max_quality:
        return None
    cl = arr.chunks[0]
    key = arr.metadata.encode_chunk_key((t // cl, 0, 0, 0))
    buf = sync((arr.store_path / key).get(prototype=default_buffer_prototype()))
    if buf is None:
        return None
    payload = unpack(buf.to_bytes(), cl)[t % cl]
    return bytes(payload) if len(payload) else None

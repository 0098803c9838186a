"""numpy <-> wire conversions for the policy service, shared by the server and the slim client.

Why a hand-written codec instead of pickle or ``torch.save``: decoding must never run code chosen by
the sender (LeRobot's pickled observations are an unauthenticated RCE, CVE-2026-25874). A tensor is a
numpy dtype name from a fixed allow-list, a shape and raw C-order little-endian bytes; the byte count is
checked against dtype x shape *before* anything is allocated, so a truncated or padded payload is an
error that names the field rather than a garbled array. Images may travel JPEG/PNG-encoded; their size is
read from the header and checked against the robot spec before the pixels are decoded, so a small file
that claims to be a huge image (a decompression bomb) is refused cheaply.

This module imports numpy, Pillow and the generated protobuf code only (no torch), so robots can use
the client without the training stack.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from server.proto import policy_service_pb2 as pb
from vla_rl.spec import SpecError

# numpy dtype names accepted on the wire: plain numeric types only (no object, string or void dtypes).
WIRE_DTYPES = frozenset(
    (
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    )
)
MAX_NDIM = 8
ImageFormat = Literal["raw", "jpeg", "png"]
IMAGE_FORMATS = get_args(ImageFormat)


def to_tensor(array: np.ndarray | Sequence[float]) -> pb.Tensor:
    """A numpy array (or nested sequence) as a wire ``Tensor``: C order, little-endian."""
    arr = np.asarray(array)
    if arr.dtype.name not in WIRE_DTYPES:
        raise TypeError(f"dtype {arr.dtype} cannot travel on the wire; use one of {sorted(WIRE_DTYPES)}")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return pb.Tensor(dtype=arr.dtype.name, shape=list(arr.shape), data=arr.tobytes())


def from_tensor(
    msg: pb.Tensor,
    field: str,
    *,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
) -> np.ndarray:
    """Decode a wire ``Tensor`` into a (read-only) numpy array, raising :class:`SpecError` naming ``field``.

    ``dtype``/``shape`` are what the caller expects; giving them here makes the error say so in one
    message instead of a generic decode error followed by a spec error.
    """
    want = f"{dtype or 'a'}{list(shape) if shape is not None else ''} tensor"
    if not msg.dtype:
        raise SpecError(field, want, "nothing (missing)")
    if msg.dtype not in WIRE_DTYPES:
        raise SpecError(
            field, f"dtype {dtype or 'one of ' + str(sorted(WIRE_DTYPES))}", f"dtype {msg.dtype!r}"
        )
    if dtype is not None and msg.dtype != dtype:
        raise SpecError(field, f"dtype {dtype}", f"dtype {msg.dtype}")
    dims = list(msg.shape)
    if len(dims) > MAX_NDIM or any(d < 0 for d in dims):
        raise SpecError(field, f"at most {MAX_NDIM} non-negative dims", f"shape {dims}")
    if shape is not None and dims != list(shape):
        raise SpecError(field, f"shape {list(shape)}", f"shape {dims}")
    np_dtype = np.dtype(msg.dtype).newbyteorder("<")
    n = 1
    for d in dims:
        n *= d
    need = n * np_dtype.itemsize
    data = msg.data  # every access of a protobuf bytes field is a fresh copy: read it once
    if len(data) != need:
        raise SpecError(
            field,
            f"{need} bytes for {msg.dtype}{dims}",
            f"{len(data)} bytes ({'truncated' if len(data) < need else 'too many'})",
        )
    arr = np.frombuffer(data, dtype=np_dtype).reshape(dims)
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def encode_image(image: np.ndarray, fmt: str = "raw", jpeg_quality: int = 90) -> pb.Image:
    """A uint8 [H, W, 3] image as a wire ``Image``: raw pixels, or JPEG (lossy) / PNG (lossless) bytes."""
    if fmt == "raw":
        return pb.Image(encoding=pb.Image.RAW, raw=to_tensor(image))
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format must be one of {IMAGE_FORMATS}, got {fmt!r}")
    from PIL import Image

    buf = io.BytesIO()
    pil = Image.fromarray(np.asarray(image, dtype=np.uint8))
    if fmt == "jpeg":
        pil.save(buf, format="JPEG", quality=jpeg_quality)
        return pb.Image(encoding=pb.Image.JPEG, encoded=buf.getvalue())
    pil.save(buf, format="PNG")
    return pb.Image(encoding=pb.Image.PNG, encoded=buf.getvalue())


def decode_image(msg: pb.Image, field: str, height: int, width: int) -> np.ndarray:
    """A wire ``Image`` as uint8 [height, width, 3]; the size is checked before the pixels are decoded."""
    want = f"a {height}x{width}x3 uint8 image"
    if msg.encoding == pb.Image.RAW:
        if msg.encoded:
            raise SpecError(field, "pixels in 'raw' for encoding RAW", "bytes in 'encoded'")
        return from_tensor(msg.raw, field, dtype="uint8", shape=(height, width, 3))
    names = {pb.Image.JPEG: "JPEG", pb.Image.PNG: "PNG"}
    if msg.encoding not in names:
        raise SpecError(field, "encoding RAW, JPEG or PNG", f"encoding {msg.encoding}")
    kind = names[msg.encoding]
    if not msg.encoded:
        raise SpecError(field, f"{kind} bytes", "nothing (empty)")
    from PIL import Image, UnidentifiedImageError

    try:
        pil = Image.open(io.BytesIO(msg.encoded), formats=[kind])
    except (UnidentifiedImageError, OSError, ValueError):
        raise SpecError(field, f"a valid {kind} file", "bytes that do not decode as one") from None
    if pil.size != (width, height):
        w, h = pil.size
        raise SpecError(field, want, f"a {h}x{w} {kind}")
    try:
        arr = np.asarray(pil.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError):
        raise SpecError(field, f"a complete {kind} file", "a truncated or corrupt one") from None
    if arr.shape != (height, width, 3):
        raise SpecError(field, want, f"shape {list(arr.shape)} after decoding")
    return arr

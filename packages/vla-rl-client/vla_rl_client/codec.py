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

from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.spec import SpecError

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
    msg = pb.Tensor()
    fill_tensor(msg, array)
    return msg


def fill_tensor(msg: pb.Tensor, array: np.ndarray | Sequence[float]) -> None:
    """Write ``array`` into the (empty) ``Tensor`` field ``msg`` of a message being built, as :func:`to_tensor`
    encodes it. Filling the field where it lives copies the bytes once; building a ``Tensor`` and then
    ``CopyFrom``-ing it (or passing it to a parent's constructor) copies them again each time, which for a
    camera frame is most of a request's encoding time."""
    arr = np.asarray(array)
    if arr.dtype.name not in WIRE_DTYPES:
        raise TypeError(f"dtype {arr.dtype} cannot travel on the wire; use one of {sorted(WIRE_DTYPES)}")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    msg.dtype = arr.dtype.name
    msg.shape[:] = arr.shape
    msg.data = arr.tobytes()


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
    msg = pb.Image()
    fill_image(msg, image, fmt, jpeg_quality)
    return msg


def fill_image(msg: pb.Image, image: np.ndarray, fmt: str = "raw", jpeg_quality: int = 90) -> None:
    """Write ``image`` into the (empty) ``Image`` field ``msg`` in place, as :func:`encode_image` encodes it
    (one copy of the pixels, see :func:`fill_tensor`)."""
    if fmt == "raw":
        msg.encoding = pb.Image.RAW
        fill_tensor(msg.raw, image)
        return
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format must be one of {IMAGE_FORMATS}, got {fmt!r}")
    from PIL import Image

    buf = io.BytesIO()
    pil = Image.fromarray(np.asarray(image, dtype=np.uint8))
    if fmt == "jpeg":
        pil.save(buf, format="JPEG", quality=jpeg_quality)
        msg.encoding = pb.Image.JPEG
    else:
        pil.save(buf, format="PNG")
        msg.encoding = pb.Image.PNG
    msg.encoded = buf.getvalue()


_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def image_header_size(data: bytes, kind: str) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR or a JPEG's SOF segment, reading only the header bytes.

    None when the header is missing or malformed. Lets the server refuse an image whose size differs
    from the robot spec before any decoder (or PIL's own bomb check) sees it.
    """
    if kind == "PNG":
        if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
            return None
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if len(data) < 4 or data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            return width, height
        if marker in (0xDA, 0xD9):  # scan data (or the end) before any frame header
            return None
        i += 2 + length
    return None


def decode_image(msg: pb.Image, field: str, height: int, width: int) -> np.ndarray:
    """A wire ``Image`` as uint8 [height, width, 3]; the size is checked before the pixels are decoded.

    Every failure is a :class:`SpecError` naming ``field``: the size is read from the header bytes and
    compared with the spec before PIL opens the file, and any decoder error (truncated data, PIL's
    ``DecompressionBombError``, ...) is caught, so no input can raise anything else.
    """
    want = f"a {height}x{width}x3 uint8 image"
    if msg.encoding == pb.Image.RAW:
        if msg.encoded:
            raise SpecError(field, "pixels in 'raw' for encoding RAW", "bytes in 'encoded'")
        return from_tensor(msg.raw, field, dtype="uint8", shape=(height, width, 3))
    names = {pb.Image.JPEG: "JPEG", pb.Image.PNG: "PNG"}
    if msg.encoding not in names:
        raise SpecError(field, "encoding RAW, JPEG or PNG", f"encoding {msg.encoding}")
    kind = names[msg.encoding]
    data = msg.encoded  # a fresh copy on every access: read once
    if not data:
        raise SpecError(field, f"{kind} bytes", "nothing (empty)")
    size = image_header_size(data, kind)
    if size is None:
        raise SpecError(field, f"a valid {kind} file", "bytes without a readable header")
    if size != (width, height):
        raise SpecError(field, want, f"a {size[1]}x{size[0]} {kind}")
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(data), formats=[kind])
            if pil.size != (width, height):
                w, h = pil.size
                raise SpecError(field, want, f"a {h}x{w} {kind}")
            arr = np.asarray(pil.convert("RGB"), dtype=np.uint8)
    except SpecError:
        raise
    except Exception as e:  # UnidentifiedImageError, OSError, DecompressionBomb*, SyntaxError, ...
        raise SpecError(
            field, f"a complete, valid {kind} file", f"one that fails to decode ({type(e).__name__})"
        ) from None
    if arr.shape != (height, width, 3):
        raise SpecError(field, want, f"shape {list(arr.shape)} after decoding")
    return arr

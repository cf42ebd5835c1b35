"""Encoded images (PNG/JPEG) in a BYTES tensor -> the uint8 pixel tensor an image model takes."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from serve_app.errors import InvalidInput
from serve_app.process.cpu_priority import Pacer

# MPO is how Pillow names a JPEG that carries further pictures (a camera's preview, say): its
# first picture is the JPEG.
FORMATS = ("PNG", "JPEG", "MPO")
# A 16-megapixel image is far beyond any model input here; past it, a small file may be a
# decompression bomb that would exhaust the router's memory once decoded.
MAX_PIXELS = 4096 * 4096
# What one request may make the router's decoders work through: the images of one request share
# two decoder threads with every other request's, so one request of many large images would
# hold them all for seconds. Checked from the headers, before anything is decoded.
MAX_REQUEST_PIXELS = 4 * MAX_PIXELS

_BROKEN = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# Pillow warns about an image over its own pixel limit, MAX_PIXELS refuses it anyway, and the
# warning's text names the size: each new size would print a line and stay in the warnings
# registry for good, a leak any client could drive with headers of a few bytes. Set once here, at
# import, not per call (warnings.catch_warnings swaps the process's filters, which two decoder
# threads would restore in the wrong order). Past twice that limit Pillow still refuses it itself.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def encoded(value: bytes | memoryview | str, index: int) -> bytes | memoryview:
    """An element's encoded image. JSON cannot carry raw bytes, so a str element is base64 (the
    binary extension sends bytes as they are)."""
    if not isinstance(value, str):
        return value
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"image {index}: a BYTES image in JSON must be base64-encoded PNG or JPEG") from None


def _open(value: bytes | memoryview | str, index: int, pacer: Pacer | None = None) -> Image.Image:
    """The image's header read (not its pixels), with its format and size checked. `pacer`: the
    request's (one for all its images, so that its waits have one limit); by default its own."""
    value = encoded(value, index)
    try:
        img = Image.open(_PacedBytes(value, pacer or new_pacer()))  # the header only: MAX_PIXELS is checked before any pixel
    except Image.UnidentifiedImageError:
        raise InvalidInput(f"image {index}: not a PNG or JPEG image (its bytes match no known image format)") from None
    except _BROKEN:
        raise _undecodable(index) from None
    if img.format not in FORMATS:
        raise InvalidInput(f"image {index}: format {img.format} is not accepted; send PNG or JPEG")
    if img.width * img.height > MAX_PIXELS:
        raise InvalidInput(f"image {index}: {img.width}x{img.height} pixels; at most {MAX_PIXELS} are allowed")
    img.decodermaxblock = PACED_BLOCK
    return img


# Compressed bytes Pillow decodes per read (its default is 64 KiB): each read is a chance to nap.
PACED_BLOCK = 16384


# In a decoder process (serve_app.protocols.decoders): whether its router has latency-sensitive
# work in flight (cpu_priority.MODEL_WORK) while no core is left free, which the decode waits for
# between blocks.
yield_while: Callable[[], bool] | None = None


def new_pacer() -> Pacer:
    """A request's pacer: its waits for the router's urgent work are limited per request
    (cpu_priority.MAX_YIELD_TOTAL_S), whatever its number of images."""
    return Pacer(busy=yield_while)


class _PacedBytes(io.BytesIO):
    """The encoded image as Pillow reads it while decoding (a block at a time): between blocks the
    decoder thread naps now and then (serve_app.process.cpu_priority.Pacer), so that a decode of many
    milliseconds leaves its core idle for a moment every half millisecond."""

    def __init__(self, data: bytes | memoryview, pacer: Pacer) -> None:
        super().__init__(data)
        self.pacer = pacer

    def read(self, size: int | None = -1) -> bytes:
        self.pacer.pace()
        return super().read(size)


def _undecodable(index: int) -> InvalidInput:
    # The decoder's own message stays out of the answer: it describes the server's library, not the input.
    return InvalidInput(f"image {index}: cannot decode it as PNG or JPEG (corrupt, truncated or unsupported data)")


# A large image is first shrunk by a whole factor (a box filter), leaving at least this factor to
# the bilinear resize: most of the resize's work for a fraction of a grey level's difference.
REDUCING_GAP = 2.0


def _pixels(img: Image.Image, size: int, index: int, resize: int | None = None) -> np.ndarray:
    """The image as uint8 (3, size, size): stretched to the size, or with `resize` (the model's
    preprocessing, torchvision's Resize + CenterCrop) its shorter side resized to `resize` and
    its centre cropped."""
    if img.format in ("JPEG", "MPO"):
        # JPEG decodes at 1/2, 1/4 or 1/8 scale in its own transform, no smaller than asked:
        # a camera's picture for a model input costs a fraction of its full decode.
        img.draft("RGB", (resize or size, resize or size))
    try:
        img.load()
        rgb = _rgb(img)
    except _BROKEN:
        raise _undecodable(index) from None
    if resize is not None:
        w, h = rgb.size
        scale = resize / min(w, h)
        w, h = max(size, round(w * scale)), max(size, round(h * scale))
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), Image.Resampling.BILINEAR, reducing_gap=REDUCING_GAP)
        left, top = round((w - size) / 2), round((h - size) / 2)
        rgb = rgb.crop((left, top, left + size, top + size))
    elif rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.BILINEAR, reducing_gap=REDUCING_GAP)
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


# The modes Pillow gives a 16-bit greyscale PNG (and "I", which such a PNG may become).
WIDE_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img  # no copy of its pixels
    if img.mode in WIDE_GREY:
        # Pillow's own conversion clips every value above 255, so a 16-bit picture would come
        # out almost white; its high byte is the 8-bit picture (as Pillow keeps of 16-bit RGB).
        wide = np.asarray(img)
        if wide.dtype != np.uint16:  # "I" is 32-bit
            wide = wide.clip(0, 65535)
        return Image.fromarray((wide >> 8).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


def decode_image(value: bytes | memoryview | str, size: int, index: int = 0, resize: int | None = None) -> np.ndarray:
    """One encoded image as uint8 (3, size, size), resized when it is another size."""
    return _pixels(_open(value, index), size, index, resize)


def decode_images(values: Sequence[bytes | memoryview | str], size: int, resize: int | None = None) -> np.ndarray:
    """A request's images, every header checked (and their pixels counted) before any is decoded."""
    pacer = new_pacer()
    images = [_open(v, i, pacer) for i, v in enumerate(values)]
    if (total := sum(img.width * img.height for img in images)) > MAX_REQUEST_PIXELS:
        raise InvalidInput(f"{total} pixels in one request's images; at most {MAX_REQUEST_PIXELS} are allowed")
    return np.stack([_pixels(img, size, i, resize) for i, img in enumerate(images)])

"""A v2 infer body's JSON part, decoded without a Python object per tensor element.

A JSON image is thousands of numbers. Parsed as a Python list, each one becomes an object
that is then type-checked and copied into numpy, which costs the router more than the rest of
the request. Here msgspec decodes the body's structure and keeps each input's `data` as its
raw JSON text; a flat array of integers for a small integer type (UINT8 pixels, INT32 token
ids) then goes straight into numpy (`numbers`), and anything else (strings, nesting,
booleans, nulls, fractions) is decoded as a list, for `serve_app.protocols.v2` to check and
explain as before. Floats are left to pydantic's parser, which reads them faster than this
path could (`serve_app.protocols.v2.parse_request` keeps float bodies off it).

`decode` gives None for a body it does not take whole: pydantic's full validation then
parses it, and says what is wrong with it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

# JSON text that can only be integers, commas and brackets: no quotes, letters, fractions or exponents.
_INTEGER_TEXT = b"0123456789-,[] \t\r\n"
# Integer types whose every value fits in int64 with room: a value past their range is then
# seen by the range check, never wrapped.
_SMALL_INTEGERS = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32)}


class Input(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: msgspec.Raw = msgspec.Raw()  # empty when absent


class Output(msgspec.Struct):
    name: str
    parameters: dict[str, Any] | None = None


class Request(msgspec.Struct):
    inputs: list[Input]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[Output] | None = None


class SmallInput(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class SmallRequest(msgspec.Struct):
    inputs: list[SmallInput]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[Output] | None = None


_REQUEST = msgspec.json.Decoder(Request)
_SMALL_REQUEST = msgspec.json.Decoder(SmallRequest)
_ANY = msgspec.json.Decoder()


# Nesting deeper than pydantic's parser allows is refused there; a body that could nest that
# deep (this many brackets and braces in all) is left to it.
MAX_BRACKETS = 64


def decode(json_part: bytes | bytearray) -> Request | None:
    if json_part.count(b"[") + json_part.count(b"{") > MAX_BRACKETS:
        return None
    try:
        request = _REQUEST.decode(json_part)
    except Exception:  # anything msgspec refuses (bad JSON, bad UTF-8, wrong types): pydantic says why
        return None
    return request if request.inputs else None


def decode_small(json_part: bytes | bytearray) -> SmallRequest | None:
    """A small body (a few texts, a small tensor) in one pass, its `data` as Python values; None
    for a body msgspec does not take whole (pydantic then says what is wrong, or takes what
    its lax types allow)."""
    if json_part.count(b"[") + json_part.count(b"{") > MAX_BRACKETS:
        return None
    try:
        request = _SMALL_REQUEST.decode(json_part)
    except Exception:
        return None
    return request if request.inputs else None


def data_of(raw: msgspec.Raw) -> tuple[bool, Any]:
    """An input's `data` as Python values (None when absent or null), and False when msgspec
    refuses them (a number past its range) and pydantic should judge."""
    if not len(raw):
        return True, None
    try:
        return True, _ANY.decode(raw)
    except Exception:
        return False, None


def numbers(raw: msgspec.Raw, dtype: np.dtype[Any], count: int) -> np.ndarray | None:
    """A flat JSON array of `count` numbers as a 1-D array of `dtype`, exactly as numpy would
    convert the parsed values; None when only the full path can say (the text holds anything
    else, or a value does not fit)."""
    text = bytes(raw)
    if count == 0 or dtype not in _SMALL_INTEGERS or not text.startswith(b"[") or text.count(b"[") != 1:
        return None
    if text.translate(None, _INTEGER_TEXT):
        return None
    # In JSON, n commas separate n + 1 values unless the array is empty (which numpy would read as one 0).
    if text.count(b",") + 1 != count or not text[1:-1].strip():
        return None
    # msgspec has checked the text is JSON, and the check above that it holds integers only.
    parsed = np.fromstring(text[1:-1], dtype=np.int64, sep=",")
    if parsed.size != count:
        return None
    info = np.iinfo(dtype)
    if parsed.min() < info.min or parsed.max() > info.max:
        return None
    return parsed.astype(dtype)

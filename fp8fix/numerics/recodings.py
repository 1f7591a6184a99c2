"""e4m3fn <-> e4m3fnuz as byte maps, and exact power-of-two scale changes: bytes in, bytes out.

Encoding changes are 256-entry byte maps built here in plain Python, so conversions
that just move or remap bytes never import torch and start fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ, decode_floats, encode_floats
from fp8fix.numerics.fp8 import e4m3_value, nearest_code


@dataclass(frozen=True)
class Recoding:
    """An encoding change as a byte map. `scale_factor` multiplies every scale of the codes;
    `forbidden` codes are refused with `why`."""

    name: str
    source: str
    target: str
    scale_factor: float
    forbidden: tuple[int, ...]
    why: str


#: fn -> fnuz: same bits mean half the value, so scales double; 0x80 (-0 in fn, NaN in fnuz) becomes 0x00.
FN_TO_FNUZ = Recoding(
    "fn->fnuz", E4M3FN, E4M3FNUZ, 2.0, (0x7F, 0xFF), "NaN codes in e4m3fn (they would become +-240 in e4m3fnuz)"
)
#: fnuz -> fn: scales halve and the bits stay; exact unless the tensor holds +-240 (0x7F/0xFF, NaN in fn).
FNUZ_TO_FN = Recoding(
    "fnuz->fn", E4M3FNUZ, E4M3FN, 0.5, (0x80, 0x7F, 0xFF), "0x80 (NaN in e4m3fnuz) or +-240 (NaN in e4m3fn)"
)
#: fnuz -> fn for tensors holding +-240: scales stay and each code becomes the fn code of the same value.
#: Exact except fnuz codes below 2^-6 with an odd mantissa, which round by half an fn step (2^-10 * scale).
FNUZ_TO_FN_SAME_SCALE = Recoding("fnuz->fn@same-scale", E4M3FNUZ, E4M3FN, 1.0, (0x80,), "0x80 (NaN in e4m3fnuz)")
RECODINGS = {r.name: r for r in (FN_TO_FNUZ, FNUZ_TO_FN, FNUZ_TO_FN_SAME_SCALE)}


def scale_factor(source: str, target: str) -> float:
    """What every scale of FP8 codes is multiplied by when the codes go from `source` to `target`
    bit for bit: 2 for e4m3fn -> e4m3fnuz, 1/2 back, 1 within one encoding."""
    for recoding in (FN_TO_FNUZ, FNUZ_TO_FN):
        if (recoding.source, recoding.target) == (source, target):
            return recoding.scale_factor
    return 1.0


@cache
def recoding_table(name: str) -> bytes:
    """The 256-byte map of a recoding (forbidden codes map to themselves; they are refused before)."""
    if name == FN_TO_FNUZ.name:
        return bytes(0 if c == 0x80 else c for c in range(256))
    if name == FNUZ_TO_FN.name:
        return bytes(range(256))
    return bytes(c if c == 0x80 else nearest_code(e4m3_value(c, E4M3FNUZ), E4M3FN) for c in range(256))


@cache
def inexact_codes(name: str) -> bytes:
    """Source codes whose value the recoding cannot keep exactly."""
    r = RECODINGS[name]
    table = recoding_table(name)
    return bytes(
        c
        for c in range(256)
        if c not in r.forbidden and e4m3_value(table[c], r.target) * r.scale_factor != e4m3_value(c, r.source)
    )


def recode(codes: bytes | bytearray, name: str) -> bytes | bytearray:
    """Apply a recoding to FP8 `codes` (forbidden codes must have been refused already); codes
    that need no change come back as they are, not copied."""
    if name == FN_TO_FNUZ.name:  # -0 is rare in real weights: memchr finds there is nothing to do
        return codes.replace(b"\x80", b"\x00") if codes.find(0x80) >= 0 else codes
    if name == FNUZ_TO_FN.name:
        return codes
    return codes.translate(recoding_table(name))


def scale_exactly(data: bytes, dtype: str, factor: float) -> bytes:
    """Multiply float scales by a power of two; refuse if any result is not exact (overflow, lost subnormal bit)."""
    values = decode_floats(data, dtype)
    scaled = [v * factor for v in values]
    try:
        out = encode_floats(scaled, dtype)
    except OverflowError:  # struct refuses a value past F32's or F16's range
        out = b""
    if not out or decode_floats(out, dtype) != scaled or not all(math.isfinite(v) for v in scaled):
        raise ValueError(f"a {dtype} scale times {factor} is not exactly representable")
    return out


@cache
def value_map(source: str, target: str, factor: float) -> tuple[bytes, bytes, bytes]:
    """How codes keep their value when the scale is multiplied by a power of two `factor`.

    For every `source` code at scale s: the `target` code of the same value at scale
    s * factor (nearest even where it has none), then the codes that round (no exact
    `target` code) and the codes that overflow (beyond the `target` range: only a
    clamp could hold them). NaN codes map to a NaN code of `target`.
    """
    nan_code = 0x7F if target == E4M3FN else 0x80
    expected, rounded, overflow = bytearray(256), bytearray(), bytearray()
    top = max(e4m3_value(c, target) for c in range(128) if not math.isnan(e4m3_value(c, target)))
    for code in range(256):
        value = e4m3_value(code, source)
        if math.isnan(value):
            expected[code] = code if source == target else nan_code
            continue
        wanted = value / factor
        if abs(wanted) > top:
            overflow.append(code)
            continue
        # zero keeps its sign within one encoding (bytes are moved); e4m3fnuz has no -0
        expected[code] = code if wanted == 0 and source == target else nearest_code(wanted, target)
        if e4m3_value(expected[code], target) != wanted:
            rounded.append(code)
    return bytes(expected), bytes(rounded), bytes(overflow)

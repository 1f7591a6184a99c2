"""Requantization: FP8 codes re-expressed at another scale. The only float math of a conversion.

An FP8 code has 256 values, so requantizing from one scale to another is a 256-entry
byte map: each code's new code (and its error) is worked out once, in float32
arithmetic emulated exactly with Python floats, and the weight bytes then go through
`bytes.translate` at memory speed. No torch, no float tensor the size of the weight:
memory stays at one chunk whatever the tensor's size. The worst error of a chunk is the
worst error among the codes it holds: the codes are asked for in order of falling error, each
found with `memchr` (`CodesHeld`), so the statistic costs a few percent of the byte map.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cache, cached_property

from fp8fix.numerics.dtypes import E4M3FN, REQUANT_CLAMP
from fp8fix.numerics.fp8 import e4m3_value, nearest_code, step_at

_F32 = struct.Struct("<f")
#: Codes looked at a time by `present_codes` (its pairs' index is a view: no copy of the data).
_PRESENCE_SLICE = 1 << 24
#: Codes `CodesHeld` may look for in vain, one `memchr` over the data each, before it marks every code at once.
_MISSES_BEFORE_MARKING = 6


@dataclass
class RoundingStats:
    """The worst error of a rounding, in value and in steps of the grid rounded to: fp8 steps at the target
    scale for a requantization, BF16 steps for a dequantization (`numerics.dequantize`)."""

    max_abs: float = 0.0
    max_steps: float = 0.0

    def update(self, other: RoundingStats) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_steps = max(self.max_steps, other.max_steps)


@dataclass(frozen=True)
class RequantizeMap:
    """One requantization as byte maps: `codes` maps each source code to its new code;
    `abs_error` and `steps` give each source code's error (NaN codes: 0, they are refused before)."""

    codes: bytes
    abs_error: tuple[float, ...]
    steps: tuple[float, ...]

    @cached_property
    def _by_error(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The codes with an error, worst first: by value, by steps."""
        return _worst_first(self.abs_error), _worst_first(self.steps)

    def worst(self, data: bytes | bytearray) -> RoundingStats:
        """The worst errors among the codes `data` holds."""
        held = CodesHeld(data)
        by_abs, by_steps = self._by_error
        return RoundingStats(
            max_abs=next((self.abs_error[c] for c in by_abs if c in held), 0.0),
            max_steps=next((self.steps[c] for c in by_steps if c in held), 0.0),
        )


def _worst_first(errors: tuple[float, ...]) -> tuple[int, ...]:
    return tuple(sorted((c for c in range(256) if errors[c] > 0), key=lambda c: -errors[c]))


class CodesHeld:
    """Whether `data` holds a code, asked code by code, as `RequantizeMap.worst` asks them (worst error first).

    A code above the largest positive or negative code held (two numpy reductions, ~30 GB/s) is not held;
    any other is looked for with `bytes.find` (`memchr`: it stops at the first occurrence, and the codes
    with the worst errors are usually common ones). After a few codes not found, each a whole pass, every
    code is marked at once (`present_codes`, ~1 GB/s), so no data costs more than a few passes more than that.
    """

    def __init__(self, data: bytes | bytearray) -> None:
        import numpy as np

        codes = np.frombuffer(data, dtype=np.uint8)
        self._data = data
        # the largest code of each sign: positives are 0x00-0x7F (int8 >= 0), negatives 0x80-0xFF
        self._top_positive = int(codes.view(np.int8).max()) if len(codes) else -1
        self._top = int(codes.max()) if len(codes) else -1
        self._misses = 0
        self._marked: frozenset[int] | None = None

    def __contains__(self, code: int) -> bool:
        if code > (self._top_positive if code < 0x80 else self._top):
            return False
        if self._marked is not None:
            return code in self._marked
        if self._data.find(code) >= 0:
            return True
        self._misses += 1
        if self._misses >= _MISSES_BEFORE_MARKING:
            self._marked = frozenset(present_codes(self._data))
        return False


def present_codes(data: bytes | bytearray) -> list[int]:
    """The distinct byte values of `data`, ascending. Marked two at a time: each pair of bytes, read as one
    uint16, sets one flag of a 65,536-entry table (numpy's scatter: about 1 GB/s of codes here, where
    `bincount` widens every code to int64 first: 0.3-0.65 GB/s); a code is present where its row or column
    of the table holds a flag. An odd last byte is marked on its own."""
    import numpy as np

    codes = np.frombuffer(data, dtype=np.uint8)
    pairs = np.zeros(1 << 16, dtype=bool)
    even = len(codes) - len(codes) % 2
    for start in range(0, even, _PRESENCE_SLICE):
        pairs[codes[start : min(start + _PRESENCE_SLICE, even)].view(np.uint16)] = True
    table = pairs.reshape(256, 256)  # [high byte, low byte] of each little- or big-endian pair alike
    present = np.logical_or(table.any(axis=0), table.any(axis=1))
    if even < len(codes):
        present[codes[-1]] = True
    return [int(c) for c in present.nonzero()[0]]


def f32(x: float) -> float:
    """`x` rounded to float32 (to nearest even), as torch's float32 arithmetic rounds each result.

    Products and quotients of two float32 values are computed exactly enough in float64
    (53 >= 2 * 24 + 2 bits) that rounding them once more to float32 is the float32 result.
    """
    return float(_F32.unpack(_F32.pack(x))[0])


def _to_fp8(value: float, dtype: str) -> int:
    """The code a float32 `value` (already within the clamp) casts to, as torch casts: the nearest code,
    ties to even, and a negative value that rounds to zero is -0 (0x80) in e4m3fn (e4m3fnuz has no -0)."""
    code = nearest_code(value, dtype)
    return 0x80 if code == 0 and dtype == E4M3FN and math.copysign(1.0, value) < 0 else code


@cache
def requantize_map(dtype: str, scale: float, target_scale: float, out_dtype: str) -> RequantizeMap:
    """The byte map of requantizing `dtype` codes at `scale` into `out_dtype` at `target_scale`:
    dequantize in float32, divide by the target scale, clamp (+-448 for e4m3fn, +-224 for
    e4m3fnuz, as vLLM's ROCm kernels do), round to nearest even."""
    limit = REQUANT_CLAMP[out_dtype]
    s, t = f32(scale), f32(target_scale)
    codes, errors, steps = bytearray(range(256)), [0.0] * 256, [0.0] * 256
    for c in range(256):
        source = e4m3_value(c, dtype)
        if math.isnan(source):
            continue
        value = f32(source * s)
        exact = min(max(f32(value / t), -limit), limit)
        code = _to_fp8(exact, out_dtype)
        out = e4m3_value(code, out_dtype)
        codes[c] = code
        errors[c] = abs(f32(f32(out * t) - value))
        steps[c] = f32(abs(f32(out - exact)) / step_at(exact, out_dtype))
    return RequantizeMap(bytes(codes), tuple(errors), tuple(steps))


def requantize(
    codes: bytes | bytearray, dtype: str, scale: float, target_scale: float, out_dtype: str | None = None
) -> tuple[bytes | bytearray, RoundingStats]:
    """Re-express FP8 `codes` (`dtype`, at `scale`) in `out_dtype` at `target_scale`; return the new
    codes and the worst error against the float32 source value (see `requantize_map`)."""
    table = requantize_map(dtype, scale, target_scale, out_dtype or dtype)
    return codes.translate(table.codes), table.worst(codes)

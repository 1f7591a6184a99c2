"""Dequantizing block-scaled FP8 codes to BF16: `convert --tp N --tp-bf16` for modules no padding can fix.

A code times its block scale is exact in float64 (4 significant bits times 24), so each
output value is that product rounded once, to nearest even, to BF16's 8 significant bits:
the only error is that one rounding, at most half a BF16 step (2^-8 of the value at most). A
column block shares one scale, so each block's 256 possible values are worked out once
(a table per block, vectorized over a block row's scales with numpy) and the codes are
looked up. No torch: the values are bit patterns made with integer arithmetic.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fp8fix.numerics.fp8 import e4m3_value
from fp8fix.numerics.requantize import RoundingStats

#: The dtype dequantized weights are written in.
BF16 = "BF16"
#: float64 keeps 52 fraction bits, BF16 7: the bits a rounding to BF16 drops.
_DROPPED_BITS = 52 - 7
#: The smallest normal BF16 (and float32) magnitude: below it BF16 keeps fewer bits, which fp8fix refuses.
_MIN_NORMAL = 2.0**-126


@cache
def code_values(dtype: str) -> Any:
    """The 256 codes' values in float64 (NaN codes: NaN; they are refused before any lookup)."""
    import numpy as np

    return np.array([e4m3_value(c, dtype) for c in range(256)], dtype=np.float64)


def round_to_bf16(exact: Any) -> Any:
    """float64 values rounded to nearest even at BF16's precision, still as float64; raises ValueError
    for a non-zero result outside BF16's normal range (a scale too small or too large to keep)."""
    import numpy as np

    bits = np.ascontiguousarray(exact, dtype=np.float64).view(np.uint64)
    lsb = (bits >> np.uint64(_DROPPED_BITS)) & np.uint64(1)
    bits = (bits + np.uint64((1 << (_DROPPED_BITS - 1)) - 1) + lsb) & ~np.uint64((1 << _DROPPED_BITS) - 1)
    rounded = bits.view(np.float64)
    magnitude = np.abs(rounded[np.isfinite(exact)])
    if np.any((magnitude != 0) & ((magnitude < _MIN_NORMAL) | (magnitude > np.finfo(np.float32).max))):
        raise ValueError("a dequantized value falls outside BF16's normal range")
    return rounded


def bf16_step(values: Any) -> Any:
    """The BF16 step (distance to the next BF16 value away from zero) at each float64 value."""
    import numpy as np

    _, exponent = np.frexp(values)
    return np.ldexp(1.0, exponent - 8)


def bf16_bits(rounded: Any) -> Any:
    """BF16 bit patterns (uint16) of float64 values already rounded to BF16 (`round_to_bf16`)."""
    import numpy as np

    return (rounded.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def dequantize_rows(
    codes: bytes | bytearray, dtype: str, cols: int, block_cols: int, scales: tuple[float, ...]
) -> tuple[bytes, RoundingStats]:
    """Rows of `cols` FP8 codes, column block c (of `block_cols` codes) at `scales[c]`, as little-endian
    BF16 bytes; and the worst rounding error among the codes present."""
    import numpy as np

    values = code_values(dtype)
    exact = np.asarray(scales, dtype=np.float64)[:, None] * values[None, :]  # one 256-entry table per block
    rounded = round_to_bf16(exact)
    errors = np.abs(rounded - exact)
    steps = errors / bf16_step(exact)  # the step at 0 is 2^-8, not 0: no division by zero
    tables = bf16_bits(rounded)
    grid = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    column_block = np.arange(cols) // block_cols
    out = tables[column_block[None, :], grid]
    present = np.zeros(tables.shape, dtype=bool)
    present[column_block[None, :], grid] = True
    stats = RoundingStats(float(errors[present].max(initial=0.0)), float(steps[present].max(initial=0.0)))
    return out.astype("<u2").tobytes(), stats

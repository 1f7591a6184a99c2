"""MXFP8 rows re-blocked as 128 x 128 block FP8, for runtimes without MX kernels (Hopper, MI300; issue 49).

An MXFP8 weight [R, C] has one E8M0 byte b per 32 elements of a row; block FP8 one scale per 128 x 128 block.
Each block gets the power of two p = 2^k, the smallest that holds its largest value (k the least with
amax <= 448 p): nothing clips, and no finer power of two holds the block. Each element then becomes its value
code x 2^(b - 127) over p, rounded once to nearest even on the e4m3fn grid. That is code x 2^d, d =
(b - 127) - k, so the new code depends on the code and d only: one 256-code table per d, worked out once, and
every element is a lookup.

Where a block's 512 scale bytes are equal, every element's d is the same and at least 0 (p holds the block's
largest code at that scale, so it is no larger than the scale): every code is scaled up by a power of two that
still holds the largest, exactly. Where they differ, the elements of smaller scale move down by 2^d and round
where that leaves e4m3fn's finest step (2^-9): each by at most half an e4m3fn step at p. Both are counted
(`ReblockStats`), never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.numerics.mx import E8M0_BIAS, MX_BLOCK
from fp8fix.numerics.ue8m0 import encode_e4m3fn, round_to_e4m3fn, smallest_holding

#: The block FP8 of Hopper and MI300 runtimes (DeepSeek-V3, Qwen3 FP8): 128 x 128.
BLOCK = 128
#: The shifts d a table is kept for: below D_MIN every e4m3fn value rounds to zero (448 x 2^-20 < 2^-10, half the
#: finest step); above D_MAX no code fits under the block's power of two (2^-9 x 2^18 > 448).
D_MIN, D_MAX = -20, 17


@dataclass
class ReblockStats:
    """Per weight: blocks whose every value was kept, blocks with a value that rounded, values that rounded,
    and the largest rounding in e4m3fn steps at the new scale (at most 0.5) and in value."""

    blocks_exact: int = 0
    blocks_rounded: int = 0
    values_rounded: int = 0
    max_steps: float = 0.0
    max_abs: float = 0.0

    def update(self, other: ReblockStats) -> None:
        self.blocks_exact += other.blocks_exact
        self.blocks_rounded += other.blocks_rounded
        self.values_rounded += other.values_rounded
        self.max_steps = max(self.max_steps, other.max_steps)
        self.max_abs = max(self.max_abs, other.max_abs)


@dataclass
class ReblockedRows:
    """Rows of one block row re-blocked: the new codes, each 128-column block's exponent k (scale 2^k), and
    the statistics."""

    codes: bytes
    exponents: list[int]
    stats: ReblockStats = field(default_factory=ReblockStats)


@cache
def shift_tables() -> tuple[Any, Any, Any]:
    """(codes, errors, steps): at (d - D_MIN) << 8 | code, the e4m3fn code of code x 2^d rounded once to
    nearest even, how far that moved it (in units of the block's scale), and that in e4m3fn steps at the
    rounded value (0 where exact; NaN codes map to 0: they are refused before any lookup)."""
    import numpy as np

    values = np.nan_to_num(code_values(E4M3FN), nan=0.0)
    shifts = np.arange(D_MIN, D_MAX + 1)
    exact = np.ldexp(values[None, :], shifts[:, None])  # exact in float64
    rounded = round_to_e4m3fn(exact)
    errors = np.abs(rounded - exact)
    _, exponent = np.frexp(np.abs(rounded))
    steps = errors / np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)  # e4m3fn's step at the rounded value
    return encode_e4m3fn(rounded).astype(np.uint8).reshape(-1), errors.reshape(-1), steps.reshape(-1)


def reblock_rows(
    codes: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview, cols: int
) -> ReblockedRows:
    """At most BLOCK rows of `cols` e4m3fn codes (one block row) and their E8M0 bytes ([rows, cols / 32]) as
    codes at one power of two per 128-column block (the last block may be narrower, as block grids round up).
    The caller refuses NaN codes and NaN scale bytes first."""
    import numpy as np

    grid = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    rows, subs = grid.shape[0], cols // MX_BLOCK
    if rows > BLOCK or cols % MX_BLOCK or len(scales) != rows * subs:
        raise ValueError(f"{rows} x {cols} codes with {len(scales)} scale bytes are not one MX block row")
    sub = grid.reshape(rows, subs, MX_BLOCK)
    exponents = np.frombuffer(scales, dtype=np.uint8).reshape(rows, subs).astype(np.int32) - E8M0_BIAS
    per_block = BLOCK // MX_BLOCK
    blocks = -(-subs // per_block)
    pad = ((0, 0), (0, blocks * per_block - subs))
    # each sub-block's largest magnitude (e4m3fn codes order as their magnitudes), then each block's
    sub_amax = np.ldexp(_magnitudes()[np.bitwise_and(sub, 0x7F).max(axis=2)], exponents)
    amax = np.pad(sub_amax, pad).reshape(rows, blocks, per_block).max(axis=(0, 2))
    largest = np.pad(exponents, pad, constant_values=-(2**20)).reshape(rows, blocks, per_block).max(axis=(0, 2))
    k = np.where(amax > 0, smallest_holding(np.where(amax > 0, amax, 1.0)), largest)
    shift = np.clip(exponents - np.repeat(k, per_block)[:subs][None, :], D_MIN, D_MAX)
    index = np.bitwise_or(np.left_shift((shift - D_MIN).astype(np.uint16), 8)[:, :, None], sub, dtype=np.uint16)
    table, errors, steps = shift_tables()
    new = np.take(table, index, mode="clip")
    # the statistics from the few values that round: a flag per element from a byte table, then only those
    flags = np.take(lossy_table(), index, mode="clip").reshape(rows, cols)
    rounded_blocks = np.pad(flags.reshape(rows, subs, MX_BLOCK).any(axis=(0, 2)), pad[1]).reshape(blocks, -1).any(1)
    stats = ReblockStats(blocks_exact=blocks - int(rounded_blocks.sum()), blocks_rounded=int(rounded_blocks.sum()))
    if stats.blocks_rounded:
        where = np.nonzero(flags)
        moved = index.reshape(rows, cols)[where]
        stats.values_rounded = int(moved.size)
        stats.max_steps = float(steps[moved].max())
        stats.max_abs = float((errors[moved] * np.ldexp(1.0, k[where[1] // BLOCK])).max())
    return ReblockedRows(new.tobytes(), [int(e) for e in k], stats)


@cache
def lossy_table() -> Any:
    """uint8, at (d - D_MIN) << 8 | code: 1 where code x 2^d rounds (`shift_tables`), else 0."""
    import numpy as np

    return (shift_tables()[2] > 0).astype(np.uint8)


@cache
def _magnitudes() -> Any:
    import numpy as np

    return np.abs(np.nan_to_num(code_values(E4M3FN), nan=0.0))

"""Block scales as powers of two (UE8M0), for DeepGEMM on Hopper / Blackwell: `convert --scales ue8m0`.

DeepGEMM's FP8 kernels take block scales as bare exponents. vLLM 0.32 requantizes every FP32 block
scale to one at load where DeepGEMM runs (`deepgemm_post_process_fp8_weight_block` ->
`requant_weight_ue8m0_inplace`: dequantize the block in float32, new scale the power of two at or above
amax / 448, divide, cast): two roundings, each load. Done once offline, per block of codes at scale s:

- s a power of two: the block keeps its codes and its scale, byte for byte;
- else its values v = code x s (exact in float64) are requantized once, to nearest even, at one of two
  powers of two: p, the smallest that holds the block's largest value (never clips; vLLM's choice), or
  p / 2 (twice the resolution below 2^-6 p, but the values above 224 p clip to 448 p / 2). The one with
  the smaller squared error over the block wins, ties to p. Any larger power of two is a coarser grid that
  holds nothing p does not (its values are p's), so no block is worse than at p, and p's rounding is
  exact where vLLM's float32 product rounds first: no block is worse than vLLM's.

Everything is vectorized per block row with numpy: one 256-entry table per block and candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN

#: The largest e4m3fn magnitude: vLLM's fp8 max, and where p / 2 clips.
FP8_MAX = 448.0
#: vLLM clamps a block's amax to at least this before dividing by 448 (deep_gemm.per_block_cast_to_fp8).
VLLM_AMAX_FLOOR = 1e-4
#: Squared-error sums closer than this (relative) are compared again in exact rational arithmetic.
_NEAR_TIE = 1e-9


@dataclass
class Ue8m0Stats:
    """Per weight: blocks kept and requantized; the error of every element against its source value,
    in fp8 steps of the SOURCE grid at that value (so fp8fix's and vLLM's figures share a yardstick)."""

    blocks_kept: int = 0
    blocks_requantized: int = 0
    blocks_halved: int = 0  # requantized at p / 2 (clipping the top for finer small values)
    elements: int = 0
    max_steps: float = 0.0
    sum_sq_steps: float = 0.0
    vllm_max_steps: float = 0.0
    vllm_sum_sq_steps: float = 0.0
    vllm_clamped_blocks: int = 0  # blocks whose amax is under vLLM's 1e-4 floor: vLLM coarsens them

    def update(self, other: Ue8m0Stats) -> None:
        for name in ("blocks_kept", "blocks_requantized", "blocks_halved", "elements", "vllm_clamped_blocks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sum_sq_steps += other.sum_sq_steps
        self.vllm_sum_sq_steps += other.vllm_sum_sq_steps
        self.max_steps = max(self.max_steps, other.max_steps)
        self.vllm_max_steps = max(self.vllm_max_steps, other.vllm_max_steps)

    @property
    def rms_steps(self) -> float:
        return (self.sum_sq_steps / self.elements) ** 0.5 if self.elements else 0.0

    @property
    def vllm_rms_steps(self) -> float:
        return (self.vllm_sum_sq_steps / self.elements) ** 0.5 if self.elements else 0.0


@dataclass
class BlockRow:
    """One row of blocks converted: the new codes, each block's power-of-two exponent, the statistics."""

    codes: bytes
    exponents: list[int]
    stats: Ue8m0Stats = field(default_factory=Ue8m0Stats)


def is_power_of_two(values: Any) -> Any:
    import numpy as np

    mantissa, _ = np.frexp(values)
    return (values > 0) & (mantissa == 0.5)


def round_to_e4m3fn(x: Any) -> Any:
    """float64 values rounded to nearest even on the e4m3fn grid, saturating at +-448; -0 kept as -0."""
    import numpy as np

    a = np.minimum(np.abs(x), FP8_MAX)
    _, exponent = np.frexp(a)  # a = m 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
    step = np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)
    return np.copysign(np.minimum(np.rint(a / step) * step, FP8_MAX), x)


def encode_e4m3fn(values: Any) -> Any:
    """The e4m3fn codes (uint8) of values already on its grid (`round_to_e4m3fn`); -0 is 0x80."""
    import numpy as np

    magnitudes = code_values(E4M3FN)[:0x7F]  # 0x00..0x7E ascend
    codes = np.searchsorted(magnitudes, np.abs(values)).astype(np.uint8)
    return codes | np.where(np.signbit(values), np.uint8(0x80), np.uint8(0))


def smallest_holding(amax: Any) -> Any:
    """Per block, the exponent k of the smallest power of two with amax <= 448 x 2^k (exact)."""
    import numpy as np

    _, e = np.frexp(amax / FP8_MAX)  # amax / 448 in [2^(e-1), 2^e), up to the division's rounding
    k = e - 1
    return np.where(amax <= FP8_MAX * np.ldexp(1.0, k), k, k + 1)


def source_steps(dtype: str) -> Any:
    """The fp8 step at each code's value (code units): the yardstick of the errors."""
    import numpy as np

    values = np.abs(code_values(dtype))
    _, exponent = np.frexp(np.where(np.isfinite(values), values, 1.0))
    return np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)


def ue8m0_rows(
    codes: bytes | bytearray, dtype: str, cols: int, block_cols: int, scales: Any, vllm: bool = True
) -> BlockRow:
    """Rows of `cols` codes (one block row), column block c at `scales[c]`, with every scale a power of two.
    `vllm`: work out vLLM's load-time requantization of the same blocks too (its figures in the statistics;
    `--scales ue8m0` compares, `--blocks mx` does not: where every scale is a power of two already, the row is
    then returned as it is, without a pass over its codes)."""
    import numpy as np

    s = np.asarray(scales, dtype=np.float64)
    blocks = len(s)
    if not vllm and is_power_of_two(s).all():
        powers = [int(e) - 1 for e in np.frexp(s)[1]]
        return BlockRow(bytes(codes), powers, Ue8m0Stats(blocks_kept=blocks, elements=len(codes)))
    grid = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    block_of = np.arange(cols) // block_cols
    values = code_values(dtype)
    index = np.left_shift(block_of.astype(np.int32), 8)[None, :] | grid  # block << 8 | code, per element
    counts = np.bincount(index.ravel(), minlength=blocks * 256).reshape(blocks, 256)
    present = counts > 0
    exact = s[:, None] * values[None, :]  # [blocks, 256]: each code's exact value in each block
    safe = np.where(present, np.abs(exact), 0.0)
    amax = safe.max(axis=1)
    kept = is_power_of_two(s)
    k = np.where(amax > 0, smallest_holding(np.where(amax > 0, amax, 1.0)), np.ceil(np.log2(s)).astype(int))
    k = np.where(kept, np.frexp(s)[1] - 1, k)
    tables, errors = {}, {}
    for shift in (0, 1):  # p = 2^k, then p / 2
        p = np.ldexp(1.0, k - shift)[:, None]
        new = round_to_e4m3fn(np.where(present, exact, 0.0) / p)
        tables[shift], errors[shift] = new, np.where(present, np.abs(new * p - exact), 0.0)
    sums = {shift: (counts * errors[shift] ** 2).sum(axis=1) for shift in (0, 1)}
    halve = (sums[1] < sums[0]) & ~kept
    near = ~kept & (np.abs(sums[1] - sums[0]) <= _NEAR_TIE * np.maximum(sums[0], sums[1]))
    for b in np.nonzero(near)[0]:
        halve[b] = _exact_sum(counts[b], exact[b], tables[1][b], k[b] - 1) < _exact_sum(
            counts[b], exact[b], tables[0][b], k[b]
        )
    chosen = np.where(halve[:, None], tables[1], tables[0])
    table = np.where(kept[:, None], np.arange(256, dtype=np.uint8)[None, :], encode_e4m3fn(chosen))
    new_codes = np.take(table.reshape(-1).astype(np.uint8), index)
    exponents = np.where(halve, k - 1, k)
    # errors in source fp8 steps at each value
    steps_unit = source_steps(dtype)[None, :] * s[:, None]
    err = np.where(halve[:, None], errors[1], errors[0])
    err = np.where(kept[:, None], 0.0, err) / steps_unit
    vllm_err = _vllm_errors(s, values, present, dtype) / steps_unit if vllm else np.zeros_like(err)
    stats = Ue8m0Stats(
        blocks_kept=int(kept.sum()),
        blocks_requantized=int((~kept).sum()),
        blocks_halved=int(halve.sum()),
        elements=int(counts.sum()),
        max_steps=float(np.where(present, err, 0.0).max(initial=0.0)),
        sum_sq_steps=float((counts * err**2).sum()),
        vllm_max_steps=float(np.where(present, vllm_err, 0.0).max(initial=0.0)),
        vllm_sum_sq_steps=float((counts * np.where(present, vllm_err, 0.0) ** 2).sum()),
        vllm_clamped_blocks=int(((amax > 0) & (amax < VLLM_AMAX_FLOOR)).sum()) if vllm else 0,
    )
    return BlockRow(new_codes.tobytes(), [int(e) for e in exponents], stats)


def vllm_requantized(scales: Any, values: Any, present: Any) -> tuple[Any, Any]:
    """vLLM 0.32's `requant_weight_ue8m0_inplace` on blocks at `scales`, per (block, code): the block's new
    power of two and each code's new value (code units), as its float32 torch arithmetic computes them:
    the product in float32, amax clamped to 1e-4, 2^ceil(log2(amax / 448)), divide, round to nearest even."""
    import numpy as np

    s32 = np.asarray(scales, dtype=np.float32)
    product = s32[:, None] * values[None, :].astype(np.float32)  # float32 products, rounded once each
    product = np.where(present, product, np.float32(0))
    amax = np.maximum(np.abs(product).max(axis=1), np.float32(VLLM_AMAX_FLOOR))
    sf = np.exp2(np.ceil(np.log2(amax / np.float32(FP8_MAX)))).astype(np.float32)
    new = round_to_e4m3fn((product * (np.float32(1) / sf)[:, None]).astype(np.float64))
    return sf.astype(np.float64), new


def _vllm_errors(s: Any, values: Any, present: Any, dtype: str) -> Any:
    """|vLLM's requantized value - the exact value| per (block, code)."""
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):  # vLLM's float32 product overflows at huge scales
        sf, new = vllm_requantized(s, values, present)
        errors = np.abs(new * sf[:, None] - s[:, None] * values[None, :])
    # where vLLM's arithmetic overflowed, its weights are not finite: an infinite error
    return np.where(present, np.where(np.isfinite(errors), errors, np.inf), 0.0)


def _exact_sum(counts: Any, exact: Any, new: Any, exponent: int) -> Fraction:
    """The block's squared error in exact arithmetic (near ties of the float64 sums). Each difference is exact in
    float64 (a value of 4 significant bits at 2^k less one of at most 28 near it), so it is an integer over a power
    of two: the squares are summed as integers over the largest such power, one Fraction in all."""
    import math

    import numpy as np

    terms = []
    for code in np.flatnonzero(counts):
        numerator, denominator = (math.ldexp(float(new[code]), int(exponent)) - float(exact[code])).as_integer_ratio()
        terms.append((int(counts[code]), numerator, denominator.bit_length() - 1))
    top = max((shift for _, _, shift in terms), default=0)
    return Fraction(sum(count * (n << (top - shift)) ** 2 for count, n, shift in terms), 1 << (2 * top))

"""MXFP8 rows re-blocked as 128 x 128 block FP8 (fp8fix/numerics/mx_blocks.py, issue 49), against a computation
written here: each element's value from the OCP MX spec decoders (tests/test_mx_numerics.py), each block's power
of two the smallest holding its largest value (worked out with Python floats), each new code torch's own
round-to-nearest-even cast of value / p to float8_e4m3fn. Equal scale bytes in a block keep every value; mixed
ones round within half a step, and the counts say which."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fp8fix.numerics.mx_blocks import BLOCK, reblock_rows
from tests.test_mx_numerics import spec_e4m3, spec_e8m0


def mx_rows(rows: int, cols: int, spread: int, seed: int) -> tuple[bytes, bytes]:
    """Random e4m3fn codes (no NaN) and E8M0 bytes around 2^-7, `spread` apart at most within a row block."""
    rng = random.Random(seed)
    codes = bytes(rng.choice([c for c in range(256) if c & 0x7F != 0x7F]) for _ in range(rows * cols))
    base = rng.randrange(110, 130)
    scales = bytes(base + rng.randrange(spread + 1) for _ in range(rows * cols // 32))
    return codes, scales


def expected(codes: bytes, scales: bytes, rows: int, cols: int) -> tuple[list[int], list[int], list[float]]:
    """(new codes, each block's exponent k, each element's exact value / 2^k), computed independently."""
    values = [
        [spec_e4m3(codes[r * cols + c]) * spec_e8m0(scales[(r * cols + c) // 32]) for c in range(cols)]
        for r in range(rows)
    ]
    exponents = []
    for b in range(-(-cols // BLOCK)):
        span = range(b * BLOCK, min(cols, (b + 1) * BLOCK))
        amax = max(abs(values[r][c]) for r in range(rows) for c in span)
        if amax == 0:
            exponents.append(max(scales[(r * cols + c) // 32] for r in range(rows) for c in span) - 127)
            continue
        k = math.ceil(math.log2(amax / 448))
        while amax <= 448 * 2.0 ** (k - 1):  # the smallest power of two that holds it
            k -= 1
        while amax > 448 * 2.0**k:
            k += 1
        exponents.append(k)
    scaled = [values[r][c] / 2.0 ** exponents[c // BLOCK] for r in range(rows) for c in range(cols)]
    new = torch.tensor(scaled, dtype=torch.float64).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    return new, exponents, scaled


@pytest.mark.parametrize(("rows", "cols"), [(128, 256), (100, 160), (1, 32)])
@pytest.mark.parametrize("spread", [0, 1, 6, 40])
def test_each_code_is_the_value_rounded_once_at_the_block_power_of_two(rows: int, cols: int, spread: int) -> None:
    codes, scales = mx_rows(rows, cols, spread, seed=rows + cols + spread)
    got = reblock_rows(codes, scales, cols)
    new, exponents, scaled = expected(codes, scales, rows, cols)
    assert got.exponents == exponents
    assert list(got.codes) == new
    kept = [spec_e4m3(c) == v for c, v in zip(new, scaled, strict=True)]
    assert got.stats.values_rounded == kept.count(False)
    blocks = -(-cols // BLOCK)
    rounded_blocks = {i % cols // BLOCK for i, k in enumerate(kept) if not k}
    assert got.stats.blocks_rounded == len(rounded_blocks) and got.stats.blocks_exact == blocks - len(rounded_blocks)
    assert got.stats.max_steps <= 0.5
    if spread == 0:  # one scale byte per row block: every value kept
        assert got.stats.values_rounded == 0 and got.stats.max_abs == 0


def test_equal_scales_keep_every_value_even_with_small_codes() -> None:
    """A block of small codes gets a finer power of two than its scale: its codes scale up, exactly."""
    codes = bytes([0x01, 0x09, 0x30, 0x81] * 8 * 4)  # 1 x 128, largest 0x30 = 2^-1: held by 448 x 2^-9
    got = reblock_rows(codes, bytes([127] * 4), 128)
    assert got.exponents == [-9] and got.stats.values_rounded == 0
    assert [spec_e4m3(c) * 2.0**-9 for c in got.codes] == [spec_e4m3(c) for c in codes]


def test_zero_blocks_stay_zero() -> None:
    got = reblock_rows(bytes([0x00, 0x80] * 64), bytes([120, 130, 125, 121]), 128)
    assert list(got.codes) == [0x00, 0x80] * 64 and got.exponents == [3]


def test_rows_that_are_not_one_block_row_are_refused() -> None:
    with pytest.raises(ValueError):
        reblock_rows(bytes(129 * 32), bytes(129), 32)
    with pytest.raises(ValueError):
        reblock_rows(bytes(48), bytes(1), 48)

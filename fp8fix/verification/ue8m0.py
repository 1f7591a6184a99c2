"""Verifying `--scales ue8m0`: block-scaled weights OUTPUT holds at power-of-two block scales.

Read off OUTPUT: a SOURCE block-scaled FP8 weight whose OUTPUT block scales are all powers of two where
SOURCE's are not. For each block, with SOURCE's values v (code x scale, exact in float64) and OUTPUT's
scale p:
- SOURCE's scale a power of two: OUTPUT holds the same values (the codes kept);
- else p is the smallest power of two that holds the block's largest value (p_v), or half of it where
  that makes the block's squared error smaller (ties: p_v), both worked out here again; and every code is
  v / p rounded to nearest even on the e4m3fn grid (here: the nearest of the sorted code values, ties to
  the even code; numerics.ue8m0 rounds with frexp / rint), saturated at 448.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fp8fix.model import Fp8Weight
from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ, FP8_WEIGHT_DTYPES
from fp8fix.verification.context import Mismatch, VerifyContext, scale_values
from fp8fix.verification.report import WeightCheck


def ue8m0_weights(ctx: VerifyContext) -> dict[str, Fp8Weight]:
    """SOURCE's block-scaled weights whose OUTPUT block scales are all powers of two, and SOURCE's not."""
    block = ctx.fmt.block
    found: dict[str, Fp8Weight] = {}
    if block is None:
        return found
    for w in ctx.model.module_weights():
        o = ctx.out.tensors.get(w.name)
        if w.scale_kind != "block" or w.stacked or w.scale is None or o is None or o.dtype not in FP8_WEIGHT_DTYPES:
            continue
        out_scale = ctx.out.tensors.get(w.scale.name)
        if out_scale is None or out_scale.shape != w.scale.shape:
            continue
        try:
            source, output = scale_values(w.scale, "SOURCE"), scale_values(out_scale, "OUTPUT")
        except Mismatch:
            continue  # the value check reports it
        if all(power_of_two(x) for x in output) and not all(power_of_two(x) for x in source):
            found[w.name] = w
    return found


def power_of_two(x: float) -> bool:
    return x > 0 and float(np.frexp(x)[0]) == 0.5


def check_ue8m0(ctx: VerifyContext, weight: Fp8Weight) -> WeightCheck:
    """Every block of the weight as the module docstring says."""
    assert weight.scale is not None
    out_scale = ctx.out.tensors[weight.scale.name]

    def grid() -> BlockScales:
        out_grid = np.asarray(scale_values(out_scale, "OUTPUT")).reshape(out_scale.shape)
        return lambda grid_row, row, stop: out_grid[grid_row]

    return check_power_of_two_blocks(ctx, weight, grid)


#: OUTPUT's scale of each column block of the rows [row, stop) in grid row `grid_row`.
BlockScales = Callable[[int, int, int], Any]


def check_power_of_two_blocks(ctx: VerifyContext, weight: Fp8Weight, scales: Callable[[], BlockScales]) -> WeightCheck:
    """Every block of a block-scaled weight of SOURCE at the power of two OUTPUT gives it (`scales`, made once
    the shapes are checked; raising Mismatch where OUTPUT's scales are not one per block), as `check_block`
    says: `--scales ue8m0` and `--blocks mx` (`block_mx`) write the same values."""
    name, t = weight.name, weight.tensor
    o = ctx.out.tensors[name]
    check = WeightCheck(name, [name], "exact")  # "requantized" once a block is (SOURCE's scale no power of two)
    assert weight.scale is not None and ctx.fmt.block is not None
    b0, b1 = ctx.fmt.block
    try:
        if o.shape != t.shape:
            raise Mismatch(f"'{name}' is {list(o.shape)}, expected SOURCE's shape {list(t.shape)}")
        rows, cols = t.shape
        src_grid = np.asarray(scale_values(weight.scale, "SOURCE")).reshape(-1, -(-cols // b1))  # [1, 1]: one block
        out_scales = scales()
        fused = weight.fused
        row = 0
        while row < rows:  # runs of rows in one row of the grid (pre-sharded chunks restart it)
            grid_row = fused.scale_row(row, b0) if fused else row // b0
            stop = min(rows, fused.next_block_start(row, b0) if fused else (row // b0 + 1) * b0)
            src_codes = np.frombuffer(ctx.read_rows(t, row, stop, cols), dtype=np.uint8).reshape(-1, cols)
            out_codes = np.frombuffer(ctx.read_rows(o, row, stop, cols), dtype=np.uint8).reshape(-1, cols)
            out_row = out_scales(grid_row, row, stop)
            for c in range(src_grid.shape[1]):
                block = (slice(None), slice(c * b1, min(cols, (c + 1) * b1)))
                error, steps = check_block(
                    src_codes[block], t.dtype, float(src_grid[grid_row, c]),
                    out_codes[block], o.dtype, float(out_row[c]),
                    f"'{name}' block row {grid_row} column block {c}",
                )  # fmt: skip
                check.max_error_steps = max(check.max_error_steps, steps)
                check.max_error = max(check.max_error, error)
                if not power_of_two(float(src_grid[grid_row, c])):
                    check.grade("requantized")
            row = stop
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def check_block(
    src: Any, src_dtype: str, s: float, out: Any, out_dtype: str, p: float, where: str
) -> tuple[float, float]:
    """One block; returns its worst error, in value and in fp8 steps at the new scale."""
    v = code_values(src_dtype)[src].astype(np.float64) * s
    got = code_values(out_dtype)[out].astype(np.float64) * p
    if out_dtype == E4M3FNUZ:  # the same bits are worth half in e4m3fnuz: the e4m3fn scale is half of p
        p /= 2
    if not np.isfinite(got).all():
        raise Mismatch(f"{where}: NaN codes in OUTPUT")
    if power_of_two(s):
        if not np.array_equal(got, v):
            raise Mismatch(f"{where}: SOURCE's scale is a power of two, so its values must be kept; they changed")
        return 0.0, 0.0
    amax = float(np.abs(v).max(initial=0.0))
    holding = smallest_holding(amax) if amax > 0 else None
    candidates = [holding, holding / 2] if holding is not None else [p]
    if p not in candidates:
        raise Mismatch(
            f"{where}: scale {p!r} is neither {holding!r}, the smallest power of two that holds the block's "
            f"largest value ({amax!r}), nor half of it"
        )
    errors = {q: float(((nearest_e4m3fn(v / q) * q - v) ** 2).sum()) for q in candidates}
    if len(candidates) == 2 and p == candidates[1] and not errors[candidates[1]] < errors[candidates[0]]:
        raise Mismatch(f"{where}: scale {p!r} (half of {holding!r}) has no smaller squared error than {holding!r}")
    expected = nearest_e4m3fn(v / p) * p
    if not np.array_equal(np.abs(got), np.abs(expected)) or np.any((got != 0) & (np.sign(got) != np.sign(v))):
        r, c = (int(i) for i in np.argwhere(np.abs(got) != np.abs(expected))[0])
        raise Mismatch(
            f"{where} row {r} column {c}: {got[r, c]!r}, expected SOURCE's value {v[r, c]!r} rounded to nearest "
            f"even at scale {p!r} ({expected[r, c]!r})"
        )
    step = e4m3fn_steps(np.abs(expected) / p) * p
    error = np.abs(got - v)
    return float(error.max(initial=0.0)), float((error / step).max(initial=0.0))


def smallest_holding(amax: float) -> float:
    """The smallest power of two p with amax <= 448 p."""
    p = 2.0 ** int(np.ceil(np.log2(amax / 448.0)))
    while amax > 448.0 * p:
        p *= 2
    while amax <= 448.0 * (p / 2):
        p /= 2
    return p


def nearest_e4m3fn(x: Any) -> Any:
    """Each value's nearest e4m3fn value, ties to the even code, saturating at 448 (sorted-table search)."""
    table = np.abs(code_values(E4M3FN)[:0x7F])  # codes 0x00..0x7E, ascending
    a = np.minimum(np.abs(x), table[-1])
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    below, above = a - table[lo], table[hi] - a
    pick_lo = (below < above) | ((below == above) & (lo % 2 == 0))
    return np.copysign(np.where(pick_lo, table[lo], table[hi]), x)


def e4m3fn_steps(codes: Any) -> Any:
    """The e4m3fn step at each magnitude (code units)."""
    _, exponent = np.frexp(np.where(codes > 0, codes, 1.0))
    return np.ldexp(1.0, np.maximum(exponent - 1, -6) - 3)

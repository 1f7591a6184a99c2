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
from fractions import Fraction
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
    the shapes are checked; raising Mismatch where OUTPUT's scales are not one per block), as `check_block_row`
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
            out_row = np.asarray(out_scales(grid_row, row, stop), dtype=np.float64)
            error, steps = check_block_row(
                src_codes, t.dtype, src_grid[grid_row].astype(np.float64), out_codes, o.dtype, out_row, b1,
                f"'{name}' block row {grid_row}",
            )  # fmt: skip
            check.max_error_steps = max(check.max_error_steps, steps)
            check.max_error = max(check.max_error, error)
            if not all(power_of_two(float(x)) for x in src_grid[grid_row]):
                check.grade("requantized")
            row = stop
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def check_block_row(
    src: Any, src_dtype: str, scales: Any, out: Any, out_dtype: str, powers: Any, block_cols: int, where: str
) -> tuple[float, float]:
    """One row of blocks (SOURCE's codes `src` [rows, cols] at `scales`, one per column block of `block_cols`;
    OUTPUT's `out` at `powers`) as the module docstring says; its worst error, in value and in fp8 steps at the
    new scale. Worked out per (block, SOURCE code): a block holds at most 256 distinct values, so what each must
    become is found once (`_expected_block`), as the OUTPUT code that holds it; every element is then one lookup
    and one comparison of codes, and only the elements whose codes differ are compared as values (a zero may be
    written either sign)."""
    rows, cols = src.shape
    blocks = len(scales)
    column_block = np.arange(cols) // block_cols
    index = (column_block.astype(np.int64) << 8)[None, :] | src  # (block, code) of every element
    counts = np.bincount(index.ravel(), minlength=blocks * 256).reshape(blocks, 256)
    v = scales[:, None] * code_values(src_dtype).astype(np.float64)[None, :]  # exact: 24 x 4 significant bits
    # in e4m3fnuz the same bits are worth half: the e4m3fn scale of OUTPUT's codes is half its scale
    fn_powers = powers / 2 if out_dtype == E4M3FNUZ else powers
    expected = np.empty_like(v)
    for c in range(blocks):
        present = counts[c] > 0
        expected[c] = _expected_block(v[c], counts[c], present, float(scales[c]), float(fn_powers[c]),
                                      f"{where} column block {c}")  # fmt: skip
    out_values = code_values(out_dtype).astype(np.float64)
    codes = _codes_of(expected / powers[:, None], out_values)  # 256 where no OUTPUT code holds the value
    differ = out != np.take(codes.reshape(-1), index)
    if differ.any():
        r, col = (a.astype(np.int64) for a in np.nonzero(differ))
        got = out_values[out[r, col]] * powers[column_block[col]]
        want, value = expected.reshape(-1)[index[r, col]], v.reshape(-1)[index[r, col]]
        wrong = ~np.isfinite(got) | (np.abs(got) != np.abs(want)) | ((got != 0) & (np.sign(got) != np.sign(value)))
        if wrong.any():
            i = int(np.argmax(wrong))
            c = int(column_block[col[i]])
            at = f"{where} column block {c}"
            if not np.isfinite(got[i]):
                raise Mismatch(f"{at}: NaN codes in OUTPUT")
            if power_of_two(float(scales[c])):
                raise Mismatch(f"{at}: SOURCE's scale is a power of two, so its values must be kept; they changed")
            raise Mismatch(
                f"{at} row {int(r[i])} column {int(col[i]) - c * block_cols}: {got[i]!r}, expected SOURCE's value "
                f"{value[i]!r} rounded to nearest even at scale {float(fn_powers[c])!r} ({want[i]!r})"
            )
    # every element holds its (block, code)'s expected value: the errors are the table's, over present codes
    present = counts > 0
    error = np.where(present, np.abs(expected - v), 0.0)
    p = fn_powers[:, None]
    steps = error / (e4m3fn_steps(np.abs(expected) / p) * p)
    return float(error.max(initial=0.0)), float(np.where(present, steps, 0.0).max(initial=0.0))


def _codes_of(values: Any, table: Any) -> Any:
    """The OUTPUT code (by `table`, its codes' values) holding each of `values` (-0 as the negative zero code),
    256 where none does (a NaN value: the elements then differ and are compared as values)."""
    finite = np.isfinite(table)
    order = np.argsort(np.where(finite, table, np.inf), kind="stable")
    ordered = table[order]
    at = np.clip(np.searchsorted(ordered, values), 0, len(table) - 1)
    found = np.where(ordered[at] == values, order[at], 256)
    negative_zero = (
        int(np.flatnonzero((table == 0) & np.signbit(table))[0]) if ((table == 0) & np.signbit(table)).any() else 0
    )
    return np.where((values == 0) & np.signbit(values), negative_zero, found)


def _expected_block(v: Any, counts: Any, present: Any, s: float, p: float, where: str) -> Any:
    """What each SOURCE code's value `v` of one block must be in OUTPUT at the block's power of two `p`: kept where
    SOURCE's scale `s` is a power of two; else v / p to nearest even, p being the smallest power of two holding the
    block's largest value or half of it where that errs less (squared, over the block's elements)."""
    if power_of_two(s):
        return v
    if not np.isfinite(np.where(present, v, 0.0)).all():
        raise Mismatch(f"{where}: NaN codes in SOURCE")
    amax = float(np.abs(np.where(present, v, 0.0)).max(initial=0.0))
    holding = smallest_holding(amax) if amax > 0 else None
    candidates = [holding, holding / 2] if holding is not None else [p]
    if p not in candidates:
        raise Mismatch(
            f"{where}: scale {p!r} is neither {holding!r}, the smallest power of two that holds the block's "
            f"largest value ({amax!r}), nor half of it"
        )
    if len(candidates) == 2 and p == candidates[1]:
        floats = {q: _squared_error(v, counts, present, q) for q in candidates}
        near = abs(floats[candidates[0]] - floats[candidates[1]]) <= 1e-6 * max(floats.values())
        errors = {q: _squared_error(v, counts, present, q, exact=True) for q in candidates} if near else floats
        if not errors[candidates[1]] < errors[candidates[0]]:
            raise Mismatch(f"{where}: scale {p!r} (half of {holding!r}) has no smaller squared error than {holding!r}")
    return np.where(present, nearest_e4m3fn(np.where(present, v, 0.0) / p) * p, 0.0)


def _squared_error(v: Any, counts: Any, present: Any, q: float, exact: bool = False) -> Any:
    """The block's squared error at scale q: in float64, or `exact` in rationals (where two candidates' float
    sums are too close to tell apart)."""
    new = nearest_e4m3fn(np.where(present, v, 0.0) / q) * q
    if not exact:
        return float((counts * (np.where(present, new - v, 0.0)) ** 2).sum())
    # each difference is exact in float64 (both values are within 28 significant bits of each other's scale):
    # a ratio of integers over a power of two; the squares summed over the largest denominator, in integers
    ratios = [(int(counts[c]), *(float(new[c]) - float(v[c])).as_integer_ratio()) for c in np.flatnonzero(present)]
    common = max((den for _, _, den in ratios), default=1)
    return Fraction(sum(n * (num * (common // den)) ** 2 for n, num, den in ratios), common * common)


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

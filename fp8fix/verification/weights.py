"""Checking FP8 weights by value: every output code must be the source value at the output scale.

Where the output scale is the source's times a power of two (splits, fn <-> fnuz) the
check is a byte map (`numerics.recodings.value_map`); requantized rows are checked
against `numerics.requantize.requantize_map`, itself tested code by code against
torch's float32 arithmetic. Both are fast and need no torch. Rows those maps do not
explain (codes that round, another tool's rounding, block rows requantized to a merged scale)
are dequantized in float32 with torch, an independent reference, and must be within half an fp8
step of the converter's formula: the only use of torch (the `fp8fix[torch]` extra) in a command.
Rows are read in chunks, so memory stays at one chunk per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import Fp8Weight
from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import FP8_WEIGHT_DTYPES, NAN_CODES, REQUANT_CLAMP
from fp8fix.numerics.fp8 import is_power_of_two, steps_at, torch_dtype
from fp8fix.numerics.recodings import value_map
from fp8fix.numerics.requantize import requantize_map
from fp8fix.numerics.torch_extra import import_torch
from fp8fix.verification.context import CHUNK_ELEMENTS, Mismatch, VerifyContext, counting, scale_values
from fp8fix.verification.mapping import Target
from fp8fix.verification.report import WeightCheck


def check_weight(ctx: VerifyContext, weight: Fp8Weight, targets: list[Target]) -> WeightCheck:
    """A linear FP8 weight, row run by row run, in each place it went."""
    w, fmt, name = weight.tensor, ctx.fmt, weight.name
    check = WeightCheck(name, [t.name for t in targets], "exact")
    try:
        src_scale = ctx.src.tensors.get(fmt.weight_scale_of(name))
        if fmt.block and src_scale is not None and src_scale.numel > 1 and len(src_scale.shape) == 2:
            _compare_block(ctx, weight, targets, src_scale, check)
            return check
        src_scales = scale_rows(src_scale, w, ctx.shard_of_rows(weight.module), "SOURCE")
        for target in targets:
            o = ctx.out.tensors[target.name]
            if (
                o.dtype not in FP8_WEIGHT_DTYPES
                or o.shape[1:] != w.shape[1:]
                or o.shape[0] < target.out_offset + (target.end - target.start)
            ):
                raise Mismatch(f"'{target.name}' is {o.dtype} {list(o.shape)}, expected FP8 rows of '{name}'")
            out_module = target.name.rsplit(".", 1)[0]
            out_scale = ctx.out.tensors.get(f"{out_module}.{fmt.weight_scale}")
            out_scales = scale_rows(out_scale, o, ctx.shard_of_rows(out_module), "OUTPUT")
            _compare_rows(ctx, w, o, target, src_scales, out_scales, check)
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def check_stacked_experts(ctx: VerifyContext, weight: Fp8Weight) -> WeightCheck:
    """Stacked experts [E, in, out]: same shape; every (expert, column) scale is the source's times one
    power of two (fp8fix never requantizes experts); codes are the source values at the new scales."""
    name = weight.name
    w, o = weight.tensor, ctx.out.tensors[name]
    check = WeightCheck(name, [name], "exact")
    try:
        if o.dtype not in FP8_WEIGHT_DTYPES or o.shape != w.shape:
            raise Mismatch(f"'{name}' is {o.dtype} {list(o.shape)}, expected FP8 {list(w.shape)}")
        src_grid = expert_column_scales(ctx, weight, ctx.src.tensors, "SOURCE")
        out_grid = expert_column_scales(ctx, weight, ctx.out.tensors, "OUTPUT")
        ratios = np.unique(out_grid / src_grid).tolist()
        if len(ratios) != 1 or not is_power_of_two(ratios[0]):
            raise Mismatch(
                f"'{ctx.fmt.weight_scale_of(name)}': the scales are not SOURCE's times one power of two "
                f"(ratios {ratios[:4]})"
            )
        experts, inner, cols = w.shape
        rows = experts * inner  # the tensor as [E * in, out] rows, expert e owning rows [e * in, (e + 1) * in)
        step_rows = max(1, CHUNK_ELEMENTS // cols)
        target = Target(name, 0, rows)
        for r0 in range(0, rows, step_rows):
            r1 = min(rows, r0 + step_rows)
            a, b = ctx.read_rows(w, r0, r1, cols), ctx.read_rows(o, r0, r1, cols)
            with counting(check):
                if not same_values(a, b, w.dtype, o.dtype, ratios[0], name, r0, cols):
                    experts_of_rows = np.arange(r0, r1) // inner
                    s_src, s_out = src_grid[experts_of_rows], out_grid[experts_of_rows]
                    _compare_values(w, o, target, r0, r1, a, b, s_src, s_out, check)
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def expert_column_scales(ctx: VerifyContext, weight: Fp8Weight, tensors: dict[str, TensorInfo], where: str) -> Any:
    """The scale of every (expert, output column) of stacked experts, as a float64 [E, out] array."""
    w = weight.tensor
    experts, _, cols = w.shape
    scale = tensors.get(ctx.fmt.weight_scale_of(w.name))
    if scale is None:
        raise Mismatch(f"{where}: FP8 experts '{w.name}' have no scale")
    values = np.asarray(scale_values(scale, where), dtype=np.float64)
    if values.size == 1:
        return np.broadcast_to(values.reshape(1, 1), (experts, cols))
    if values.size == experts:
        return np.broadcast_to(values.reshape(experts, 1), (experts, cols))
    if values.size == experts * cols:
        return values.reshape(experts, cols)
    widths = weight.experts.widths if weight.experts else []
    if widths and scale.shape == (experts, len(widths)) and sum(widths) == cols:
        return np.repeat(values.reshape(experts, -1), widths, axis=1)
    raise Mismatch(f"{where}: scale '{scale.name}' of shape {list(scale.shape)} does not fit '{w.name}'")


def scale_rows(scale: TensorInfo | None, weight: TensorInfo, row_shards: list[int] | None, where: str) -> list[float]:
    """One scale value per row of `weight`, from a per-tensor, per-shard or per-channel scale."""
    if scale is None:
        raise Mismatch(f"{where}: FP8 weight '{weight.name}' has no scale")
    values = scale_values(scale, where)
    rows = weight.shape[0]
    if len(values) == 1:
        return values * rows
    if row_shards and len(values) == max(row_shards) + 1 and len(row_shards) == rows:
        return [values[shard] for shard in row_shards]
    if len(values) == rows:
        return values
    raise Mismatch(f"{where}: scale '{scale.name}' of shape {list(scale.shape)} does not fit '{weight.name}'")


def _compare_rows(
    ctx: VerifyContext,
    w: TensorInfo,
    o: TensorInfo,
    target: Target,
    src_scales: list[float],
    out_scales: list[float],
    check: WeightCheck,
) -> None:
    """Compare rows run by run, where a run shares one output/source scale ratio.

    A power-of-two ratio (splits, fn <-> fnuz) is checked as bytes: the output codes must
    be the source codes through `value_map`, the table of same-value codes. Runs that
    round or requantize are checked against `requantize_map` (`_as_mapped`), and what that
    does not explain is dequantized in float32 with torch.
    """
    cols = math.prod(w.shape[1:])
    top_scale = max(src_scales)
    shift = target.out_offset - target.start  # output row = source row + shift
    for row, end in _runs(target.start, target.end, lambda r: out_scales[r + shift] / src_scales[r]):
        ratio = out_scales[row + shift] / src_scales[row]
        if not is_power_of_two(ratio) and not is_power_of_two(out_scales[row + shift] / top_scale):
            raise Mismatch(
                f"'{o.name}' row {row + shift}: scale {out_scales[row + shift]:.6g} is neither the source's "
                f"({src_scales[row]:.6g}) nor the largest of its module ({top_scale:.6g}) times a power of two"
            )
        step_rows = max(1, CHUNK_ELEMENTS // max(cols, 1))
        exact_ratio = is_power_of_two(ratio)
        for r0 in range(row, end, step_rows):
            r1 = min(end, r0 + step_rows)
            a, b = ctx.read_rows(w, r0, r1, cols), ctx.read_rows(o, r0 + shift, r1 + shift, cols)
            with counting(check):
                if exact_ratio and same_values(a, b, w.dtype, o.dtype, ratio, o.name, r0 + shift, cols):
                    continue
                if _as_mapped(w, o, a, b, r0, shift, cols, src_scales, out_scales, check, exact_ratio):
                    continue
                _compare_values(w, o, target, r0, r1, a, b, src_scales, out_scales, check)


def _runs(start: int, end: int, key: Callable[[int], object]) -> Iterator[tuple[int, int]]:
    """[first, stop) runs of consecutive rows of [start, end) that share one `key(row)`."""
    row = start
    while row < end:
        value, stop = key(row), row + 1
        while stop < end and key(stop) == value:
            stop += 1
        yield row, stop
        row = stop


def same_values(a: bytes, b: bytes, src: str, out: str, ratio: float, name: str, row0: int, cols: int) -> bool:
    """True when `b` is exactly `a`'s values at the new scale; False when some codes round (check those
    with floats); raises on anything else."""
    expected, rounded, overflow = value_map(src, out, ratio)
    if any(bytes([c]) in a for c in overflow):
        raise Mismatch(f"'{name}': source values beyond the range of {out} at the output scale (clipped)")
    if any(bytes([c]) in a for c in rounded):
        return False
    mapped = a.translate(expected)
    if mapped != b:
        raise _code_mismatch(name, mapped, b, out, row0, cols)
    return True


def _code_mismatch(name: str, expected: bytes, got: bytes, dtype: str, row0: int, cols: int) -> Mismatch:
    """The codes of `got` that are not `expected`'s: how many, and the one whose value is furthest off
    (a NaN code furthest of all)."""
    want, have = np.frombuffer(expected, dtype=np.uint8), np.frombuffer(got, dtype=np.uint8)
    differ = np.flatnonzero(want != have)
    values = code_values(dtype)
    with np.errstate(invalid="ignore"):
        errors = np.nan_to_num(np.abs(values[have[differ]] - values[want[differ]]), nan=np.inf)
    i = int(differ[int(np.argmax(errors))])
    return Mismatch(
        f"'{name}' row {row0 + i // cols} column {i % cols}: code 0x{got[i]:02X}, expected 0x{expected[i]:02X} "
        "(the source's value at the output scale)",
        codes=len(differ),
    )


def _as_mapped(
    w: TensorInfo,
    o: TensorInfo,
    a: bytes,
    b: bytes,
    r0: int,
    shift: int,
    cols: int,
    src_scales: list[float],
    out_scales: list[float],
    check: WeightCheck,
    exact_ratio: bool,
) -> bool:
    """True when rows that round (a power-of-two `exact_ratio` whose codes have no exact output code)
    or were requantized are exactly the codes `requantize_map` gives, fp8fix's own output: checked as
    bytes, errors read from the map, no float tensors. False sends them to the float check, which
    also accepts another tool's rounding within half an fp8 step."""
    if any(bytes([c]) in a for c in NAN_CODES[w.dtype]):
        if exact_ratio:
            return False  # NaN codes moved as bytes: the float check follows them
        raise Mismatch(f"'{w.name}': NaN codes in rows that were requantized into '{o.name}'")
    for row, end in _runs(r0, r0 + len(a) // cols, lambda r: (src_scales[r], out_scales[r + shift])):
        pair = (src_scales[row], out_scales[row + shift])
        codes = a[(row - r0) * cols : (end - r0) * cols]
        table = requantize_map(w.dtype, pair[0], pair[1], o.dtype)
        if codes.translate(table.codes) != b[(row - r0) * cols : (end - r0) * cols]:
            return False
        worst = table.worst(codes)
        check.max_error = max(check.max_error, worst.max_abs)
        if exact_ratio:
            rounded = sum(codes.count(c) for c in value_map(w.dtype, o.dtype, pair[1] / pair[0])[1])
            check.rounded_codes += rounded
            if rounded:
                check.grade("rounded")
        else:
            check.grade("requantized")
            check.max_error_steps = max(check.max_error_steps, worst.max_steps)
    return True


def _compare_values(
    w: TensorInfo,
    o: TensorInfo,
    target: Target,
    r0: int,
    r1: int,
    a_bytes: bytes,
    b_bytes: bytes,
    src_scales: Any,
    out_scales: Any,
    check: WeightCheck,
) -> None:
    """Dequantize rows [r0, r1) in float32 with torch and compare; scales are per-row lists or arrays
    that broadcast to the rows' elements."""
    torch = import_torch(f"verify: checking '{o.name}', whose codes no byte map explains,")
    clamp = REQUANT_CLAMP[o.dtype]
    if isinstance(src_scales, list):
        s_src = torch.tensor(src_scales[r0:r1], dtype=torch.float32).reshape(-1, 1)
        first = r0 - target.start + target.out_offset
        s_out = torch.tensor(out_scales[first : first + (r1 - r0)], dtype=torch.float32).reshape(-1, 1)
    else:
        s_src = torch.from_numpy(np.asarray(src_scales, dtype=np.float32))
        s_out = torch.from_numpy(np.asarray(out_scales, dtype=np.float32))
    a = torch.frombuffer(bytearray(a_bytes), dtype=torch.uint8).view(torch_dtype(w.dtype)).float().reshape(r1 - r0, -1)
    b = torch.frombuffer(bytearray(b_bytes), dtype=torch.uint8).view(torch_dtype(o.dtype)).float().reshape(r1 - r0, -1)
    src_value = a * s_src
    mantissa, _ = torch.frexp(s_out.double() / s_src.double())
    power_of_two = (mantissa == 0.5).expand_as(a)
    # the code at the output scale: exact (a power-of-two multiple of the source code) for splits and
    # encoding changes; for requantized rows the converter's own float32 formula, clamped before rounding
    # (to +-224 for e4m3fnuz, as vLLM's ROCm kernels do)
    q = torch.where(power_of_two, a * (s_src / s_out), src_value / s_out)
    clamped = q.clamp(-clamp, clamp)
    nearest = clamped.to(torch_dtype(o.dtype)).float()
    steps = (b - clamped).abs() / steps_at(clamped, o.dtype)
    both_nan = torch.isnan(b) & torch.isnan(q)  # a NaN moved as bytes stays the NaN it was
    ok = torch.where(power_of_two, (b == nearest) | both_nan, steps <= 0.5 + 1e-6)
    if not bool(ok.all()):
        off = torch.where(ok, 0.0, (b * s_out - src_value).abs().nan_to_num(nan=math.inf))
        row, col = divmod(int(off.argmax()), off.shape[1])
        out_value = float((b * s_out)[row, col])
        out_row = r0 - target.start + target.out_offset + row
        raise Mismatch(
            f"'{o.name}' (from '{w.name}') row {out_row} column {col}: source value "
            f"{float(src_value[row, col]):.6g}, output {out_value:.6g}",
            codes=int((~ok).sum()),
        )
    error = torch.where(both_nan, 0.0, (b * s_out - src_value).abs())
    check.max_error = max(check.max_error, float(error.max()) if error.numel() else 0.0)
    if not bool(power_of_two.all()):
        check.grade("requantized")
        check.max_error_steps = max(check.max_error_steps, float(steps[~power_of_two].max()))
    rounded = int(((nearest != q) & power_of_two & ~both_nan).sum())
    if rounded:
        check.grade("rounded")
    check.rounded_codes += rounded


#: A run of rows checked together under block scales: (target, first source row, end row,
#: source block-scale row, output block-scale row).
BlockRun = tuple[Target, int, int, int, int]


def _compare_block(
    ctx: VerifyContext, weight: Fp8Weight, targets: list[Target], src_scale: TensorInfo, check: WeightCheck
) -> None:
    """Block-scaled rows, wherever they went. Each output block row's scales must be the largest of the
    source block rows its rows come from (one source block row: that row's scales), all times one power
    of two (fn <-> fnuz); the codes must be the source values at those scales: exact where the scales
    are the source's times that power of two, else requantized within half an fp8 step."""
    assert ctx.fmt.block is not None
    b0 = ctx.fmt.block[0]
    w = weight.tensor
    cols = math.prod(w.shape[1:])
    grid_cols = src_scale.shape[1]
    src_grid = scale_values(src_scale, "SOURCE")
    fused = weight.fused
    runs: list[BlockRun] = []
    contributors: dict[str, dict[int, set[int]]] = {}
    for target in targets:
        shift = target.out_offset - target.start
        kept = fused if target.name == w.name else None  # the module kept fused: the same grid as SOURCE's
        row = target.start
        while row < target.end:
            src_row = fused.scale_row(row, b0) if fused else row // b0
            src_next = fused.next_block_start(row, b0) if fused else (row // b0 + 1) * b0
            out = row + shift
            out_row = kept.scale_row(out, b0) if kept else out // b0
            out_next = kept.next_block_start(out, b0) if kept else (out // b0 + 1) * b0
            stop = min(target.end, src_next, out_next - shift)
            runs.append((target, row, stop, src_row, out_row))
            contributors.setdefault(target.name, {}).setdefault(out_row, set()).add(src_row)
            row = stop
    out_grids = {name: _out_grid(ctx, name, grid_cols) for name in contributors}
    ratio = _grid_ratio(src_grid, out_grids, contributors, grid_cols)
    for target, r0, r1, src_row, out_row in runs:
        o = ctx.out.tensors[target.name]
        s_src = src_grid[src_row * grid_cols : (src_row + 1) * grid_cols]
        s_out = out_grids[target.name][out_row * grid_cols : (out_row + 1) * grid_cols]
        o0 = r0 - target.start + target.out_offset
        a, b = ctx.read_rows(w, r0, r1, cols), ctx.read_rows(o, o0, o0 + (r1 - r0), cols)
        same_scales = all(x * ratio == y for x, y in zip(s_src, s_out, strict=True))
        block = ctx.fmt.block
        with counting(check):
            if same_scales and same_values(a, b, w.dtype, o.dtype, ratio, o.name, o0, cols):
                continue
            _compare_values(
                w, o, target, r0, r1, a, b, _expand_row(s_src, cols, block), _expand_row(s_out, cols, block), check
            )


def _out_grid(ctx: VerifyContext, weight_name: str, grid_cols: int) -> list[float]:
    """The block scales of an OUTPUT weight, checked to have the source's columns of blocks."""
    name = f"{weight_name.rsplit('.', 1)[0]}.{ctx.fmt.weight_scale}"
    scale = ctx.out.tensors.get(name)
    if scale is None or len(scale.shape) != 2 or scale.shape[1] != grid_cols:
        raise Mismatch(f"'{weight_name}' has no block scale '{name}' of {grid_cols} columns of blocks")
    return scale_values(scale, "OUTPUT")


def _grid_ratio(
    src_grid: list[float], out_grids: dict[str, list[float]], contributors: dict[str, dict[int, set[int]]], gc: int
) -> float:
    """The one power of two every output block scale is the largest of its source block scales times."""
    ratio: float | None = None
    for name, rows in contributors.items():
        grid = out_grids[name]
        for out_row, src_rows in rows.items():
            got = grid[out_row * gc : (out_row + 1) * gc]
            largest = [max(src_grid[r * gc + c] for r in src_rows) for c in range(gc)] if len(src_rows) > 1 else None
            expected = largest or src_grid[min(src_rows) * gc : (min(src_rows) + 1) * gc]
            if ratio is None:
                ratio = got[0] / expected[0]
            if got != [x * ratio for x in expected] or not is_power_of_two(ratio):
                c = next((c for c in range(gc) if got[c] != expected[c] * ratio), 0)
                kind = "that source block row's" if largest is None else "the largest of its source block rows'"
                raise Mismatch(
                    f"'{name}' block row {out_row} column block {c}: scale {got[c]:.6g} is not {kind} "
                    f"({expected[c]:.6g}) times the power of two of its other blocks"
                )
    return 1.0 if ratio is None else ratio


def _expand_row(scales: list[float], cols: int, block: tuple[int, int]) -> Any:
    """One block row's scales as a [1, cols] float32 array, one per column."""
    return np.asarray(scales, dtype=np.float32)[np.arange(cols) // block[1]].reshape(1, cols)

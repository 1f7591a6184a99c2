"""Verifying `--blocks 128x128`: MXFP8 weights and MXFP4 modules OUTPUT holds as 128 x 128 block FP8.

Read off OUTPUT: a SOURCE MXFP8 weight whose OUTPUT tensor is e4m3fn of its shape (an MXFP4 module's: its
`<module>.weight`, e4m3fn of its elements' shape), with a float scale grid of one value per 128 x 128 block under
the scale's name. For each block, with SOURCE's values v = code x 2^(b - 127)
(b the element's E8M0 byte, read here from SOURCE's bytes, an E2M1 element's value from the OCP MX table; exact in
float64) and OUTPUT's scale p:
- p is the smallest power of two that holds the block's largest value (worked out here again);
- every code is v / p rounded to nearest even on the e4m3fn grid (`ue8m0.nearest_e4m3fn`: the nearest of the sorted
  code values, ties to the even code), so no value moves by more than half an e4m3fn step at p; those that
  move are counted (`rounded_codes`), and where none does the weight is exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.verification.context import Mismatch, VerifyContext, scale_values
from fp8fix.verification.fp4 import e2m1_values
from fp8fix.verification.report import WeightCheck
from fp8fix.verification.ue8m0 import e4m3fn_steps, nearest_e4m3fn, power_of_two, smallest_holding

#: The grid OUTPUT's scales are checked against.
BLOCK = 128
#: Elements per E8M0 byte in SOURCE (OCP MX).
MX = 32
#: The dtypes an OUTPUT block scale may have.
FLOAT_SCALES = ("F32", "BF16", "F16", "F64")


def check_reblocked_config(ctx: VerifyContext, source_qc: dict[str, Any], output_qc: dict[str, Any]) -> None:
    """OUTPUT's quantization_config is SOURCE's but what re-blocking changes: `format` float-quantized, and each
    config group's weights float 8-bit `strategy: block` of 128 x 128, its activations dynamic (OUTPUT holds no
    input scales), its own format gone or float-quantized."""
    report = ctx.report
    if output_qc.get("format") != "float-quantized":
        report.problem(f"config.json: format {output_qc.get('format')!r:.40}; OUTPUT's weights are float-quantized")
    source, output = copy.deepcopy(source_qc), copy.deepcopy(output_qc)
    groups = output.get("config_groups")
    for name, group in (groups if isinstance(groups, dict) else {}).items():
        weights = group.get("weights") if isinstance(group, dict) else None
        weights = weights if isinstance(weights, dict) else {}
        said = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if said != ("float", 8, "block") or weights.get("block_structure") not in ([BLOCK, BLOCK], f"{BLOCK}x{BLOCK}"):
            report.problem(f"config.json: config group {name!s:.40} does not say float 8-bit 128x128 block weights")
        activations = group.get("input_activations") if isinstance(group, dict) else None
        if isinstance(activations, dict) and activations.get("dynamic") is not True:
            report.problem(f"config.json: config group {name!s:.40} says static activations; OUTPUT has no input scale")
    converted = source.get("quant_method") != output.get("quant_method")  # ModelOpt's: one group (`config`)
    if not converted and not same_but_schemes(source, output):
        report.problem("config.json: quantization_config differs from SOURCE's beyond what re-blocking changes")


def same_but_schemes(source_qc: dict[str, Any], output_qc: dict[str, Any]) -> bool:
    """Two compressed-tensors configs say the same but their `format` and each group's weights, activations and
    format (what `--blocks` rewrites); OUTPUT's `ignore` may name more (Linear modules without FP8 weights)."""
    source, output = copy.deepcopy(source_qc), copy.deepcopy(output_qc)
    for qc in (source, output):
        qc.pop("format", None)
        for group in (qc.get("config_groups") or {}).values():
            if isinstance(group, dict):
                for key in ("weights", "input_activations", "format"):
                    group.pop(key, None)
    ignored, more = source.pop("ignore", None) or [], output.pop("ignore", None) or []
    kept = isinstance(ignored, list) and isinstance(more, list) and all(e in more for e in ignored)
    return kept and source == output


@dataclass(frozen=True)
class MxSource:
    """A SOURCE MX weight as verify reads it: its codes (e4m3fn bytes, or packed E2M1 two a byte), its E8M0 scale, and
    the OUTPUT weight it became (its own name; an MXFP4 module's `<module>.weight`)."""

    tensor: TensorInfo
    scale: TensorInfo
    element: str  # e4m3 or e2m1
    out_name: str

    @property
    def cols(self) -> int:
        return self.tensor.shape[1] * (2 if self.element == "e2m1" else 1)


def reblocked_weights(ctx: VerifyContext) -> dict[str, MxSource]:
    """SOURCE's MXFP8 weights and MXFP4 modules that OUTPUT holds as e4m3fn of their elements' shape with a
    128 x 128 scale grid under the scale's name, by SOURCE tensor."""
    candidates = [
        MxSource(w.tensor, w.scale, "e4m3", w.name)
        for w in (ctx.model.module_weights() if ctx.fmt.mx else [])
        if w.scale is not None and not w.stacked
    ]
    candidates += [
        MxSource(w.packed, w.scale, "e2m1", f"{w.module}.weight")
        for w in ctx.model.fp4.values()
        if w.scheme == "mxfp4" and w.scale is not None and w.problem is None
    ]
    found: dict[str, MxSource] = {}
    for m in candidates:
        o, out_scale = ctx.out.tensors.get(m.out_name), ctx.out.tensors.get(m.scale.name)
        rows, cols = m.tensor.shape[0], m.cols
        if o is None or out_scale is None or o.dtype != E4M3FN or o.shape != (rows, cols):
            continue
        if out_scale.shape == (-(-rows // BLOCK), -(-cols // BLOCK)) and out_scale.dtype in FLOAT_SCALES:
            found[m.tensor.name] = m
    return found


def check_reblocked(ctx: VerifyContext, weight: MxSource) -> WeightCheck:
    """Every block of the weight as the module docstring says."""
    t, scale, name = weight.tensor, weight.scale, weight.out_name
    o = ctx.out.tensors[name]
    check = WeightCheck(t.name, [name], "exact")
    rows, cols = t.shape[0], weight.cols
    values = np.nan_to_num(code_values(E4M3FN), nan=np.inf)  # a NaN code is no value: it fails every check
    try:
        grid = np.asarray(scale_values(ctx.out.tensors[scale.name], "OUTPUT")).reshape(-1, -(-cols // BLOCK))
        for row in range(0, rows, BLOCK):
            stop = min(rows, row + BLOCK)
            exponents = np.frombuffer(ctx.read_rows(scale, row, stop, cols // MX), dtype=np.uint8)
            if (exponents == 0xFF).any():
                raise Mismatch(f"SOURCE scale '{scale.name}' holds a NaN byte (255) in rows {row}-{stop - 1}")
            powers = np.repeat(np.ldexp(1.0, exponents.astype(np.int64) - 127).reshape(-1, cols // MX), MX, 1)
            v = _source_values(ctx, weight, row, stop, values) * powers
            out = values[np.frombuffer(ctx.read_rows(o, row, stop, cols), dtype=np.uint8).reshape(-1, cols)]
            for c in range(grid.shape[1]):
                span = slice(c * BLOCK, min(cols, (c + 1) * BLOCK))
                where = f"'{name}' block row {row // BLOCK} column block {c}"
                rounded, error, steps = _check_block(v[:, span], out[:, span], float(grid[row // BLOCK, c]), where)
                check.rounded_codes += rounded
                check.max_error, check.max_error_steps = max(check.max_error, error), max(check.max_error_steps, steps)
        if check.rounded_codes:
            check.grade("requantized")
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def _source_values(ctx: VerifyContext, weight: MxSource, row: int, stop: int, values: np.ndarray) -> np.ndarray:
    """SOURCE's elements of rows [row, stop) as float64 [rows, cols]: e4m3fn codes' values, or E2M1 nibbles' (the
    lower nibble first; `fp4.e2m1_values`)."""
    if weight.element == "e4m3":
        codes = np.frombuffer(ctx.read_rows(weight.tensor, row, stop, weight.cols), dtype=np.uint8)
        return values[codes].reshape(-1, weight.cols)
    elements: np.ndarray = e2m1_values(ctx.read_rows(weight.tensor, row, stop, weight.cols // 2), weight.cols)
    return elements


def _check_block(v: np.ndarray, codes: np.ndarray, p: float, where: str) -> tuple[int, float, float]:
    """One block: (values that moved, the largest move, in value and in e4m3fn steps at p)."""
    amax = float(np.abs(v).max(initial=0.0))
    if not np.isfinite(codes).all() or not np.isfinite(v).all():
        raise Mismatch(f"{where}: NaN codes")
    if not power_of_two(p) or (amax > 0 and p != smallest_holding(amax)):
        expected = smallest_holding(amax) if amax > 0 else "a power of two"
        raise Mismatch(f"{where}: scale {p!r}, expected {expected!r}: the smallest power of two that holds {amax!r}")
    expected = nearest_e4m3fn(v / p)
    if not np.array_equal(np.abs(codes), np.abs(expected)) or np.any((codes != 0) & (np.sign(codes) != np.sign(v))):
        r, c = (int(i) for i in np.argwhere((np.abs(codes) != np.abs(expected)) | (np.sign(codes) != np.sign(v)))[0])
        raise Mismatch(
            f"{where} row {r} column {c}: {codes[r, c] * p!r}, expected SOURCE's value {v[r, c]!r} rounded to "
            f"nearest even at scale {p!r} ({expected[r, c] * p!r})",
            codes=int((np.abs(codes) != np.abs(expected)).sum()),
        )
    error = np.abs(codes * p - v)
    step = e4m3fn_steps(np.abs(expected)) * p
    return int((error > 0).sum()), float(error.max(initial=0.0)), float((error / step).max(initial=0.0))

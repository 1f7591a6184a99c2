"""Verifying `--blocks mx`: block-FP8 weights OUTPUT holds as MXFP8.

Read off OUTPUT: a SOURCE block-scaled FP8 weight whose OUTPUT tensor is e4m3fn of its shape, beside a U8 scale
[out, in / 32] under compressed-tensors' scale name (`weight_scale`, SOURCE's `weight_scale_inv` renamed). Per
SOURCE block (the rows of one row of its grid, the block's columns):
- every E8M0 byte OUTPUT gives the block's elements is one and the same b, and not 255 (NaN): the block is at
  p = 2^(b - 127), decoded here from the OCP MX definition;
- its values are what a block at p must hold (`ue8m0.check_block_row`, as `--scales ue8m0`): SOURCE's exactly
  where SOURCE's scale is a power of two, else each nearest even at the smallest power of two holding the
  block, or half of it where that errs less.
The config is checked here too: compressed-tensors `format: mxfp8-quantized`, every config group's weights
float 8-bit in groups of 32 with uint8 scales, its activations dynamic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fp8fix.model import Fp8Weight
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.registry.formats import compressed_tensors_names
from fp8fix.verification.context import Mismatch, VerifyContext
from fp8fix.verification.mx_blocks import same_but_schemes
from fp8fix.verification.report import WeightCheck
from fp8fix.verification.ue8m0 import BlockScales, check_power_of_two_blocks

#: Elements per E8M0 byte (OCP MX).
MX = 32
#: The E8M0 byte that is NaN; every other byte b is 2^(b - 127).
NAN, BIAS = 255, 127


def mx_scale_name(weight: Fp8Weight) -> str | None:
    """The name OUTPUT's MX scale of `weight` has: compressed-tensors' name of SOURCE's scale."""
    if weight.scale is None:
        return None
    return next(iter(compressed_tensors_names(weight.scale.name)), weight.scale.name)


def mx_weights(ctx: VerifyContext) -> dict[str, Fp8Weight]:
    """SOURCE's block-scaled weights that OUTPUT holds as e4m3fn of the same shape with U8 [out, in / 32] scales."""
    found: dict[str, Fp8Weight] = {}
    if ctx.fmt.block is None or ctx.fmt.mx:
        return found
    for w in ctx.model.module_weights():
        o, scale = ctx.out.tensors.get(w.name), ctx.out.tensors.get(mx_scale_name(w) or "")
        if o is None or scale is None or not w.per_block(ctx.fmt.block) or o.dtype != E4M3FN:
            continue
        rows, cols = w.tensor.shape
        if o.shape == w.tensor.shape and scale.dtype == "U8" and scale.shape == (rows, cols // MX) and cols % MX == 0:
            found[w.name] = w
    return found


def check_block_mx(ctx: VerifyContext, weight: Fp8Weight) -> WeightCheck:
    """Every block of the weight as the module docstring says."""
    scale = ctx.out.tensors[mx_scale_name(weight) or ""]
    assert ctx.fmt.block is not None
    block_cols = ctx.fmt.block[1]
    cols = weight.tensor.shape[1]

    def bytes_per_block() -> BlockScales:
        def powers(grid_row: int, row: int, stop: int) -> Any:
            data = np.frombuffer(ctx.read_rows(scale, row, stop, cols // MX), dtype=np.uint8).reshape(-1, cols // MX)
            out = []
            for c in range(-(-cols // block_cols)):
                span = data[:, c * block_cols // MX : -(-min(cols, (c + 1) * block_cols) // MX)]
                where = f"'{scale.name}' rows {row}-{stop - 1}, SOURCE's column block {c}"
                if (span != span.flat[0]).any():
                    raise Mismatch(
                        f"{where}: E8M0 bytes differ within one block of SOURCE ({sorted(set(span.flat))[:4]})"
                    )
                if span.flat[0] == NAN:
                    raise Mismatch(f"{where}: E8M0 byte 255, which is NaN")
                out.append(2.0 ** (int(span.flat[0]) - BIAS))
            return out

        return powers

    return check_power_of_two_blocks(ctx, weight, bytes_per_block)


def check_mx_config(ctx: VerifyContext, source_qc: dict[str, Any], output_qc: dict[str, Any]) -> None:
    """OUTPUT's quantization_config says compressed-tensors MXFP8 in every config group (the module docstring),
    and for a compressed-tensors SOURCE the rest is SOURCE's; which modules it targets and ignores is checked as
    for any compressed-tensors OUTPUT (`config`)."""
    report = ctx.report
    if source_qc.get("quant_method") == "compressed-tensors" and not same_but_schemes(source_qc, output_qc):
        report.problem("config.json: quantization_config differs from SOURCE's beyond what --blocks mx changes")
    if output_qc.get("quant_method") != "compressed-tensors" or output_qc.get("format") != "mxfp8-quantized":
        said = f"{output_qc.get('quant_method')!r:.40} format {output_qc.get('format')!r:.40}"
        report.problem(f"config.json: quantization_config is {said}; OUTPUT's weights are compressed-tensors MXFP8")
    groups = output_qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        report.problem("config.json: no config_groups; OUTPUT's weights are MXFP8")
        return
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        weights: dict[str, Any] = group["weights"] if isinstance(group.get("weights"), dict) else {}
        keys = ("type", "num_bits", "strategy", "group_size", "symmetric", "scale_dtype")
        if tuple(weights.get(k) for k in keys) != ("float", 8, "group", MX, True, "torch.uint8"):
            report.problem(f"config.json: config group {name!s:.40} does not say MXFP8 weights (float 8-bit, groups "
                           "of 32, symmetric, torch.uint8 scales)")  # fmt: skip
        if group.get("format", "mxfp8-quantized") != "mxfp8-quantized":
            report.problem(f"config.json: config group {name!s:.40} says format {group.get('format')!r:.40}")
        activations = group.get("input_activations")
        if isinstance(activations, dict) and activations.get("dynamic") is not True:
            report.problem(f"config.json: config group {name!s:.40} says static activations; OUTPUT has no input scale")

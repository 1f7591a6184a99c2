"""Verifying `--tp-bf16`: FP8 modules OUTPUT holds in BF16, unquantized.

Read off OUTPUT itself (never the plan): a SOURCE FP8 weight with a block scale whose OUTPUT tensor
is BF16 of the same shape. Each of its values must be the SOURCE code times its block scale,
computed exactly in float64, to within half a BF16 step (one rounding to nearest); its scales
must be gone from OUTPUT, and config.json must list the module as unquantized (`config.check_config`,
whose name lists must name them where a list is one of modules left unquantized).
"""

from __future__ import annotations

from fp8fix.model import Fp8Weight
from fp8fix.numerics.dequantize import BF16, bf16_step, code_values
from fp8fix.verification.context import Mismatch, VerifyContext, scale_values
from fp8fix.verification.report import WeightCheck


def dequantized_weights(ctx: VerifyContext) -> dict[str, Fp8Weight]:
    """SOURCE's block-scaled FP8 weights that OUTPUT holds in BF16, by name, in checkpoint order."""
    block = ctx.fmt.block
    if block is None:
        return {}
    found = {}
    for w in ctx.model.module_weights():
        o = ctx.out.tensors.get(w.name)
        if o is not None and o.dtype == BF16 and w.scale is not None and len(w.scale.shape) == 2 and not w.stacked:
            found[w.name] = w
    return found


def dropped_scales(weights: dict[str, Fp8Weight]) -> set[str]:
    """The scale tensors of those weights: OUTPUT must not hold them."""
    return {t.name for w in weights.values() for t in (w.scale, w.input_scale) if t is not None}


def unquantized_modules(weights: dict[str, Fp8Weight]) -> list[str]:
    return [w.module for w in weights.values()]


def check_dequantized(ctx: VerifyContext, weight: Fp8Weight) -> WeightCheck:
    """Every value of the BF16 weight within half a BF16 step of SOURCE's code times its block scale."""
    import numpy as np

    name, t = weight.name, weight.tensor
    o = ctx.out.tensors[name]
    check = WeightCheck(name, [name], "dequantized")
    assert weight.scale is not None and ctx.fmt.block is not None
    b0, b1 = ctx.fmt.block
    try:
        if o.shape != t.shape:
            raise Mismatch(f"'{name}' is {o.dtype} {list(o.shape)}; expected BF16 {list(t.shape)} (SOURCE's shape)")
        rows, cols = t.shape
        grid = np.array(scale_values(weight.scale, "SOURCE"), dtype=np.float64).reshape(weight.scale.shape)
        values = code_values(t.dtype)
        for r0 in range(0, rows, b0):
            r1 = min(rows, r0 + b0)
            codes = np.frombuffer(ctx.read_rows(t, r0, r1, cols), dtype=np.uint8).reshape(r1 - r0, cols)
            exact = values[codes] * np.repeat(grid[r0 // b0], b1)[:cols]
            bits = np.frombuffer(ctx.read_rows(o, r0, r1, cols), dtype="<u2").astype(np.uint32) << np.uint32(16)
            got = bits.view(np.float32).astype(np.float64).reshape(r1 - r0, cols)
            error = np.abs(got - exact)
            steps = np.divide(error, bf16_step(exact), out=np.zeros_like(error), where=exact != 0)
            bad = ~np.isfinite(got) | ~np.isfinite(exact) | (steps > 0.5) | ((exact == 0) & (got != 0))
            if bad.any():
                r, c = (int(i) for i in np.argwhere(bad)[0])
                raise Mismatch(
                    f"'{name}' row {r0 + r} column {c}: {got[r, c]!r}, expected SOURCE's code times its block "
                    f"scale, {exact[r, c]!r}, rounded to BF16 (half a BF16 step at most)"
                )
            check.max_error = max(check.max_error, float(error.max(initial=0.0)))
            check.max_error_steps = max(check.max_error_steps, float(steps.max(initial=0.0)))
    except Mismatch as e:
        ctx.report.problem(str(e))
    return check

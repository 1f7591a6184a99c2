"""Verifying FP8 weights OUTPUT holds unquantized (`--to bf16` / `float16`, `--dequantize`, `--tp-bf16`).

Read off OUTPUT itself (never the plan): a SOURCE FP8 weight whose OUTPUT tensor is BF16 or F16 of
the same shape. Each of its values must be the SOURCE code times its scale (per tensor, per shard,
per row, per block, per chunk's block, per expert or per expert and column, expanded here by verify's
own reading of the scales, `weights.scale_rows` / `expert_column_scales`), computed in float64, to
within half a step of the output dtype (one rounding to nearest); its scales must be gone from OUTPUT.
A plain OUTPUT (no quantization config, no FP8 tensor) must have lost the kv-cache scales too; its
config is checked in `config.check_config`, a partly dequantized one's lists in `config.check_config`.
"""

from __future__ import annotations

from typing import Any

from fp8fix.model import Fp8Weight
from fp8fix.numerics.dequantize import BF16, F16, code_values, output_step
from fp8fix.verification.context import (
    CHUNK_ELEMENTS,
    Mismatch,
    VerifyContext,
    counting,
    plain_output,
    scale_values,
)
from fp8fix.verification.report import WeightCheck
from fp8fix.verification.weights import expert_column_scales, scale_rows

#: The dtypes an FP8 weight may be written unquantized in.
UNQUANTIZED_DTYPES = (BF16, F16)


def dequantized_weights(ctx: VerifyContext) -> dict[str, Fp8Weight]:
    """SOURCE's FP8 weights that OUTPUT holds in BF16 or F16 under their own name, in checkpoint order."""
    found = {}
    for w in ctx.model.module_weights():
        o = ctx.out.tensors.get(w.name)
        if o is not None and o.dtype in UNQUANTIZED_DTYPES and w.scale is not None:
            found[w.name] = w
    return found


def dropped_scales(ctx: VerifyContext, weights: dict[str, Fp8Weight]) -> set[str]:
    """The scale tensors OUTPUT must not hold: those of the weights it holds unquantized, and in a plain
    OUTPUT every kv-cache scale."""
    dropped = {t.name for w in weights.values() for t in (w.scale, w.input_scale) if t is not None}
    if plain_output(ctx):
        dropped |= {t.name for t in ctx.model.kv_cache_scales}
    return dropped


def unquantized_modules(weights: dict[str, Fp8Weight]) -> list[str]:
    return [w.module for w in weights.values()]


def check_dequantized(ctx: VerifyContext, weight: Fp8Weight) -> WeightCheck:
    """Every value of the unquantized weight within half a step of SOURCE's code times its scale."""
    import numpy as np

    name, t = weight.name, weight.tensor
    o = ctx.out.tensors[name]
    check = WeightCheck(name, [name], "dequantized")
    try:
        if o.shape != t.shape:
            raise Mismatch(f"'{name}' is {o.dtype} {list(o.shape)}; expected SOURCE's shape {list(t.shape)}")
        cols = t.shape[-1]
        rows = t.numel // cols
        scales = _ScaleGrid(ctx, weight)
        values = code_values(t.dtype)
        step_rows = max(1, CHUNK_ELEMENTS // cols)
        for r0 in range(0, rows, step_rows):
            r1 = min(rows, r0 + step_rows)
            with counting(check):
                codes = np.frombuffer(ctx.read_rows(t, r0, r1, cols), dtype=np.uint8).reshape(r1 - r0, cols)
                exact = values[codes] * scales.rows(r0, r1)
                got = as_float64(ctx.read_rows(o, r0, r1, cols), o.dtype).reshape(r1 - r0, cols)
                compare_rounded(check, got, exact, r0, o.dtype, "SOURCE's code times its scale")
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def compare_rounded(check: WeightCheck, got: Any, exact: Any, r0: int, dtype: str, what: str) -> None:
    """OUTPUT's rows from `r0` (`got`, float64) each within half a `dtype` step of `exact` (a zero exactly zero),
    their largest error added to `check`; else a Mismatch naming the worst value, `what` it should be, and how many
    differ."""
    import numpy as np

    error = np.abs(got - exact)
    steps = np.divide(error, output_step(exact, dtype), out=np.zeros_like(error), where=exact != 0)
    bad = ~np.isfinite(got) | ~np.isfinite(exact) | (steps > 0.5) | ((exact == 0) & (got != 0))
    if bad.any():
        r, c = divmod(int(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf), -1.0))), got.shape[1])
        raise Mismatch(
            f"'{check.targets[0]}' row {r0 + r} column {c}: {float(got[r, c])!r}, expected {what}, "
            f"{float(exact[r, c])!r}, rounded to {dtype} (half a {dtype} step at most)",
            codes=int(bad.sum()),
        )
    check.max_error = max(check.max_error, float(error.max(initial=0.0)))
    check.max_error_steps = max(check.max_error_steps, float(steps.max(initial=0.0)))


def as_float64(data: bytes, dtype: str) -> Any:
    """Little-endian BF16 or F16 values as float64 (BF16: the top half of a float32)."""
    import numpy as np

    if dtype == F16:
        return np.frombuffer(data, dtype="<f2").astype(np.float64)
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(np.float64)


class _ScaleGrid:
    """The scale of every element of a SOURCE FP8 weight, by rows (stacked experts as [E * in, out] rows),
    from the scale tensor as verify reads it."""

    def __init__(self, ctx: VerifyContext, weight: Fp8Weight) -> None:
        import numpy as np

        self.weight, t, scale = weight, weight.tensor, weight.scale
        assert scale is not None
        block = ctx.fmt.block
        self.cols = t.shape[-1]
        self.grid = self.rows_of = self.per_row = self.experts = None
        if weight.stacked:
            self.experts = expert_column_scales(ctx, weight, ctx.src.tensors, "SOURCE")  # [E, out]
            self.inner = t.shape[1]
        elif block and scale.numel > 1 and len(scale.shape) == 2:
            # [grid rows, grid cols], expanded to columns a row chunk at a time: an MX grid has a row per weight
            # row, and expanded whole it would take four times the weight's BF16 bytes
            self.grid = np.asarray(scale_values(scale, "SOURCE"), dtype=np.float64).reshape(scale.shape)
            self.block_cols = block[1]
            fused, b0 = weight.fused, block[0]
            self.rows_of = np.array(
                [fused.scale_row(r, b0) if fused else r // b0 for r in range(t.shape[0])], dtype=np.intp
            )
        else:
            rows = scale_rows(scale, t, ctx.shard_of_rows(weight.module), "SOURCE")
            self.per_row = np.asarray(rows, dtype=np.float64)

    def rows(self, r0: int, r1: int) -> Any:
        """[r1 - r0, cols] scales, or [r1 - r0, 1] where each row has one."""
        import numpy as np

        if self.experts is not None:
            return self.experts[np.arange(r0, r1) // self.inner]
        if self.grid is not None:
            assert self.rows_of is not None
            return np.repeat(self.grid[self.rows_of[r0:r1]], self.block_cols, axis=1)[:, : self.cols]
        assert self.per_row is not None
        return self.per_row[r0:r1, None]

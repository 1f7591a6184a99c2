"""Verifying NVFP4 modules OUTPUT moved to the global scale their packed layer shares.

Read off OUTPUT: a SOURCE NVFP4 module (`model.fp4`) whose OUTPUT global scale is not SOURCE's, its packed weight
and scale under the same names, shapes and dtypes. Checked here on verify's own reading of the format (E2M1 from
the OCP MX table, the nibble order, e4m3fn scales; a module's multiplier its global scale, or 1 / it where the
global scale divides), not convert's tables:
- every module of the layer (q / k / v, gate / up: `packed_siblings`) holds in OUTPUT one global scale, SOURCE's
  of the module whose multiplier is the layer's largest (so no scale grows past e4m3fn's range);
- each group's OUTPUT scale c is one of the two e4m3fn values either side of s x r (s its SOURCE scale, r the
  module's multiplier over the shared one): s x r itself where that is one;
- each OUTPUT element is an E2M1 value nearest to SOURCE's value at c (ties either way), so a group whose scale
  stays on the grid keeps every value exactly;
- no group's largest error at c exceeds what the other neighbour of s x r would give it.
The largest error (in SOURCE's value units, and in E2M1 steps at the source value) is recorded.
"""

from __future__ import annotations

from typing import Any

from fp8fix.fp4_modules import Fp4Weight
from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.registry.parallel import packed_siblings
from fp8fix.verification.context import CHUNK_ELEMENTS, Mismatch, VerifyContext, counting, scale_values
from fp8fix.verification.fp4 import E2M1_VALUES, e2m1_values
from fp8fix.verification.report import WeightCheck

#: E2M1's magnitudes, ascending: the positive half of verify's own table (`verification.fp4.E2M1_VALUES`).
E2M1_MAGNITUDES = E2M1_VALUES[:8]
#: Element error allowed beyond the nearest value's: float64's noise on these products (relative to the value).
TOLERANCE = 1e-12


def shared_modules(ctx: VerifyContext) -> dict[str, Fp4Weight]:
    """SOURCE's NVFP4 modules whose global scale OUTPUT holds otherwise, each tensor under its own name (by packed
    weight's name)."""
    found = {}
    for w in ctx.model.fp4.values():
        if w.scheme != "nvfp4" or w.global_scale is None or w.scale is None or w.problem is not None or w.experts:
            continue
        out = [ctx.out.tensors.get(t.name) for t in (w.packed, w.scale, w.global_scale)]
        if any(o is None or (o.dtype, o.shape) != (t.dtype, t.shape) for o, t in zip(out, w.tensors, strict=False)):
            continue
        if ctx.files.read(out[2].path, out[2].start, out[2].end) != ctx.files.read(  # type: ignore[union-attr]
            w.global_scale.path, w.global_scale.start, w.global_scale.end
        ):
            found[w.packed.name] = w
    return found


def shared_scale_names(weights: dict[str, Fp4Weight]) -> set[str]:
    """The scales checked with their module's packed weight."""
    return {t.name for w in weights.values() for t in (w.scale, w.global_scale) if t is not None}


def check_shared(ctx: VerifyContext, w: Fp4Weight) -> WeightCheck:
    """The module at its layer's shared global scale (the module docstring)."""
    check = WeightCheck(w.packed.name, [w.packed.name], "exact", grid="E2M1")
    assert w.scale is not None and w.global_scale is not None
    try:
        mine = w.multiplier(scale_values(w.global_scale, "SOURCE")[0])
        shared = _layer_multiplier(ctx, w)
        out_scale = ctx.out.tensors[w.scale.name]
        out_packed = ctx.out.tensors[w.packed.name]
        ratio = mine / shared
        cols, groups = w.cols, w.cols // 16
        step_rows = max(1, CHUNK_ELEMENTS // cols)
        for r0 in range(0, w.rows, step_rows):
            r1 = min(w.rows, r0 + step_rows)
            with counting(check):
                values = e2m1_values(ctx.read_rows(w.packed, r0, r1, cols // 2), cols).reshape(r1 - r0, groups, 16)
                got = e2m1_values(ctx.read_rows(out_packed, r0, r1, cols // 2), cols).reshape(r1 - r0, groups, 16)
                s = _e4m3(ctx.read_rows(w.scale, r0, r1, groups))
                c = _e4m3(ctx.read_rows(out_scale, r0, r1, groups))
                _check_rows(check, values, got, s.reshape(r1 - r0, groups) * ratio, c.reshape(r1 - r0, groups), r0)
        check.max_error *= shared
        if check.max_error_steps > 0:
            check.grade("requantized")
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def _layer_multiplier(ctx: VerifyContext, w: Fp4Weight) -> float:
    """The layer's largest SOURCE multiplier, which every module of it must hold in OUTPUT."""
    found = [ctx.model.fp4.get(m) for m in packed_siblings(w.module)]
    siblings = [s for s in found if s is not None and s.global_scale is not None]
    if len(found) < 2 or len(siblings) < len(found):
        raise Mismatch(
            f"'{w.global_scale.name if w.global_scale else w.module}' differs from SOURCE's, but '{w.module}' is no "
            "module of a packed layer of NVFP4 modules"
        )
    source = [s.multiplier(scale_values(s.global_scale, "SOURCE")[0]) for s in siblings if s.global_scale]
    largest = max(source)
    for s in siblings:
        assert s.global_scale is not None
        o = ctx.out.tensors.get(s.global_scale.name)
        got = s.multiplier(scale_values(o, "OUTPUT")[0]) if o is not None else None
        if got != largest:
            raise Mismatch(
                f"'{s.global_scale.name}' is worth a multiplier of {got!r} in OUTPUT; the modules of its packed layer "
                f"({', '.join(packed_siblings(w.module))}) must share the largest of SOURCE's, {largest!r}"
            )
    return largest


def _e4m3(data: bytes) -> Any:
    import numpy as np

    return code_values(E4M3FN)[np.frombuffer(data, dtype=np.uint8)]


def _check_rows(check: WeightCheck, values: Any, got: Any, target: Any, c: Any, r0: int) -> None:
    """Rows of groups: SOURCE's elements `values` at scale `target` (s x r), OUTPUT's `got` at scale `c`."""
    import numpy as np

    grid = code_values(E4M3FN)[:0x7F]  # e4m3fn's finite non-negative values, ascending
    a = np.abs(target)
    hi = grid[np.minimum(np.searchsorted(grid, a), len(grid) - 1)]
    lo = grid[np.maximum(np.searchsorted(grid, a, side="right") - 1, 0)]
    off_grid = ~np.isfinite(c) | (np.signbit(c) != np.signbit(target)) | ((np.abs(c) != lo) & (np.abs(c) != hi))
    if off_grid.any():
        r, g = np.argwhere(off_grid)[0]
        raise Mismatch(
            f"'{check.tensor}' row {r0 + r} group {g}: its OUTPUT scale {float(c[r, g])!r} is neither e4m3fn value "
            f"beside SOURCE's scale times the ratio, {float(target[r, g])!r}",
            codes=int(off_grid.sum()) * 16,
        )
    exact = values * target[..., None]
    error = np.abs(got * c[..., None] - exact)
    best = _nearest_error(exact, c)
    noise = np.abs(exact) * TOLERANCE  # float64's rounding of the products, far below any E2M1 step
    far = error > best + noise
    if far.any():
        r, g, k = np.argwhere(far)[0]
        raise Mismatch(
            f"'{check.tensor}' row {r0 + r} column {g * 16 + k}: {float(got[r, g, k] * c[r, g])!r} in OUTPUT, not "
            f"the E2M1 value nearest SOURCE's {float(exact[r, g, k])!r} at its group's scale {float(c[r, g])!r}",
            codes=int(far.sum()),
        )
    other = np.where(np.abs(c) == lo, hi, lo) * np.where(np.signbit(target), -1.0, 1.0)
    worse = error.max(axis=-1) > _nearest_error(exact, other).max(axis=-1) + noise.max(axis=-1)
    if worse.any():
        r, g = np.argwhere(worse)[0]
        raise Mismatch(
            f"'{check.tensor}' row {r0 + r} group {g}: scale {float(c[r, g])!r} errs more than the other e4m3fn value "
            f"beside {float(target[r, g])!r} would",
            codes=16,
        )
    step = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0])[np.searchsorted(E2M1_MAGNITUDES, np.abs(values))]
    unit = step * np.abs(target)[..., None]
    steps = np.divide(error, unit, out=np.zeros_like(error), where=unit > 0)
    check.max_error = max(check.max_error, float(error.max(initial=0.0)))
    check.max_error_steps = max(check.max_error_steps, float(steps.max(initial=0.0)))


def _nearest_error(exact: Any, c: Any) -> Any:
    """The least error any E2M1 value times `c` (one per group) has at each value of `exact`."""
    import numpy as np

    magnitudes = np.array(E2M1_MAGNITUDES)
    scale = np.abs(c)[..., None]
    q = np.divide(np.abs(exact), scale, out=np.zeros_like(exact), where=scale > 0)
    i = np.clip(np.searchsorted(magnitudes, q), 1, len(magnitudes) - 1)
    nearest = np.minimum(np.abs(q - magnitudes[i - 1]), np.abs(q - magnitudes[i]))
    zero = scale == 0
    return np.where(zero, np.abs(exact), nearest * scale)

"""Dequantizing FP8 codes to BF16 or F16: `convert --to bf16`, `--dequantize`, `--tp-bf16`.

A code times its scale is exact in float64 (4 significant bits times at most 24, or times a
row scale and a column scale, one of them 1), so each output value is that product rounded
once, to nearest even, to the output's precision (BF16: 8 significant bits; F16: 11): the only
error is that one rounding, at most half a step of the output at that value. Every row shares
its column blocks' scales, so each (row scale, column scale) pair gets a 256-entry table,
worked out once with numpy, and the codes are looked up. No torch: BF16 values are bit
patterns made with integer arithmetic; F16 is numpy's float64 -> float16 conversion, which
rounds once, to nearest even (npy_double_to_half).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from fp8fix.numerics.fp8 import e4m3_value
from fp8fix.numerics.requantize import RoundingStats

#: The dtype `--tp-bf16` and `--dequantize` write; with F16, what `--to` can write unquantized.
BF16 = "BF16"
F16 = "F16"
#: `--to` names of the unquantized dtypes -> their safetensors dtype and config.json `torch_dtype`.
UNQUANTIZED: dict[str, tuple[str, str]] = {"bf16": (BF16, "bfloat16"), "float16": (F16, "float16")}
#: float64 keeps 52 fraction bits, BF16 7: the bits a rounding to BF16 drops.
_DROPPED_BITS = 52 - 7
#: The smallest normal BF16 (and float32) magnitude: below it BF16 keeps fewer bits, which fp8fix refuses.
_MIN_NORMAL = 2.0**-126
#: F16's largest finite value: a dequantized value above it has no F16 form.
_F16_MAX = 65504.0


@cache
def code_values(dtype: str) -> Any:
    """The 256 codes' values in float64 (NaN codes: NaN; they are refused before any lookup)."""
    import numpy as np

    return np.array([e4m3_value(c, dtype) for c in range(256)], dtype=np.float64)


def round_to_bf16(exact: Any) -> Any:
    """float64 values rounded to nearest even at BF16's precision, still as float64; raises ValueError
    for a non-zero result outside BF16's normal range (a scale too small or too large to keep)."""
    import numpy as np

    bits = np.ascontiguousarray(exact, dtype=np.float64).view(np.uint64)
    lsb = (bits >> np.uint64(_DROPPED_BITS)) & np.uint64(1)
    bits = (bits + np.uint64((1 << (_DROPPED_BITS - 1)) - 1) + lsb) & ~np.uint64((1 << _DROPPED_BITS) - 1)
    rounded = bits.view(np.float64)
    magnitude = np.abs(rounded[np.isfinite(exact)])
    if np.any((magnitude != 0) & ((magnitude < _MIN_NORMAL) | (magnitude > np.finfo(np.float32).max))):
        raise ValueError("a dequantized value falls outside BF16's normal range")
    return rounded


def round_to(exact: Any, out_dtype: str) -> Any:
    """float64 values rounded once to `out_dtype` (BF16 or F16), as float64; ValueError outside its range."""
    import numpy as np

    if out_dtype == BF16:
        return round_to_bf16(exact)
    if np.any(np.abs(exact[np.isfinite(exact)]) > _F16_MAX):
        raise ValueError(f"a dequantized value exceeds F16's largest, {_F16_MAX:g} (write --to bf16 instead)")
    return exact.astype(np.float16).astype(np.float64)


def fits_output(exact: Any, out_dtype: str) -> Any:
    """bool per float64 value: `round_to` writes it (finite, and zero or inside `out_dtype`'s range: BF16's
    normal one, F16's up to its largest); the rest it refuses."""
    import numpy as np

    magnitude = np.abs(np.where(np.isfinite(exact), exact, np.inf))
    if out_dtype == BF16:
        inside = (magnitude >= _MIN_NORMAL) & (magnitude <= np.finfo(np.float32).max)
        return np.isfinite(magnitude) & ((magnitude == 0) | inside)
    return magnitude <= _F16_MAX


def bf16_step(values: Any) -> Any:
    """The BF16 step (distance to the next BF16 value away from zero) at each float64 value."""
    import numpy as np

    _, exponent = np.frexp(values)
    return np.ldexp(1.0, exponent - 8)


def output_step(values: Any, out_dtype: str) -> Any:
    """The step of `out_dtype` at each float64 value: BF16's, or F16's (2^-24 among its subnormals)."""
    import numpy as np

    if out_dtype == BF16:
        return bf16_step(values)
    _, exponent = np.frexp(values)
    return np.ldexp(1.0, np.maximum(exponent, -13) - 11)


def bf16_bits(rounded: Any) -> Any:
    """BF16 bit patterns (uint16) of float64 values already rounded to BF16 (`round_to_bf16`)."""
    import numpy as np

    return (rounded.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def output_bits(rounded: Any, out_dtype: str) -> Any:
    """Bit patterns (uint16) of float64 values already rounded to `out_dtype`."""
    import numpy as np

    return bf16_bits(rounded) if out_dtype == BF16 else rounded.astype(np.float16).view(np.uint16)


class LookupArrays:
    """The flat-index and output arrays of `dequantize_rows`, kept from one window to the next.

    Why: fresh arrays for every window cost page faults (with fresh window buffers, `SourceFiles.windows`:
    170k per GB written, as much system time as the lookup's own CPU; `--to bf16`, issue 30). Kept arrays
    are faulted in once; the output is a view of them, valid until the next call with the same arrays."""

    def __init__(self) -> None:
        self._index: Any = None
        self._out: Any = None

    def get(self, size: int, kind: Any, out_kind: Any = "<u2") -> tuple[Any, Any]:
        """An index array of numpy dtype `kind` and an output array of `out_kind` (uint16), `size` elements each
        (grown, never shrunk; each made anew where its dtype changes)."""
        import numpy as np

        if self._out is None or self._out.size < size or self._out.dtype != np.dtype(out_kind):
            self._out = np.empty(size, dtype=out_kind)
        if self._index is None or self._index.dtype != kind or self._index.size < size:
            self._index = np.empty(max(size, self._out.size), dtype=kind)
        return self._index[:size], self._out[:size]


@dataclass(frozen=True)
class LookupTables:
    """One 256-entry table of output bit patterns per (row scale, column block), flat, and the worst rounding
    any finite code gets in them."""

    bits: Any  # uint16, little-endian
    stats: RoundingStats


def lookup_tables(dtype: str, col_scales: Any, row_scales: Any = None, out_dtype: str = BF16) -> LookupTables:
    """The tables of `dequantize_rows` (worked out once per block row where only column scales vary: the
    writer's windows share them); ValueError for a value outside `out_dtype`'s range."""
    import numpy as np

    values = code_values(dtype)
    col = np.asarray(col_scales, dtype=np.float64)
    row = np.ones(1) if row_scales is None else np.asarray(row_scales, dtype=np.float64)
    # exact: one of the two scales is 1 where both exist
    exact = (row[:, None] * col[None, :])[:, :, None] * values[None, None, :]
    rounded = round_to(exact, out_dtype)
    errors = np.abs(rounded - exact)
    steps = errors / output_step(exact, out_dtype)  # the step at 0 is not 0: no division by zero
    finite = np.isfinite(values)[None, None, :]
    stats = RoundingStats(float(errors.max(initial=0.0, where=finite)), float(steps.max(initial=0.0, where=finite)))
    return LookupTables(output_bits(rounded, out_dtype).astype("<u2").reshape(-1), stats)


def dequantize_rows(
    codes: bytes | bytearray | memoryview,
    dtype: str,
    cols: int,
    block_cols: int,
    col_scales: Any,
    row_scales: Any = None,
    out_dtype: str = BF16,
    arrays: LookupArrays | None = None,
    tables: LookupTables | None = None,
) -> tuple[memoryview, RoundingStats]:
    """Rows of `cols` FP8 codes as little-endian `out_dtype` bytes (a view of `arrays`' output, or of a new
    array): the code at (r, c) times `col_scales[c // block_cols]` (a sequence of floats) times `row_scales[r]`
    (one per row; None: 1); and a bound on the rounding: the worst any finite code gets at these scales
    (counting the codes present would cost more than the lookup itself; verify measures the real worst).
    `tables`: `lookup_tables` of these scales, where the caller already has them."""
    import numpy as np

    found = tables or lookup_tables(dtype, col_scales, row_scales, out_dtype)
    grid = np.frombuffer(codes, dtype=np.uint8).reshape(-1, cols)
    # one flat index per code, its table's offset plus the code: uint16 where the tables fit (a quarter of
    # intp's bytes: `take` widening it as it reads beats writing intp, 0.49 against 0.67 ns a code)
    kind = np.uint16 if found.bits.size <= 1 << 16 else np.int32
    index, out = (arrays or LookupArrays()).get(grid.size, kind)
    index, out = index.reshape(grid.shape), out.reshape(grid.shape)
    np.add(grid, ((np.arange(cols) // block_cols) * 256).astype(kind), out=index, dtype=kind)
    if row_scales is not None:
        index += (np.arange(grid.shape[0]) * (len(col_scales) * 256)).astype(kind)[:, None]
    np.take(found.bits, index, out=out, mode="wrap")  # every index is inside the tables by construction
    return memoryview(out).cast("B"), found.stats

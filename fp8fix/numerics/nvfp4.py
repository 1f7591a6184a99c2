"""NVFP4 rows in BF16 or F16: each E2M1 element times its group's E4M3 scale, divided by the global scale.

NVFP4 (compressed-tensors `nvfp4-pack-quantized`) stores a weight as E2M1 nibbles, two a byte, the lower first;
each 16 elements of a row share one e4m3fn scale s, and the whole tensor one F32 global scale g that every s is
divided by: the element's value is e2m1 x s / g (compressed-tensors forward_helpers.py `_dequantize`). An E2M1
value (2 significant bits) times an e4m3 value (4) is exact in float64, and so, for NVFP4's operands, is the one
division's rounding harmless: the exact quotient of a 6-bit significand by a 24-bit one lies either on a rounding
boundary of the output or at least 2^-33 (relative) away from one, far more than float64's 2^-53, so rounding the
float64 quotient once more to the output gives what rounding the exact quotient once would (`round_to`).

Every value depends only on (scale byte, nibble), and a packed byte's two elements share a group: one 65,536-entry
table per global scale of both elements' output bit patterns at (scale byte, packed byte), and a row is two numpy
passes (index, look up) over its packed bytes, no unpacking. A pair whose value is NaN (an e4m3 NaN scale) or
outside the output's range is marked in the table; a row holding one is refused with the group named
(`Fp4RangeError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fp8fix.numerics.dequantize import LookupArrays, code_values, fits_output, output_bits, output_step, round_to
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.numerics.mx import OUT_OF_RANGE, element_values, first_out_of_range, look_up_pairs, nibble_pairs
from fp8fix.numerics.requantize import RoundingStats

#: Elements per NVFP4 scale (compressed-tensors quant_scheme.py NVFP4: group_size 16).
NVFP4_GROUP = 16


class Fp4RangeError(ValueError):
    """A group's scale makes one of its elements NaN or leave the output's range."""

    def __init__(self, row: int, group: int, scale_byte: int, out_dtype: str) -> None:
        self.row, self.group, self.scale_byte = row, group, scale_byte
        super().__init__(
            f"row {row}, group {group}: its scale (e4m3 byte {scale_byte:#04x}) makes a value NaN or puts it "
            f"outside {out_dtype}'s range"
        )


@dataclass(frozen=True)
class Nvfp4Table:
    """Output bit patterns of a packed byte's two elements at each scale byte: at (scale byte << 8) | packed byte,
    uint32 (the lower nibble's value in the low half: little-endian, the first element first), OUT_OF_RANGE in a half
    whose value has none; per scale byte, whether any of its values has none; and the rounding of each (scale byte,
    nibble) (its error, and in steps of the output at the value)."""

    pairs: Any  # uint32[65536]
    unsafe: Any  # bool[256]
    errors: Any  # float64[256, 16]
    steps: Any  # float64[256, 16]


@lru_cache(maxsize=64)
def nvfp4_table(global_scale: float, out_dtype: str, multiply: bool = False) -> Nvfp4Table:
    """The table of every (e4m3 scale byte, packed byte) at global scale `global_scale` (positive, finite): each
    value e2m1 x scale / global (compressed-tensors), or (`multiply`) e2m1 x scale x global (ModelOpt's
    `weight_scale_2`; exact in float64: 4 + 2 + 24 significant bits)."""
    import numpy as np

    products = code_values(E4M3FN)[:, None] * element_values("e2m1")[None, :16]
    exact = products * global_scale if multiply else products / global_scale
    fits = fits_output(exact, out_dtype)
    kept = np.where(fits, exact, 0.0)
    rounded = round_to(kept, out_dtype)
    errors = np.abs(rounded - kept)
    steps = np.where(kept == 0, 0.0, errors / output_step(kept, out_dtype))
    bits = np.where(fits, output_bits(rounded, out_dtype), np.uint16(OUT_OF_RANGE))  # [256 scale bytes, 16 nibbles]
    return Nvfp4Table(nibble_pairs(bits), ~fits.all(axis=1), errors, steps)


def nvfp4_arrays(
    data: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview, cols: int
) -> tuple[Any, Any]:
    """Rows of packed NVFP4 (`cols` elements each) and their scale bytes as uint8 arrays [rows, groups, 8] and
    [rows, groups] (no copy); ValueError where the sizes are not such rows."""
    import numpy as np

    groups = cols // NVFP4_GROUP
    rows = len(scales) // groups if groups else 0
    if not groups or cols % NVFP4_GROUP or len(scales) != rows * groups or len(data) * 2 != rows * cols:
        raise ValueError(f"{len(data)} packed bytes and {len(scales)} scale bytes are not rows of {cols} NVFP4")
    packed = np.frombuffer(data, dtype=np.uint8).reshape(rows, groups, NVFP4_GROUP // 2)
    return packed, np.frombuffer(scales, dtype=np.uint8).reshape(rows, groups)


def nvfp4_rows(
    data: bytes | bytearray | memoryview,
    scales: bytes | bytearray | memoryview,
    cols: int,
    table: Nvfp4Table,
    out_dtype: str,
    arrays: LookupArrays | None = None,
) -> tuple[memoryview, RoundingStats]:
    """Rows of packed NVFP4 (`cols` elements each) and their e4m3 scale bytes ([rows, cols / 16], row-major) as
    little-endian `out_dtype` bytes, and a bound on the rounding: the worst any element gets at the scales present
    (verify measures the real worst). One lookup per packed byte (its two elements share a group of 16). The result
    is a view of `arrays`' output (`numerics.dequantize.LookupArrays`), valid until their next use. Fp4RangeError
    names the first group with a value the output cannot hold."""
    import numpy as np

    packed, scale_bytes = nvfp4_arrays(data, scales, cols)
    rows, groups, _ = packed.shape
    scale_bytes = scale_bytes.reshape(rows, groups, 1)
    out = look_up_pairs(packed, scale_bytes, table.pairs, arrays or LookupArrays())
    present = np.bincount(scale_bytes.reshape(-1), minlength=256) > 0
    bad = first_out_of_range(out) if table.unsafe[present].any() else None
    if bad is not None:
        raise Fp4RangeError(*bad, int(scale_bytes[bad[0], bad[1], 0]), out_dtype)
    stats = RoundingStats(float(table.errors[present].max()), float(table.steps[present].max()))
    return memoryview(out.reshape(-1)).cast("B"), stats

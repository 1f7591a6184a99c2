"""What an e4m3 code is worth, and how far apart neighbouring codes are.

The one place for the value of a code, the fp8 step at a value and the torch dtype of
an encoding: requantization (which rounds) and verify (which checks the rounding)
must agree on all three, so neither keeps its own copy.
"""

from __future__ import annotations

import bisect
import math
from functools import cache
from typing import Any

from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ

#: Exponent of the smallest normal value: below it the fp8 step stops shrinking.
MIN_NORMAL_EXPONENT = {E4M3FN: -6, E4M3FNUZ: -7}
MANTISSA_BITS = 3


def e4m3_value(code: int, dtype: str) -> float:
    """The value of one e4m3 code in e4m3fn (bias 7) or e4m3fnuz (bias 8); NaN codes give NaN."""
    if (dtype == E4M3FN and code & 0x7F == 0x7F) or (dtype == E4M3FNUZ and code == 0x80):
        return math.nan
    bias = 7 if dtype == E4M3FN else 8
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - MANTISSA_BITS)
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - bias)


@cache
def _magnitudes(dtype: str) -> tuple[float, ...]:
    """The values of the finite positive codes 0x00, 0x01, ... in order: they ascend with the code."""
    return tuple(v for v in (e4m3_value(c, dtype) for c in range(0x80)) if not math.isnan(v))


def nearest_code(value: float, dtype: str) -> int:
    """The finite code of `dtype` nearest to `value`, ties to the even code (round to nearest even);
    past the largest finite value, the largest. A result of zero is +0 (0x00) whatever the sign of
    `value` (requantization applies torch's signed zero on top)."""
    magnitudes = _magnitudes(dtype)
    x = abs(value)
    code = min(bisect.bisect_left(magnitudes, x), len(magnitudes) - 1)
    if code > 0 and (x - magnitudes[code - 1], (code - 1) & 1) <= (magnitudes[code] - x, code & 1):
        code -= 1
    return code | 0x80 if value < 0 and code else code


def is_power_of_two(ratio: float) -> bool:
    """Scaling by such a ratio moves only exponents: exact unless a value leaves the range."""
    return ratio > 0 and math.frexp(ratio)[0] == 0.5


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of an FP8 weight encoding (imports torch: float paths only)."""
    import torch

    return {E4M3FN: torch.float8_e4m3fn, E4M3FNUZ: torch.float8_e4m3fnuz}[dtype]


def step_at(value: float, dtype: str) -> float:
    """The fp8 step of `dtype` at one `value` (code units): `steps_at` for a plain float, no torch."""
    _, exponent = math.frexp(value)
    return 2.0 ** (max(exponent - 1, MIN_NORMAL_EXPONENT[dtype]) - MANTISSA_BITS)


def steps_at(values: Any, dtype: str) -> Any:
    """The fp8 step of `dtype` at each of `values` (a float tensor in code units): the distance
    between the two codes around it, constant below the smallest normal."""
    import torch

    _, exponent = torch.frexp(values)
    return torch.exp2((exponent - 1).clamp(min=MIN_NORMAL_EXPONENT[dtype]).float() - MANTISSA_BITS)

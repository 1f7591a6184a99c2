"""Pure FP8 numerics: bytes in, bytes out, no files.

Only requantization needs float math, and it is the only place torch is imported,
so conversions that just move bytes (splits, e4m3fn <-> e4m3fnuz) start fast and
stay small. Encoding changes are 256-entry byte maps built here in plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from fp8fix.dtypes import E4M3FN, E4M3FNUZ, REQUANT_CLAMP, decode_floats, encode_floats

#: Exponent of the smallest normal value: below it the fp8 step stops shrinking.
MIN_NORMAL_EXPONENT = {E4M3FN: -6, E4M3FNUZ: -7}
MANTISSA_BITS = 3


@dataclass
class RequantizeError:
    """The worst error of a requantization, in value and in fp8 steps at the target scale."""

    max_abs: float = 0.0
    max_steps: float = 0.0

    def update(self, other: RequantizeError) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_steps = max(self.max_steps, other.max_steps)


def _torch_fp8(dtype: str) -> Any:
    import torch

    return {E4M3FN: torch.float8_e4m3fn, E4M3FNUZ: torch.float8_e4m3fnuz}[dtype]


def requantize(
    codes: bytes, dtype: str, scale: float, target_scale: float, out_dtype: str | None = None
) -> tuple[bytes, RequantizeError]:
    """Re-express FP8 `codes` (`dtype`, at `scale`) in `out_dtype` at `target_scale`.

    Dequantize in float32, divide by the target scale, clamp (to +-448 for e4m3fn,
    +-224 for e4m3fnuz, as vLLM's ROCm kernels do; torch's cast does not saturate),
    round to nearest even. Returns the new codes and the worst error against the
    float32 source value.
    """
    import torch

    out_dtype = out_dtype or dtype
    fp8 = _torch_fp8(out_dtype)
    limit = REQUANT_CLAMP[out_dtype]
    src = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(_torch_fp8(dtype)).to(torch.float32)
    value = src * torch.tensor(scale, dtype=torch.float32)
    target = torch.tensor(target_scale, dtype=torch.float32)
    exact = (value / target).clamp(-limit, limit)
    out = exact.to(fp8)
    error = (out.to(torch.float32) * target - value).abs()
    _, exponent = torch.frexp(exact)
    step = torch.exp2((exponent - 1).clamp(min=MIN_NORMAL_EXPONENT[out_dtype]).to(torch.float32) - MANTISSA_BITS)
    steps = (out.to(torch.float32) - exact).abs() / step
    stats = RequantizeError(
        max_abs=float(error.max()) if error.numel() else 0.0,
        max_steps=float(steps.max()) if steps.numel() else 0.0,
    )
    return bytes(out.view(torch.uint8).untyped_storage()), stats


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


def nearest_code(value: float, dtype: str) -> int:
    """The finite code of `dtype` nearest to `value`, ties to the even code (round to nearest even)."""
    finite = [c for c in range(256) if not math.isnan(e4m3_value(c, dtype))]
    return min(finite, key=lambda c: (abs(e4m3_value(c, dtype) - value), c & 1, c))


@dataclass(frozen=True)
class Recoding:
    """An encoding change as a byte map. `scale_factor` multiplies every scale of the codes;
    `forbidden` codes are refused with `why`."""

    name: str
    source: str
    target: str
    scale_factor: float
    forbidden: tuple[int, ...]
    why: str


#: fn -> fnuz: same bits mean half the value, so scales double; 0x80 (-0 in fn, NaN in fnuz) becomes 0x00.
FN_TO_FNUZ = Recoding(
    "fn->fnuz", E4M3FN, E4M3FNUZ, 2.0, (0x7F, 0xFF), "NaN codes in e4m3fn (they would become +-240 in e4m3fnuz)"
)
#: fnuz -> fn: scales halve and the bits stay; exact unless the tensor holds +-240 (0x7F/0xFF, NaN in fn).
FNUZ_TO_FN = Recoding(
    "fnuz->fn", E4M3FNUZ, E4M3FN, 0.5, (0x80, 0x7F, 0xFF), "0x80 (NaN in e4m3fnuz) or +-240 (NaN in e4m3fn)"
)
#: fnuz -> fn for tensors holding +-240: scales stay and each code becomes the fn code of the same value.
#: Exact except fnuz codes below 2^-6 with an odd mantissa, which round by half an fn step (2^-10 * scale).
FNUZ_TO_FN_SAME_SCALE = Recoding("fnuz->fn@same-scale", E4M3FNUZ, E4M3FN, 1.0, (0x80,), "0x80 (NaN in e4m3fnuz)")
RECODINGS = {r.name: r for r in (FN_TO_FNUZ, FNUZ_TO_FN, FNUZ_TO_FN_SAME_SCALE)}


@cache
def recoding_table(name: str) -> bytes:
    """The 256-byte map of a recoding (forbidden codes map to themselves; they are refused before)."""
    if name == FN_TO_FNUZ.name:
        return bytes(0 if c == 0x80 else c for c in range(256))
    if name == FNUZ_TO_FN.name:
        return bytes(range(256))
    return bytes(c if c == 0x80 else nearest_code(e4m3_value(c, E4M3FNUZ), E4M3FN) for c in range(256))


@cache
def inexact_codes(name: str) -> bytes:
    """Source codes whose value the recoding cannot keep exactly."""
    r = RECODINGS[name]
    table = recoding_table(name)
    return bytes(
        c
        for c in range(256)
        if c not in r.forbidden and e4m3_value(table[c], r.target) * r.scale_factor != e4m3_value(c, r.source)
    )


def recode(codes: bytes, name: str) -> bytes:
    """Apply a recoding to FP8 `codes` (forbidden codes must have been refused already)."""
    if name == FN_TO_FNUZ.name:
        return codes.replace(b"\x80", b"\x00")  # memchr-fast where -0 is rare
    if name == FNUZ_TO_FN.name:
        return codes
    return codes.translate(recoding_table(name))


def scale_exactly(data: bytes, dtype: str, factor: float) -> bytes:
    """Multiply float scales by a power of two; refuse if any result is not exact (overflow, lost subnormal bit)."""
    values = decode_floats(data, dtype)
    scaled = [v * factor for v in values]
    out = encode_floats(scaled, dtype)
    if decode_floats(out, dtype) != scaled or not all(math.isfinite(v) for v in scaled):
        raise ValueError(f"a {dtype} scale times {factor} is not exactly representable")
    return out


@cache
def value_map(source: str, target: str, factor: float) -> tuple[bytes, bytes, bytes]:
    """How codes keep their value when the scale is multiplied by a power of two `factor`.

    For every `source` code at scale s: the `target` code of the same value at scale
    s * factor (nearest even where it has none), then the codes that round (no exact
    `target` code) and the codes that overflow (beyond the `target` range: only a
    clamp could hold them). NaN codes map to a NaN code of `target`.
    """
    nan_code = 0x7F if target == E4M3FN else 0x80
    expected, rounded, overflow = bytearray(256), bytearray(), bytearray()
    top = max(e4m3_value(c, target) for c in range(128) if not math.isnan(e4m3_value(c, target)))
    for code in range(256):
        value = e4m3_value(code, source)
        if math.isnan(value):
            expected[code] = code if source == target else nan_code
            continue
        wanted = value / factor
        if abs(wanted) > top:
            overflow.append(code)
            continue
        # zero keeps its sign within one encoding (bytes are moved); e4m3fnuz has no -0
        expected[code] = code if wanted == 0 and source == target else nearest_code(wanted, target)
        if e4m3_value(expected[code], target) != wanted:
            rounded.append(code)
    return bytes(expected), bytes(rounded), bytes(overflow)

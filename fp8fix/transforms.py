"""Pure FP8 numerics: bytes in, bytes out, no files.

Only requantization needs float math, and it is the only place torch is imported,
so conversions that just move bytes start fast and stay small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8fix.dtypes import E4M3FN, E4M3FNUZ, FP8_MAX

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
    codes: bytes, dtype: str, scale: float, target_scale: float, clamp: float | None = None
) -> tuple[bytes, RequantizeError]:
    """Re-express FP8 `codes` (at `scale`) at `target_scale`.

    Dequantize in float32, divide by the target scale, clamp to +-`clamp` (the
    encoding's max by default; torch's cast does not saturate), round to nearest
    even. Returns the new codes and the worst error against the float32 source value.
    """
    import torch

    fp8 = _torch_fp8(dtype)
    limit = FP8_MAX[dtype] if clamp is None else clamp
    src = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(fp8).to(torch.float32)
    value = src * torch.tensor(scale, dtype=torch.float32)
    target = torch.tensor(target_scale, dtype=torch.float32)
    exact = (value / target).clamp(-limit, limit)
    out = exact.to(fp8)
    error = (out.to(torch.float32) * target - value).abs()
    _, exponent = torch.frexp(exact)
    step = torch.exp2((exponent - 1).clamp(min=MIN_NORMAL_EXPONENT[dtype]).to(torch.float32) - MANTISSA_BITS)
    steps = (out.to(torch.float32) - exact).abs() / step
    stats = RequantizeError(
        max_abs=float(error.max()) if error.numel() else 0.0,
        max_steps=float(steps.max()) if steps.numel() else 0.0,
    )
    return bytes(out.view(torch.uint8).untyped_storage()), stats

"""Requantization: FP8 codes re-expressed at another scale. The only float math of a conversion.

torch is imported inside the functions, so conversions that only move bytes never
load it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.numerics.dtypes import REQUANT_CLAMP
from fp8fix.numerics.fp8 import steps_at, torch_dtype


@dataclass
class RequantizeStats:
    """The worst error of a requantization, in value and in fp8 steps at the target scale."""

    max_abs: float = 0.0
    max_steps: float = 0.0

    def update(self, other: RequantizeStats) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_steps = max(self.max_steps, other.max_steps)


def requantize(
    codes: bytes, dtype: str, scale: float, target_scale: float, out_dtype: str | None = None
) -> tuple[bytes, RequantizeStats]:
    """Re-express FP8 `codes` (`dtype`, at `scale`) in `out_dtype` at `target_scale`.

    Dequantize in float32, divide by the target scale, clamp (to +-448 for e4m3fn,
    +-224 for e4m3fnuz, as vLLM's ROCm kernels do; torch's cast does not saturate),
    round to nearest even. Returns the new codes and the worst error against the
    float32 source value.
    """
    import torch

    out_dtype = out_dtype or dtype
    limit = REQUANT_CLAMP[out_dtype]
    src = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(torch_dtype(dtype)).to(torch.float32)
    value = src * torch.tensor(scale, dtype=torch.float32)
    target = torch.tensor(target_scale, dtype=torch.float32)
    exact = (value / target).clamp(-limit, limit)
    out = exact.to(torch_dtype(out_dtype))
    error = (out.to(torch.float32) * target - value).abs()
    steps = (out.to(torch.float32) - exact).abs() / steps_at(exact, out_dtype)
    stats = RequantizeStats(
        max_abs=float(error.max()) if error.numel() else 0.0,
        max_steps=float(steps.max()) if steps.numel() else 0.0,
    )
    return bytes(out.view(torch.uint8).untyped_storage()), stats

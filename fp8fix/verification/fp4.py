"""Verifying FP4 modules OUTPUT holds unquantized (`--to bf16` / `float16` of NVFP4 and MXFP4 modules).

Read off OUTPUT: a SOURCE FP4 module (`model.fp4`) whose OUTPUT holds `<module>.weight` in BF16 or F16, of the
module's [out, in] elements, and neither its packed weight nor any of its scales. Each value is worked out here
from SOURCE's bytes on verify's own reading of the formats, not convert's decoders: the nibbles unpacked (the
lower first), E2M1 from its table in the OCP MX specification (v1.0 section 5.3.3), NVFP4's value e2m1 x e4m3
scale / global scale (ModelOpt's: times its `weight_scale_2`) and MXFP4's e2m1 x 2^(b - 127), in float64; OUTPUT's
value must lie within half a step of it (one rounding to nearest; MXFP4's values are exact in BF16, so there it must
be equal). gpt-oss's stacked experts (`Fp4Weight.experts`) are read as the parameter `<proj>` [experts, in, out]:
each expert transposed, as transformers 5.24's GptOssExperts declares it (models/gpt_oss/modeling_gpt_oss.py).
"""

from __future__ import annotations

from typing import Any

from fp8fix.fp4_modules import Fp4Weight
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.verification.context import CHUNK_ELEMENTS, Mismatch, VerifyContext, counting, scale_values
from fp8fix.verification.dequantized import UNQUANTIZED_DTYPES, as_float64, compare_rounded
from fp8fix.verification.report import WeightCheck

#: E2M1's values by nibble: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent bias 1, one mantissa bit), bit 3 the
#: sign (OCP Microscaling Formats v1.0, section 5.3.3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_values(data: bytes, cols: int) -> Any:
    """Packed E2M1 rows of `cols` elements as float64 [rows, cols]: each byte's lower nibble first (`E2M1_VALUES`)."""
    import numpy as np

    packed = np.frombuffer(data, dtype=np.uint8)
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1, cols)
    return np.array(E2M1_VALUES, dtype=np.float64)[nibbles]


def unquantized_fp4(ctx: VerifyContext) -> dict[str, Fp4Weight]:
    """SOURCE's FP4 modules that OUTPUT holds as a BF16 or F16 `<module>.weight` (by packed weight's name)."""
    found = {}
    for w in ctx.model.fp4.values():
        o = ctx.out.tensors.get(unquantized_name(w))
        if o is not None and o.dtype in UNQUANTIZED_DTYPES and w.scale is not None and w.problem is None:
            found[w.packed.name] = w
    return found


def unquantized_name(w: Fp4Weight) -> str:
    """Where a plain model holds the module's weight: a Linear's `<module>.weight`, gpt-oss experts' `<proj>`."""
    return w.module if w.experts else f"{w.module}.weight"


def fp4_dropped(weights: dict[str, Fp4Weight]) -> set[str]:
    """The tensors OUTPUT must not hold: every scale of the modules it holds unquantized."""
    return {t.name for w in weights.values() for t in w.tensors if t is not w.packed}


def check_fp4(ctx: VerifyContext, w: Fp4Weight) -> WeightCheck:
    """Every value of the unquantized module within half a step of SOURCE's (the module docstring)."""
    import numpy as np

    name = unquantized_name(w)
    o, cols = ctx.out.tensors[name], w.cols
    rows = w.packed.numel * 2 // cols
    per = rows // w.experts if w.experts else rows  # rows of one matrix: an expert's, or the module's
    shape = (w.experts, cols, per) if w.experts else (rows, cols)
    check = WeightCheck(w.packed.name, [name], "dequantized")
    try:
        if o.shape != shape:
            raise Mismatch(f"'{name}' is {o.dtype} {list(o.shape)}; SOURCE's FP4 module makes it {list(shape)}")
        assert w.scale is not None
        group = rows * cols // w.scale.numel
        global_scale = scale_values(w.global_scale, "SOURCE")[0] if w.global_scale is not None else 1.0
        step_rows = max(1, CHUNK_ELEMENTS // cols)
        for m0 in range(0, rows, per):
            expert = _expert_rows(ctx, o, m0, per, cols) if w.experts else None  # [per, cols] of 16-bit codes
            for r0 in range(m0, m0 + per, step_rows):
                r1 = min(m0 + per, r0 + step_rows)
                with counting(check):
                    elements = e2m1_values(ctx.read_rows(w.packed, r0, r1, cols // 2), cols)
                    scale_bytes = np.frombuffer(ctx.read_rows(w.scale, r0, r1, cols // group), dtype=np.uint8)
                    scales = _scales(scale_bytes, w.scheme).reshape(r1 - r0, cols // group)
                    exact = elements * np.repeat(scales, group, axis=1)
                    exact = exact * global_scale if w.global_multiplies else exact / global_scale
                    data = ctx.read_rows(o, r0, r1, cols) if expert is None else expert[r0 - m0 : r1 - m0].tobytes()
                    got = as_float64(data, o.dtype).reshape(r1 - r0, cols)
                    compare_rounded(check, got, exact, r0, o.dtype, f"SOURCE's {w.scheme} value")
    except Mismatch as e:
        check.mismatched(str(e), e.codes)
    return check


def _expert_rows(ctx: VerifyContext, o: TensorInfo, m0: int, per: int, cols: int) -> Any:
    """The expert of OUTPUT's [experts, in, out] whose SOURCE rows start at `m0`, back as [out, in] 16-bit codes."""
    import numpy as np

    data = ctx.read_rows(o, m0, m0 + per, cols)  # an expert's [cols, per] sits where its [per, cols] rows would
    return np.frombuffer(data, dtype="<u2").reshape(cols, per).T.copy()


def _scales(data: Any, scheme: str | None) -> Any:
    """Scale bytes as float64: NVFP4's e4m3fn values; MXFP4's E8M0 2^(b - 127), NaN for 255."""
    import numpy as np

    if scheme == "nvfp4":
        return code_values(E4M3FN)[data]
    return np.where(data == 255, np.nan, np.ldexp(1.0, data.astype(np.int64) - 127))

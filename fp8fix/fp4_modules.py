"""FP4 modules of a checkpoint: compressed-tensors NVFP4 and MXFP4 (issue 49), alone or beside FP8 ones.

compressed-tensors writes an FP4 Linear as `weight_packed` U8 [out, in / 2] (two E2M1 elements a byte, the lower
nibble first: compressors/nvfp4/helpers.py pack_fp4_to_uint8) and `weight_scale` [out, in / group]: NVFP4
(`nvfp4-pack-quantized`) an F8_E4M3 scale per 16 elements with an F32 `weight_global_scale` [1] that every scale is
divided by (forward_helpers.py _dequantize: scale / global_scale), MXFP4 (`mxfp4-pack-quantized`) an E8M0 byte per
32 as U8. Here each module is found by its packed weight and checked against its scheme, read off its scale's dtype
and matched to the config groups the format declares (`registry.formats.FormatSpec.fp4`).

gpt-oss (`quant_method: mxfp4`) stacks each layer's routed experts: `<proj>_blocks` U8 [experts, out, in / 32, 16]
(the same bytes, row by row, as compressed-tensors' [experts x out, in / 2]) and `<proj>_scales` U8 E8M0
[experts, out, in / 32] (transformers 5.24 integrations/mxfp4.py convert_moe_packed_tensors, vLLM 0.32
models/gpt_oss.py). Unquantized, the module is the parameter `<proj>` [experts, in, out]: each expert transposed,
as transformers' GptOssExperts and vLLM's unquantized gpt-oss loader hold it.

ModelOpt's NVFP4 (`quant_algo: NVFP4`) packs the same way in the Linear's own `weight` (U8 [out, in / 2]), with an
F8_E4M3 `weight_scale` per 16 and an F32 `weight_scale_2` that *multiplies* them (vLLM 0.32 modelopt.py
ModelOptNvFp4Config: `weight`, `weight_scale`, `weight_scale_2`, `input_scale`; ModelOpt's NVFP4QTensor dequantizes
e2m1 x scale x scale_2). Headers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fp8fix.errors import Fp8fixError, InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.io.checkpoint import Checkpoint, known_values
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.numerics.dtypes import E8M0
from fp8fix.registry.formats import FP4_SCHEMES, GPT_OSS_MXFP4, MODELOPT, MX_GROUP, FormatSpec, is_deepseek_v4
from fp8fix.registry.parallel import packed_siblings

#: The packed weight of an FP4 module (compressed-tensors NVFP4 / MXFP4: compressors/nvfp4/base.py
#: compression_param_names: `weight_packed`, `weight_scale`, `weight_global_scale`; `input_global_scale`).
FP4_PACKED = ".weight_packed"


@dataclass(frozen=True)
class Fp4Names:
    """How a dialect names an FP4 Linear's tensors: the packed weight's suffix (and the part of its name and the
    dtypes it must have), its scale's, its global scale's and input global scale's ("": none)."""

    packed: str
    scale: str
    global_scale: str
    input_scale: str
    dtypes: tuple[str, ...] | None = None  # None: any (a packed weight of another dtype is reported, not skipped)
    part: str = ""  # a part of the packed weight's name (DeepSeek-V4: only its routed experts are FP4)
    global_multiplies: bool = False  # ModelOpt's `weight_scale_2`: e2m1 x scale x it (compressed-tensors: / it)


#: The dtypes packed E2M1 bytes are stored as: U8 (compressed-tensors, ModelOpt, gpt-oss), I8 (DeepSeek-V4:
#: torch.float4_e2m1fn_x2 saved as int8).
PACKED_DTYPES = ("U8", "I8")
COMPRESSED_TENSORS_NAMES = Fp4Names(FP4_PACKED, "weight_scale", "weight_global_scale", "input_global_scale")
#: ModelOpt NVFP4: the Linear's own `weight`, U8 (an FP8 or BF16 `weight` is no FP4 module).
MODELOPT_NAMES = Fp4Names(".weight", "weight_scale", "weight_scale_2", "input_scale", ("U8",), global_multiplies=True)
#: DeepSeek-V4's routed experts: `ffn.experts.E.wK.weight` packed E2M1 as I8, their E8M0 scale `.scale`, no global
#: scale (vLLM 0.21 models/deepseek_v4.py maps `.experts.N.wK.scale` to the MXFP4 MoE method's weight_scale).
DEEPSEEK_V4_NAMES = Fp4Names(".weight", "scale", "", "", PACKED_DTYPES, part=".experts.")
#: Elements per scale of each FP4 scheme, by the dtype of its scale: NVFP4 an E4M3 scale per 16 (and a global
#: scale dividing them), MXFP4 an E8M0 byte per 32 (stored as U8).
FP4_BY_SCALE_DTYPE = {
    dtype: (scheme, FP4_SCHEMES[scheme][1])
    for dtype, scheme in (("F8_E4M3", "nvfp4"), ("U8", "mxfp4"), (E8M0, "mxfp4"))
}
#: gpt-oss's stacked experts: `<proj>_blocks` (packed E2M1, 16 bytes a block of 32) and `<proj>_scales`, of the two
#: projections transformers 5.24 (quantizer_mxfp4.py) and vLLM 0.32 (models/gpt_oss.py) read so; any other
#: `*_blocks` tensor is theirs to refuse, copied as it is.
GPT_OSS_BLOCKS, GPT_OSS_SCALES = "_blocks", "_scales"
GPT_OSS_PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Fp4Weight:
    """A module of packed E2M1 weights [out, in / 2] (two elements a byte, the lower nibble first) and the
    tensors that scale them, checked against its scheme (`scheme`: nvfp4 or mxfp4, from its scale's dtype)."""

    packed: TensorInfo
    module: str
    scheme: str | None  # None: no scale, or a scale of neither scheme's dtype (see `problem`)
    scale: TensorInfo | None  # NVFP4: F8_E4M3 [out, in / 16]; MXFP4: E8M0 bytes [out, in / 32]
    global_scale: TensorInfo | None  # NVFP4's F32 [1]: every scale is divided by it (ModelOpt: multiplied)
    input_global_scale: TensorInfo | None
    problem: Fp8fixError | None
    experts: int = 0  # gpt-oss's stacked experts (packed [experts, out, in / 32, 16]); 0: one Linear [out, in / 2]
    global_multiplies: bool = False  # ModelOpt's `weight_scale_2`: e2m1 x scale x it (compressed-tensors: / it)

    @property
    def cols(self) -> int:
        """Elements per row: two per packed byte."""
        shape = self.packed.shape
        if self.experts:
            return shape[2] * MX_GROUP if len(shape) == 4 else 0
        return shape[1] * 2 if len(shape) == 2 else 0

    @property
    def rows(self) -> int:
        """Rows of every element, the experts' one after another."""
        return self.packed.numel * 2 // self.cols if self.cols else 0

    def multiplier(self, global_scale: float) -> float:
        """What the module's group scales are multiplied by, given its global scale's value: ModelOpt's
        weight_scale_2 itself, compressed-tensors' 1 / weight_global_scale."""
        return global_scale if self.global_multiplies else 1.0 / global_scale

    @property
    def tensors(self) -> list[TensorInfo]:
        """Every tensor of the module fp8fix reads (the packed weight first)."""
        found = (self.packed, self.scale, self.global_scale, self.input_global_scale)
        return [t for t in found if t is not None]


def fp4_weights(ckpt: Checkpoint, fmt: FormatSpec | None) -> list[Fp4Weight]:
    """Every module with a packed FP4 weight, with its scales, each checked (`_fp4_problem`): compressed-tensors'
    `weight_packed`, ModelOpt NVFP4's U8 `weight`, DeepSeek-V4's experts (`Fp4Names`), gpt-oss's stacked experts."""
    if fmt is not None and fmt.name == GPT_OSS_MXFP4.name:
        return _gpt_oss_experts(ckpt)
    if is_deepseek_v4(fmt):
        if fmt is None or not fmt.fp4:  # (`expert_dtype: fp8`: its experts are block FP8)
            return []
        names = DEEPSEEK_V4_NAMES
    else:
        names = (
            MODELOPT_NAMES if fmt is not None and fmt.name == MODELOPT.name and fmt.fp4 else COMPRESSED_TENSORS_NAMES
        )
    found = []
    for t in ckpt.tensors.values():
        if not t.name.endswith(names.packed) or names.part not in t.name:
            continue
        if names.dtypes is not None and t.dtype not in names.dtypes:
            continue
        module = t.name.removesuffix(names.packed)
        scale = ckpt.tensors.get(f"{module}.{names.scale}")
        scheme, group = FP4_BY_SCALE_DTYPE.get(scale.dtype, (None, 0)) if scale is not None else (None, 0)
        global_scale = ckpt.tensors.get(f"{module}.{names.global_scale}") if names.global_scale else None
        input_global = ckpt.tensors.get(f"{module}.{names.input_scale}") if names.input_scale else None
        problem = _fp4_problem(t, scale, scheme, group, global_scale, input_global, fmt, names)
        scale = replace(scale, dtype=E8M0) if scale is not None and scheme == "mxfp4" else scale  # E8M0 bytes as U8
        multiplies = names.global_multiplies
        found.append(Fp4Weight(t, module, scheme, scale, global_scale, input_global, problem, 0, multiplies))
    return found


def _gpt_oss_experts(ckpt: Checkpoint) -> list[Fp4Weight]:
    """gpt-oss's stacked MXFP4 experts: every `<proj>_blocks` with its `<proj>_scales`, checked (`_experts_problem`)."""
    found = []
    names = tuple(f"experts.{p}{GPT_OSS_BLOCKS}" for p in GPT_OSS_PROJECTIONS)  # what the loaders read as MXFP4
    for t in ckpt.tensors.values():
        if not t.name.endswith(names):
            continue
        module = t.name.removesuffix(GPT_OSS_BLOCKS)
        scale = ckpt.tensors.get(module + GPT_OSS_SCALES)
        problem = _experts_problem(t, scale)
        scale = replace(scale, dtype=E8M0) if scale is not None else None  # E8M0 bytes stored as U8
        experts = t.shape[0] if t.shape else 0
        found.append(Fp4Weight(t, module, "mxfp4", scale, None, None, problem, experts=experts))
    return found


def _experts_problem(blocks: TensorInfo, scales: TensorInfo | None) -> Fp8fixError | None:
    """Why gpt-oss experts cannot be read as MXFP4 (blocks U8 [experts, out, in / 32, 16], E8M0 scales U8
    [experts, out, in / 32]), or None."""
    where = f"{blocks.path.name}: gpt-oss MXFP4 experts '{blocks.name}'"
    half = MX_GROUP // 2
    if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[3] != half or 0 in blocks.shape:
        return InvalidCheckpoint(
            f"{where} are {blocks.dtype} {list(blocks.shape)}; gpt-oss packs them U8 [experts, out, in / 32, 16]"
        )
    if scales is None:
        return InvalidCheckpoint(f"{where} have no scales '{blocks.name.removesuffix(GPT_OSS_BLOCKS)}_scales'")
    if scales.dtype not in ("U8", E8M0) or scales.shape != blocks.shape[:3]:
        return InvalidCheckpoint(
            f"{scales.path.name}: gpt-oss MXFP4 scales '{scales.name}' are {scales.dtype} {list(scales.shape)}; "
            f"its experts {list(blocks.shape)} need E8M0 bytes U8 {list(blocks.shape[:3])} (one per 32 elements)"
        )
    return None


def _fp4_problem(
    packed: TensorInfo,
    scale: TensorInfo | None,
    scheme: str | None,
    group: int,
    global_scale: TensorInfo | None,
    input_global: TensorInfo | None,
    fmt: FormatSpec | None,
    names: Fp4Names,
) -> Fp8fixError | None:
    """Why an FP4 module cannot be read as its scheme says (compressed-tensors' NVFP4 / MXFP4 layout, ModelOpt's
    NVFP4: `names`), or None."""
    where = f"{packed.path.name}: FP4 weight '{packed.name}'"
    if packed.dtype not in PACKED_DTYPES or len(packed.shape) != 2 or 0 in packed.shape:
        return InvalidCheckpoint(f"{where} is {packed.dtype} {list(packed.shape)}; packed FP4 is U8 [out, in / 2]")
    if scale is None or scheme is None:
        scale_name = f"{packed.name.removesuffix(names.packed)}.{names.scale}"
        said = f"has no scale '{scale_name}'" if scale is None else f"has a {scale.dtype} scale '{scale.name}'"
        return InvalidCheckpoint(
            f"{where} {said}; NVFP4 scales are F8_E4M3 (one per 16 elements), MXFP4's U8 E8M0 bytes (one per 32)"
        )
    rows, cols = packed.shape[0], packed.shape[1] * 2
    if cols % group:
        return UnsupportedCheckpoint(
            f"{where} {list(packed.shape)} holds rows of {cols} elements, not whole groups of {group}; fp8fix "
            "reads FP4 weights without padding"
        )
    if scale.shape != (rows, cols // group):
        return InvalidCheckpoint(
            f"{scale.path.name}: {scheme.upper()} scale '{scale.name}' has shape {list(scale.shape)}; its weight "
            f"'{packed.name}' of {rows} x {cols} elements has one per {group} elements of a row: "
            f"[{rows}, {cols // group}]"
        )
    needs_global = scheme == "nvfp4" and bool(names.global_scale)  # (a dialect without one: its config check)
    for name, t, needed in ((names.global_scale, global_scale, needs_global), (names.input_scale, input_global, False)):
        if t is None and needed:
            return InvalidCheckpoint(f"{where} has no '{name}'; an NVFP4 weight's scales are scaled by it")
        if t is not None and (t.dtype != "F32" or t.numel != 1):
            return InvalidCheckpoint(
                f"{t.path.name}: '{t.name}' is {t.dtype} {list(t.shape)}; a global scale is one F32 value"
            )
    if fmt is not None and scheme not in fmt.fp4:
        return InvalidCheckpoint(
            f"{where} is {scheme.upper()} (its scale is {scale.dtype}), but config.json's quantization_config "
            f"declares no {scheme} config group ({fmt.label}): the config does not match the weights"
        )
    return None


@dataclass(frozen=True)
class PackedNvfp4:
    """NVFP4 modules vLLM and SGLang pack into one layer (q / k / v, gate / up: `packed_siblings`), in the layer's
    order, and the multiplier each module's scales are worth (`Fp4Weight.multiplier`; None: not read, headers
    only)."""

    modules: tuple[Fp4Weight, ...]
    multipliers: tuple[float, ...] | None

    @property
    def differ(self) -> bool:
        return self.multipliers is not None and len(set(self.multipliers)) > 1


def packed_nvfp4(ckpt: Checkpoint, fp4: dict[str, Fp4Weight]) -> list[PackedNvfp4]:
    """Every packed layer of NVFP4 modules with one global scale each (a layer some of whose modules are not
    such: none)."""
    nvfp4 = {w.module: w for w in fp4.values() if w.scheme == "nvfp4" and w.global_scale is not None}
    found = []
    for module in nvfp4:
        siblings = packed_siblings(module)
        if siblings[0] != module or len(siblings) == 1 or not all(s in nvfp4 for s in siblings):
            continue
        modules = tuple(nvfp4[s] for s in siblings)
        values = [known_values(ckpt, w.global_scale) for w in modules if w.global_scale is not None]
        readable = all(v is not None and len(v) == 1 and v[0] > 0 and math.isfinite(v[0]) for v in values)
        multipliers = tuple(w.multiplier(v[0]) for w, v in zip(modules, values, strict=True) if v) if readable else None
        found.append(PackedNvfp4(modules, multipliers))
    return found

"""`--blocks 128x128`: an MXFP8 or MXFP4 checkpoint written as 128 x 128 block FP8, for runtimes without MX kernels.

Hopper and MI300 runtimes compute block FP8 (DeepSeek-V3's 128 x 128 grid) with kernels of their own; an
MXFP8 checkpoint's scale per 32 elements of a row they either cannot load or requantize at every load. Here
each weight is written once, block row by block row (`MxBlockCodes`: `numerics.mx_blocks`, one power of two
per block, each value rounded once where it must move, counted), its E8M0 `weight_scale` [out, in / 32]
becoming the F32 grid [ceil(out / 128), ceil(in / 128)] of those powers of two (`MxBlockScales`). An MXFP4 module
(packed E2M1, `fp4_modules`) is written the same way, its elements made e4m3fn codes first (exact: every E2M1 value
is one), as `<module>.weight` where `weight_packed` was: for Hopper and MI300, which have no FP4. The config
stays compressed-tensors (its `ignore` and `targets` as they are): every group `float-quantized` with
llm-compressor's FP8_BLOCK scheme, weights `strategy: block`, `block_structure` [128, 128], activations
quantized at run time per group of 128. The scales are read when the rows are written (`ScaleRef`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint, some
from fp8fix.io.checkpoint import CONFIG
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import CheckpointModel, unquantized_linears
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.numerics.mx import MX_BLOCK
from fp8fix.numerics.mx_blocks import BLOCK
from fp8fix.plan import planner
from fp8fix.plan.compressed_tensors import linear_group_config
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan, MxBlockCodes, MxBlockScales, OutputTensor, ScaleRef
from fp8fix.plan.scheme import source_scheme
from fp8fix.registry.formats import MODELOPT, MODELOPT_CONFIG, quantization_config
from fp8fix.verdicts import loader_verdicts

#: llm-compressor's FP8_BLOCK scheme (compressed-tensors 0.20 quantization/quant_scheme.py FP8_BLOCK).
FP8_BLOCK_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "block",
    "block_structure": [BLOCK, BLOCK],
    "dynamic": False,
}
FP8_BLOCK_ACTIVATIONS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "group",
    "group_size": BLOCK,
    "dynamic": True,
}


@dataclass
class ReblockedModule:
    """One MXFP8 weight written at 128 x 128 block scales; the figures are filled in once written."""

    module: str
    weight: str
    blocks: int
    blocks_exact: int | None = None
    blocks_rounded: int | None = None
    values_rounded: int | None = None
    max_steps: float | None = None  # e4m3fn steps at the new value, at most 0.5
    max_error: float | None = None


def plan_reblocked_model(model: CheckpointModel, blocks: str) -> ConversionPlan:
    """Every MXFP8 weight and MXFP4 module of `model` at one power of two per 128 x 128 block; the config
    FP8_BLOCK's."""
    ckpt = model.checkpoint
    fmt = model.require_format()
    mxfp4 = [w for w in model.fp4.values() if w.scheme == "mxfp4"]
    if not fmt.mx and not mxfp4:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: re-blocks MXFP8 and MXFP4 checkpoints; {fmt.label} scales are not MX blocks (for "
            "block FP8, --tp pads and --scales ue8m0 writes powers of two)"
        )
    if fmt.name == MODELOPT.name:
        _require_modelopt_reblockable(model, blocks)
    stacked = [w.module for w in mxfp4 if w.experts]
    if stacked:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: re-blocks MXFP8 weights and MXFP4 Linear modules; {len(stacked)} are gpt-oss's "
            f"stacked MXFP4 experts (e.g. '{stacked[0]}'), not re-blocked: --to bf16 writes them unquantized"
        )
    others = [w.module for w in model.fp4.values() if w.scheme != "mxfp4"]
    others += [] if fmt.mx else [w.module for w in model.module_weights()]
    if others:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: {len(others)} module(s) beside the MX ones are neither MXFP8 nor MXFP4 (e.g. "
            f"'{others[0]}'): not re-blocked yet; --to bf16 writes every one unquantized"
        )
    arch_name, _ = model.require_architecture()
    model.require_convertible()
    replacements: dict[str, list[OutputTensor]] = {}
    modules = []
    weights = [(w.tensor, w.scale, w.name, "e4m3") for w in model.module_weights()]
    weights += [(w.packed, w.scale, f"{w.module}.weight", "e2m1") for w in mxfp4]
    for t, scale, name, element in weights:
        assert scale is not None  # require_convertible: every MX weight has its scale
        cols = t.shape[1] * (2 if element == "e2m1" else 1)
        rows = tuple(_block_rows(t, scale, name, cols, element))
        grid = (-(-t.shape[0] // BLOCK), -(-cols // BLOCK))
        replacements[t.name] = [OutputTensor(name, E4M3FN, (t.shape[0], cols), list(rows), t.name)]
        replacements[scale.name] = [OutputTensor(scale.name, "F32", grid, [MxBlockScales(rows)], scale.name)]
        modules.append(ReblockedModule(name.removesuffix(".weight"), name, grid[0] * grid[1]))
    shards = [planner.plan_shard(name, h.metadata, h.tensors, replacements) for name, h in ckpt.shards.items()]
    planner.check_pieces_inside_sources(shards, ckpt.tensors)
    dropped: list[str] = []
    if fmt.name == MODELOPT.name:  # written as compressed-tensors: ModelOpt's side config would say MXFP8 still
        written: dict[str, Any] = {t.name: t for s in shards for t in s.tensors}  # (dtype and shape read)
        linears = unquantized_linears(written)
        config, ignored = linear_group_config(
            ckpt.config, "float-quantized", dict(FP8_BLOCK_WEIGHTS), dict(FP8_BLOCK_ACTIVATIONS), linears
        )
        config_edits = [
            f"quantization_config: {fmt.label} -> compressed-tensors float-quantized, weights e4m3fn in blocks of "
            f"{BLOCK}x{BLOCK} (F32 powers of two), activations dynamic per group of {BLOCK} (llm-compressor's "
            "FP8_BLOCK)" + (f"; ignore: {some(ignored, 3)}" if ignored else "")
        ]
        dropped = [MODELOPT_CONFIG] if (ckpt.root / MODELOPT_CONFIG).is_file() else []
        config_files = {CONFIG: (config, config_edits)}
    else:
        config_files = {CONFIG: reblocked_config(ckpt.config)}
    plan = planner.whole_model_plan(model, arch_name, shards, config_files, reblocked=modules, dropped_files=dropped)
    plan.source_loaders = loader_verdicts(model)
    plan.loaders = loader_verdicts(output_model(plan, model))
    return plan


def _require_modelopt_reblockable(model: CheckpointModel, blocks: str) -> None:
    """A ModelOpt MXFP8 checkpoint is written as one compressed-tensors group: refuse, named, what that cannot say
    (kv-cache scales, which a compressed-tensors config would have to declare; MX modules its lists leave out)."""
    if model.kv_cache_scales:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: {len(model.kv_cache_scales)} kv-cache scale(s) (e.g. "
            f"'{model.kv_cache_scales[0].name}') of a ModelOpt checkpoint are not carried into compressed-tensors "
            "yet: --to bf16 writes it unquantized"
        )
    found = source_scheme(model)
    excluded = set(found[1] if found else ()) & {w.module for w in model.module_weights()}
    if excluded:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: the ModelOpt config excludes MX module(s) from quantization "
            f"({some(sorted(excluded), 3)}); what its loaders do with their codes has no block-FP8 form: --to bf16 "
            "writes every weight unquantized"
        )


def _block_rows(t: TensorInfo, scale: TensorInfo, name: str, cols: int, element: str) -> list[MxBlockCodes]:
    """One piece per 128 rows of weight `t` (`cols` elements a row, e4m3 codes or packed E2M1), with those rows'
    E8M0 bytes."""
    row_bytes = t.shape[1]
    subs = cols // MX_BLOCK
    return [
        MxBlockCodes(
            t.path,
            t.start + first * row_bytes,
            t.start + last * row_bytes,
            cols,
            ScaleRef(scale.path, scale.start + first * subs, (last - first) * subs, scale.dtype, scale.name),
            name,
            element,
        )
        for first in range(0, t.shape[0], BLOCK)
        for last in (min(t.shape[0], first + BLOCK),)
    ]


def reblocked_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """config.json with every MXFP8 config group FP8_BLOCK's, and the edit lines."""
    out = copy.deepcopy(config)
    qc = quantization_config(out)
    assert qc is not None  # an MXFP8 checkpoint's
    source = qc.get("format")
    qc["format"] = "float-quantized"
    for group in qc["config_groups"].values():
        group["weights"] = dict(FP8_BLOCK_WEIGHTS)
        group["input_activations"] = dict(FP8_BLOCK_ACTIVATIONS)
        group.pop("format", None)
    edits = [
        f"quantization_config: format {source!r} -> 'float-quantized'; every config group's weights MX (groups of "
        "32, E8M0) -> e4m3fn in blocks of 128x128 (F32 powers of two), activations dynamic per group of 128 "
        "(llm-compressor's FP8_BLOCK)"
    ]
    return out, edits

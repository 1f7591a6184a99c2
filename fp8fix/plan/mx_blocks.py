"""`--blocks 128x128`: an MXFP8 checkpoint written as 128 x 128 block FP8, for runtimes without MX kernels.

Hopper and MI300 runtimes compute block FP8 (DeepSeek-V3's 128 x 128 grid) with kernels of their own; an
MXFP8 checkpoint's scale per 32 elements of a row they either cannot load or requantize at every load. Here
each weight is written once, block row by block row (`MxBlockCodes`: `numerics.mx_blocks`, one power of two
per block, each value rounded once where it must move, counted), its E8M0 `weight_scale` [out, in / 32]
becoming the F32 grid [ceil(out / 128), ceil(in / 128)] of those powers of two (`MxBlockScales`). The config
stays compressed-tensors (its `ignore` and `targets` as they are): every group `float-quantized` with
llm-compressor's FP8_BLOCK scheme, weights `strategy: block`, `block_structure` [128, 128], activations
quantized at run time per group of 128. The scales are read when the rows are written (`ScaleRef`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel, Fp8Weight
from fp8fix.numerics.mx import MX_BLOCK
from fp8fix.numerics.mx_blocks import BLOCK
from fp8fix.plan import planner
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan, MxBlockCodes, MxBlockScales, OutputTensor, ScaleRef
from fp8fix.registry.formats import quantization_config
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
    """Every MXFP8 weight of `model` at one power of two per 128 x 128 block; the config FP8_BLOCK's."""
    ckpt = model.checkpoint
    fmt = model.require_format()
    if not fmt.mx:
        raise UnsupportedCheckpoint(
            f"--blocks {blocks}: re-blocks MXFP8 checkpoints; {fmt.label} scales are not MX blocks (for block FP8, "
            "--tp pads and --scales ue8m0 writes powers of two)"
        )
    arch_name, _ = model.require_architecture()
    model.require_convertible()
    replacements: dict[str, list[OutputTensor]] = {}
    modules = []
    for w in model.module_weights():
        assert w.scale is not None  # require_convertible: every MX weight has its scale
        rows = tuple(_block_rows(w))
        t = w.tensor
        grid = (-(-t.shape[0] // BLOCK), -(-t.shape[1] // BLOCK))
        replacements[w.name] = [OutputTensor(w.name, t.dtype, t.shape, list(rows), w.name)]
        replacements[w.scale.name] = [OutputTensor(w.scale.name, "F32", grid, [MxBlockScales(rows)], w.scale.name)]
        modules.append(ReblockedModule(w.module, w.name, grid[0] * grid[1]))
    shards = [planner.plan_shard(name, h.metadata, h.tensors, replacements) for name, h in ckpt.shards.items()]
    planner.check_pieces_inside_sources(shards, ckpt.tensors)
    plan = planner.whole_model_plan(
        model, arch_name, shards, {CONFIG: reblocked_config(ckpt.config)}, reblocked=modules
    )
    plan.source_loaders = loader_verdicts(model)
    plan.loaders = loader_verdicts(output_model(plan, model))
    return plan


def _block_rows(w: Fp8Weight) -> list[MxBlockCodes]:
    """One piece per 128 rows, with those rows' E8M0 bytes."""
    t, scale = w.tensor, w.scale
    assert scale is not None
    rows, cols = t.shape
    subs = cols // MX_BLOCK
    return [
        MxBlockCodes(
            t.path,
            t.start + first * cols,
            t.start + last * cols,
            cols,
            ScaleRef(scale.path, scale.start + first * subs, (last - first) * subs, scale.dtype, scale.name),
            w.name,
        )
        for first in range(0, rows, BLOCK)
        for last in (min(rows, first + BLOCK),)
    ]


def reblocked_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """config.json with every MXFP8 config group FP8_BLOCK's, and the edit lines."""
    out = copy.deepcopy(config)
    qc = quantization_config(out)
    assert qc is not None  # an MXFP8 checkpoint's
    qc["format"] = "float-quantized"
    for group in qc["config_groups"].values():
        group["weights"] = dict(FP8_BLOCK_WEIGHTS)
        group["input_activations"] = dict(FP8_BLOCK_ACTIVATIONS)
        group.pop("format", None)
    edits = [
        "quantization_config: format 'mxfp8-quantized' -> 'float-quantized'; every config group's weights MXFP8 "
        "(groups of 32, E8M0) -> block 128x128 (F32 powers of two), activations dynamic per group of 128 "
        "(llm-compressor's FP8_BLOCK)"
    ]
    return out, edits

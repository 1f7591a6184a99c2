"""`--blocks mx`: a block-FP8 checkpoint written as MXFP8, for GPUs with MX kernels (Blackwell).

Block FP8 (DeepSeek-V3's 128 x 128 grid, or any block whose width is a multiple of 32) has one scale per block;
MXFP8 one E8M0 byte b (2^(b - 127)) per 32 elements of a row. A block whose scale is a power of two 2^k is MXFP8
already: its codes are kept byte for byte and every 32 elements of its rows get the byte k + 127 (exact: block
FP8 checkpoints written with UE8M0 scales, DeepSeek-V3.1's, convert without a single change of value). Any other
block first gets a power of two as `--scales ue8m0` gives it (`numerics.ue8m0`: requantized once, at the smallest
power that holds its largest value or half of it, whichever errs less; counted and reported), then is written so:
the weight's rows are `Ue8m0Codes` pieces, its scale an `MxScales` piece of those rows' powers of two.

OUTPUT is compressed-tensors MXFP8 (`format: mxfp8-quantized`, llm-compressor's MXFP8 preset: weights in groups
of 32 with uint8 E8M0 scales, activations quantized at run time the same way); the scales are `weight_scale`
(block FP8's `weight_scale_inv` renamed) of U8 [out, in / 32]. A compressed-tensors source keeps its targets and
`ignore`; a `quant_method: fp8` one gets one group targeting Linear, every Linear module without an FP8 weight in
`ignore` (`model.ignore_linears`). The scales are read when the rows are written (`ScaleRef`).
"""

from __future__ import annotations

import copy
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint, some
from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel, ignore_linears, unquantized_linears
from fp8fix.numerics.dtypes import E4M3FN, is_fp8
from fp8fix.numerics.mx import MX_BLOCK
from fp8fix.plan import planner
from fp8fix.plan.compressed_tensors import linear_group_config
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan, MxScales, OutputTensor
from fp8fix.plan.scheme import named_modules
from fp8fix.plan.ue8m0 import Ue8m0Change, row_pieces, ue8m0_module
from fp8fix.registry.formats import COMPRESSED_TENSORS, compressed_tensors_names, locations, quantization_config
from fp8fix.verdicts import loader_verdicts

#: compressed-tensors' MXFP8 preset (compressed_tensors 0.20 quantization/quant_scheme.py MXFP8), what vLLM 0.32
#: takes as MXFP8 (CompressedTensorsConfig._is_mxfp8: float 8-bit, group 32, symmetric, torch.uint8 scales).
MXFP8_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "group",
    "group_size": MX_BLOCK,
    "symmetric": True,
    "dynamic": False,
    "scale_dtype": "torch.uint8",
    "zp_dtype": "torch.uint8",
}
MXFP8_ACTIVATIONS = {**MXFP8_WEIGHTS, "dynamic": True}
MXFP8_FORMAT = "mxfp8-quantized"


def plan_mx_model(model: CheckpointModel) -> ConversionPlan:
    """Every block-scaled FP8 weight of `model` as MXFP8; the config compressed-tensors MXFP8's."""
    ckpt = model.checkpoint
    fmt = model.require_format()
    _require_blocks(model)
    arch_name, _ = model.require_architecture()
    model.require_convertible()
    assert fmt.block is not None  # _require_blocks
    replacements: dict[str, list[OutputTensor]] = {}
    change = Ue8m0Change(mx=True)
    for w in model.module_weights():
        assert w.scale is not None
        rows = tuple(row_pieces(w, fmt.block, vllm=False))  # vLLM's DeepGEMM requantization is not MXFP8's
        t = w.tensor
        scale_name = next(iter(compressed_tensors_names(w.scale.name)), w.scale.name)
        replacements[w.name] = [OutputTensor(w.name, t.dtype, t.shape, list(rows), w.name)]
        scale_shape = (t.shape[0], t.shape[1] // MX_BLOCK)
        replacements[w.scale.name] = [OutputTensor(scale_name, "U8", scale_shape, [MxScales(rows)], w.scale.name)]
        change.modules.append(ue8m0_module(w, fmt.block))
    shards = [planner.plan_shard(name, h.metadata, h.tensors, replacements) for name, h in ckpt.shards.items()]
    planner.check_pieces_inside_sources(shards, ckpt.tensors)
    config = mx_config(ckpt.config, unquantized_linears(_output_tensors(shards)))
    plan = planner.whole_model_plan(model, arch_name, shards, {CONFIG: config}, ue8m0=change)
    plan.source_loaders = loader_verdicts(model)
    plan.loaders = loader_verdicts(output_model(plan, model))
    return plan


def _require_blocks(model: CheckpointModel) -> None:
    """Refuse, named, what MXFP8 cannot hold as this conversion writes it."""
    fmt = model.require_format()
    if fmt.block is None or fmt.mx:
        what = "already MXFP8" if fmt.mx else f"{fmt.label}: its scales are not per block"
        raise UnsupportedCheckpoint(f"--blocks mx writes block FP8 checkpoints as MXFP8; this one is {what}")
    if fmt.block[1] % MX_BLOCK:
        raise UnsupportedCheckpoint(
            f"--blocks mx: blocks {fmt.block[0]}x{fmt.block[1]} are not whole groups of {MX_BLOCK} along a row, "
            "so a group of MXFP8 would straddle two block scales"
        )
    weights = model.module_weights()
    fp8 = [n for n, t in model.checkpoint.tensors.items() if is_fp8(t.dtype)]
    not_modules = sorted(set(fp8) - {w.name for w in weights})
    problems = [
        (w.name, why)
        for w in weights
        for why in (
            "stacked experts (one tensor for all experts)" if w.stacked else None,
            "not block-scaled" if not w.per_block(fmt.block) else None,
            f"{w.tensor.dtype}, not e4m3fn (MX elements are OCP E4M3)" if w.tensor.dtype != E4M3FN else None,
            f"{w.tensor.shape[1]} columns, not whole groups of {MX_BLOCK}" if w.tensor.shape[1] % MX_BLOCK else None,
            "a static input scale (MXFP8 activations are quantized at run time)" if w.input_scale else None,
        )
        if why
    ]
    problems += [(n, "an FP8 tensor that is no module weight") for n in not_modules]
    problems += [(t.name, "a kv-cache scale (not carried into MXFP8)") for t in model.kv_cache_scales]
    if problems:
        shown = some([f"'{name:.120}': {why}" for name, why in problems], 3, width=200)
        count = len({name for name, _ in problems})
        raise UnsupportedCheckpoint(f"--blocks mx: {count} tensor(s) MXFP8 cannot hold as written: {shown}")
    skipped = _named_fp8_modules(model)
    if skipped:
        raise UnsupportedCheckpoint(
            f"--blocks mx: the source's config lists FP8 module(s) as not quantized ({some(skipped, 3)}); what "
            "its loaders do with their codes has no MXFP8 form: take them off the list, or write them in BF16 "
            "first (--dequantize)"
        )


def _named_fp8_modules(model: CheckpointModel) -> list[str]:
    """FP8 modules that a config name list of modules left unquantized names (compressed-tensors' `ignore`,
    `quant_method: fp8`'s `modules_to_not_convert` / `ignored_layers`), as its loader matches them."""
    qc = quantization_config(model.checkpoint.config) or {}
    fp8 = {w.module for w in model.module_weights()}
    found: list[str] = []
    for name_list in (n for n in model.require_format().name_lists if n.file == CONFIG and n.unquantized):
        for _, node, key in locations(qc, name_list.path.split("."), ""):
            entries = node[key] if isinstance(node[key], list) else []
            found += [m for m in named_modules(model, entries, name_list.grammar) if m in fp8]
    return list(dict.fromkeys(found))


def _output_tensors(shards: list[Any]) -> dict[str, Any]:
    """OUTPUT's tensors by name, with what `unquantized_linears` reads of them (dtype, shape)."""
    return {t.name: t for s in shards for t in s.tensors}


def mx_config(config: dict[str, Any], linears: list[str]) -> tuple[dict[str, Any], list[str]]:
    """config.json written as compressed-tensors MXFP8, and the edit lines. `linears`: OUTPUT's Linear modules
    without an FP8 weight, ignored where a group targets them."""
    out = copy.deepcopy(config)
    qc = quantization_config(out)
    assert qc is not None  # a block FP8 checkpoint's
    source = qc.get("quant_method")
    if source == COMPRESSED_TENSORS.name:
        for group in qc["config_groups"].values():
            group["weights"] = dict(MXFP8_WEIGHTS)
            group["input_activations"] = dict(MXFP8_ACTIVATIONS)
            group.pop("format", None)
        qc["format"] = MXFP8_FORMAT
        out, added = ignore_linears(out, linears)
    else:
        out, added = linear_group_config(out, MXFP8_FORMAT, dict(MXFP8_WEIGHTS), dict(MXFP8_ACTIVATIONS), linears)
    edits = [
        f"quantization_config: {source} block FP8 -> compressed-tensors format '{MXFP8_FORMAT}': weights in groups "
        f"of {MX_BLOCK} with E8M0 (uint8) scales, activations dynamic in groups of {MX_BLOCK} (llm-compressor's "
        "MXFP8 preset)"
    ]
    if added:
        edits.append(f"quantization_config.ignore: + {some(added, 3)} (Linear modules without FP8 weights)")
    return out, edits

"""The conversion `convert` writes for a target: the layout and format asked for, or the candidate whose output
`--target`'s loaders take best (`targets`), planned whole (`planner`); an unquantized dtype planned by
`unquantized`. Above the three, so none of them needs another's caller."""

from __future__ import annotations

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.model import CheckpointModel
from fp8fix.plan.block_mx import plan_mx_model
from fp8fix.plan.fp4_kept import check_fp4_kept, require_fp4_encoding
from fp8fix.plan.fp4_shared import copy_plan, differing_layers, share_global_scales
from fp8fix.plan.mx_blocks import plan_reblocked_model
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.plan.planner import channel_format, plan_conversion, require_fp8_scales
from fp8fix.plan.targets import best, candidates
from fp8fix.plan.unquantized import plan_unquantized_model
from fp8fix.vocab import ENCODING_NAMES, ConvertTo, Encoding, Layout, OutputFormat, Target


def plan_for_target(
    model: CheckpointModel,
    layout: Layout | None,
    to: ConvertTo | None = None,
    target: Target = "auto",
    output_format: OutputFormat | None = None,
    tp: int | None = None,
    tp_bf16: bool = False,
    dequantize: tuple[str, ...] = (),
    scales: str | None = None,
    blocks: str | None = None,
) -> ConversionPlan:
    """The conversion `convert` writes: `layout` and `output_format` where given, the rest what `target`'s
    loaders take best. An explicit layout alone keeps the source's format: it asks for that change only
    (`channel` excepted: compressed-tensors is the one format vLLM takes it in). `to` an unquantized
    dtype (bf16, float16): the whole model written so (`unquantized.py`), the one conversion of FP4 modules but
    two: MXFP4 re-blocked (`--blocks 128x128`), and NVFP4 modules of a packed layer whose global scales differ given
    the layer's one (`fp4_shared`) for every target but transformers (which reads each module's own)."""
    fp8_rewrite = (to is None or to in ENCODING_NAMES) and blocks != "128x128"  # (MXFP4 modules: re-blocked)
    share = fp8_rewrite and target != "transformers" and bool(model.fp4) and bool(differing_layers(model))
    only_fp4 = bool(model.fp4) and not model.weights  # nothing FP8 to convert
    if model.fp4 and fp8_rewrite:
        plain = (layout, to, output_format, tp, dequantize, scales, blocks) == (None, None, None, None, (), None, None)
        if only_fp4 and not (share and plain):  # FP4 modules are written unquantized, re-blocked or shared
            raise _fp4_refusal(model)
        require_fp4_encoding(model, to)
    if only_fp4 and share:
        plan = copy_plan(model)
    elif blocks is not None:
        plan = plan_mx_model(model) if blocks == "mx" else plan_reblocked_model(model, blocks)
    elif to is not None and to not in ENCODING_NAMES:
        plan = plan_unquantized_model(model, to, tp)
    else:
        if scales and layout is None and any(w.fused and w.scale_kind == "block" for w in model.module_weights()):
            layout = "fused"  # `--scales ue8m0` rewrites block-scaled modules kept as they are: fused ones stay fused
        plan = _fp8_plan(model, layout, to, output_format, target, (tp, tp_bf16, dequantize, scales))
    plan.target = target
    if fp8_rewrite:
        check_fp4_kept(plan, model)  # FP4 modules beside FP8 ones pass through as they are, or it is refused
    if share:  # for vLLM and SGLang, which pack q / k / v and gate / up with one global scale
        share_global_scales(plan, model)
    return plan


def _fp8_plan(
    model: CheckpointModel,
    layout: Layout | None,
    encoding: Encoding | None,
    output_format: OutputFormat | None,
    target: Target,
    rest: tuple[int | None, bool, tuple[str, ...], str | None],
) -> ConversionPlan:
    """An FP8 rewrite: `layout` and `output_format` where given, else `target`'s best candidate (`rest`: tp,
    tp_bf16, dequantize, scales, as `plan_conversion` takes them)."""
    tp, tp_bf16, dequantize, scales = rest
    require_fp8_scales(model)
    if layout is not None and output_format is None:  # channel: only compressed-tensors holds it
        output_format = (channel_format(model) or "keep") if layout == "channel" else "keep"
    if layout is not None and output_format is not None:
        return plan_conversion(model, layout, encoding, output_format, tp, tp_bf16, dequantize, scales)
    model.require_format()
    _, arch = model.require_architecture()
    model.require_convertible()
    found = candidates(model, layout, output_format, to=encoding)
    if not found:  # every candidate refused: plan the first for its error
        lay = layout or arch.default_layout
        return plan_conversion(model, lay, encoding, output_format or "keep", tp, tp_bf16, dequantize, scales)
    chosen = best(found, target, arch.default_layout)
    only_layout = encoding is None and tp is None and not tp_bf16 and not dequantize and not scales
    if only_layout and chosen.whole and not chosen.plan.sketch:  # the candidate is the conversion, planned
        plan = chosen.plan
    else:
        plan = plan_conversion(model, chosen.layout, encoding, chosen.output_format, tp, tp_bf16, dequantize, scales)
    plan.layout_was_default = layout is None
    return plan


def _fp4_refusal(model: CheckpointModel) -> UnsupportedCheckpoint:
    """FP4 modules are read and written unquantized; every FP8 rewrite (layouts, encodings, TP, block scales) is
    planned for FP8 weights, and an FP4 module's config group and tensors would have to follow it."""
    schemes = sorted({w.scheme.upper() for w in model.fp4.values() if w.scheme})
    first = next(iter(model.fp4))
    linear = not any(w.experts for w in model.fp4.values())  # gpt-oss's stacked experts are not re-blocked
    return UnsupportedCheckpoint(
        f"{model.checkpoint.root.name}: {len(model.fp4)} FP4 module(s) ({', '.join(schemes)}; '{first}', ...) are "
        "converted to BF16 or F16 only, yet"
        + (" (MXFP4 Linear modules also to 128x128 block FP8, --blocks 128x128)" if linear else "")
        + ": `fp8fix convert "
        "SOURCE OUTPUT --to bf16` writes every FP4 and FP8 weight unquantized; `fp8fix inspect SOURCE` describes the "
        "FP4 modules"
    )

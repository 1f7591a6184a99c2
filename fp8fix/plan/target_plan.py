"""The conversion `convert` writes for a target: the layout and format asked for, or the candidate whose output
`--target`'s loaders take best (`targets`), planned whole (`planner`); an unquantized dtype planned by
`unquantized`. Above the three, so none of them needs another's caller."""

from __future__ import annotations

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.model import CheckpointModel
from fp8fix.plan.block_mx import plan_mx_model
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
    dtype (bf16, float16): the whole model written so (`unquantized.py`), the one conversion of FP4 modules."""
    if model.fp4 and (to is None or to in ENCODING_NAMES) and blocks != "128x128":  # (MXFP4: re-blocked)
        raise _fp4_refusal(model)
    if blocks is not None:
        plan = plan_mx_model(model) if blocks == "mx" else plan_reblocked_model(model, blocks)
        plan.target = target
        return plan
    if scales and layout is None and any(w.fused and w.scale_kind == "block" for w in model.module_weights()):
        layout = "fused"  # `--scales ue8m0` rewrites block-scaled modules kept as they are: fused ones stay fused
    if to is not None and to not in ENCODING_NAMES:
        plan = plan_unquantized_model(model, to, tp)
        plan.target = target
        return plan
    require_fp8_scales(model)
    encoding: Encoding | None = to  # narrowed: an FP8 encoding or none
    if layout is not None and output_format is None:  # channel: only compressed-tensors holds it
        output_format = (channel_format(model) or "keep") if layout == "channel" else "keep"
    if layout is None or output_format is None:
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
            lay, fmt = chosen.layout, chosen.output_format
            plan = plan_conversion(model, lay, encoding, fmt, tp, tp_bf16, dequantize, scales)
        plan.layout_was_default = layout is None
    else:
        plan = plan_conversion(model, layout, encoding, output_format, tp, tp_bf16, dequantize, scales)
    plan.target = target
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

"""Working out the whole conversion plan from the checkpoint's description.

Order matters and is fixed here: the fused-module layout first (per module, see
`fused.py`; stacked experts, see `experts.py`), then every source shard's output
tensors, then (with `--to`) the FP8 encoding on top of that (see `encoding.py`),
so requantized shards are normalized before they are requantized.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.io.checkpoint import CONFIG, Checkpoint
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import CheckpointModel
from fp8fix.plan import compressed_tensors
from fp8fix.plan.channel import plan_channel_weights
from fp8fix.plan.config_edit import output_config
from fp8fix.plan.dequantized import plan_bf16_modules
from fp8fix.plan.encoding import plan_encoding
from fp8fix.plan.experts import plan_experts
from fp8fix.plan.fused import plan_fused_module
from fp8fix.plan.output import output_model
from fp8fix.plan.padding import plan_tp_padding
from fp8fix.plan.pieces import (
    ConversionPlan,
    CopyRange,
    Fill,
    ModuleChange,
    MxBlockScales,
    MxScales,
    OutputShard,
    OutputTensor,
    Ue8m0Scales,
)
from fp8fix.plan.selection import select_modules
from fp8fix.plan.ue8m0 import plan_ue8m0
from fp8fix.registry.architectures import unregistered_note
from fp8fix.registry.formats import COMPRESSED_TENSORS
from fp8fix.verdicts import loader_verdicts
from fp8fix.vocab import Encoding, Layout, OutputFormat


def require_fp8_scales(model: CheckpointModel) -> None:
    """Refuse an FP8 rewrite of an MX checkpoint: its layouts, encodings and formats are planned for
    per-tensor, per-channel and 128 x 128 block scales; MX weights are written unquantized (`--to bf16`)."""
    fmt = model.require_format()
    if fmt.mx:
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: a {fmt.label} checkpoint is converted to BF16 or F16, or to 128x128 "
            "block FP8, only, yet: `fp8fix convert SOURCE OUTPUT --to bf16` writes every MX weight as exactly code x "
            "2^(b - 127), `--blocks 128x128` as block FP8 for runtimes without MX kernels; `fp8fix inspect SOURCE` "
            "says which loaders take it as it is"
        )


def plan_conversion(
    model: CheckpointModel,
    layout: Layout,
    to: Encoding | None = None,
    output_format: OutputFormat = "keep",
    tp: int | None = None,
    tp_bf16: bool = False,
    dequantize: tuple[str, ...] = (),
    scales: str | None = None,
    sketch: bool = False,
) -> ConversionPlan:
    """The whole conversion in `layout` and `output_format`: fused-module layout first (but for the modules
    `dequantize` patterns name, written in BF16), then (with `tp`) MLP padding (and with `tp_bf16` BF16
    modules), then (with `to`) the FP8 encoding, then the tensor names and shapes of the output format.

    `sketch`: a candidate of `--target`, judged before one is chosen. Where it writes every tensor as it is
    and config.json too, its shards are not planned (`ConversionPlan.sketch`; the verdicts are SOURCE's):
    planning 100k tensors' outputs takes seconds, and only the chosen candidate is written."""
    ckpt = model.checkpoint
    fmt = model.require_format()
    require_fp8_scales(model)
    arch_name, arch = model.require_architecture()
    chosen = layout
    model.require_convertible()
    experts = model.fused_experts()
    blocked = sorted(
        {m.spec.module for m in model.fused.values() if not m.spec.can_unfuse}
        | {f"experts.{x.experts.param}" for x in experts if x.experts}
    )
    if chosen == "unfused" and blocked:
        raise UnsupportedCheckpoint(
            f"{arch_name}: runtimes know no per-shard names for {', '.join(blocked)}, so there is no unfused "
            "layout; use --layout per-shard or --layout fused"
        )
    if chosen == "channel":
        _require_channel_format(model, output_format, arch_name)
    if output_format == "compressed-tensors" and not compressed_tensors.can_write(model):  # before planning shards
        raise _no_compressed_tensors(arch_name, chosen)
    replacements: dict[str, list[OutputTensor]] = {}
    changes: list[ModuleChange] = []
    renames: dict[str, list[str]] = {}
    selection = select_modules(model, dequantize) if dequantize else None
    chosen_bf16 = set(selection.modules) if selection else set()
    for module in model.fused.values():
        if module.path in chosen_bf16:
            continue
        change, outputs = plan_fused_module(module, fmt, chosen)
        changes.append(change)
        replacements.update(outputs)
        if change.new_modules:
            renames[module.path] = change.new_modules
    if chosen == "channel":
        replacements.update(plan_channel_weights(model))
    for weight in experts:
        if weight.module in chosen_bf16:
            continue
        change, outputs = plan_experts(weight, chosen)
        changes.append(change)
        replacements.update(outputs)
    written_bf16, bf16_outputs = plan_bf16_modules(model, selection.modules) if selection else ([], {})
    replacements.update(bf16_outputs)
    padding = plan_tp_padding(model, tp, tp_bf16, chosen_bf16) if tp else None
    if padding is not None:
        both = sorted(set(padding.outputs) & set(bf16_outputs))
        if both:
            raise UnsupportedCheckpoint(
                f"--tp {tp} and --dequantize: '{both[0]}' would be both padded and written in BF16; leave its "
                "MLP out of the --dequantize patterns"
            )
        replacements.update(padding.outputs)
    replacements = {name: out for name, out in replacements.items() if not kept_as_is(name, out, ckpt.tensors)}
    # every tensor copied as it is, under its own name (SOURCE's names are unique, its ranges its tensors'): the
    # checks below pass by construction, and are not run over 100k tensors
    copies_only = not replacements and scales != "ue8m0" and not to and output_format != "compressed-tensors"
    sketched = sketch and copies_only
    headers = {} if sketched else ckpt.shards
    shards = [plan_shard(name, header.metadata, header.tensors, replacements) for name, header in headers.items()]
    if not copies_only:
        _check_unique_names(shards)
    ue8m0 = plan_ue8m0(model, shards) if scales == "ue8m0" else None  # before the encoding: fn codes first
    encoding = plan_encoding(model, shards, to) if to else None
    strategy = None
    if output_format == "compressed-tensors":
        strategy = compressed_tensors.strategy_of(shards, model)
        if strategy is None:
            raise _no_compressed_tensors(arch_name, chosen)
        compressed_tensors.rewrite_tensors(shards, model)
    if not copies_only:
        check_pieces_inside_sources(shards, ckpt.tensors)
    plan = ConversionPlan(
        source=ckpt.root,
        architecture=arch_name,
        format=fmt,
        layout=chosen,
        layout_was_default=False,
        modules=changes,
        shards=shards,
        renames=renames,
        has_index=ckpt.index is not None,
        encoding=encoding,
        sources=ckpt.tensors,
        output_format=output_format,
        config_files=output_config(
            ckpt.config,
            ckpt.root,
            fmt.name_lists,
            renames,
            compressed_tensors.scheme_of(model, strategy) if strategy else None,
            channel=chosen == "channel" and output_format == "keep",
            unfused_config=arch.unfused_config,
            sizes=padding.config if padding else None,
            unquantized=[*(selection.listed if selection else []), *(padding.unquantized if padding else [])],
            # and the modules written in BF16: a compressed-tensors config must `ignore` them too
            linears=[*model.plain_linears(), *(selection.modules if selection else [])],
            scale_fmt="ue8m0" if ue8m0 is not None and ue8m0.scale_fmt else None,
        ),
        padding=padding,
        dequantized=written_bf16,
        ue8m0=ue8m0,
        sketch=sketched,
    )
    if selection is not None:
        plan.notes += selection.notes
    if model.spec is None:
        plan.notes.append(unregistered_note(arch_name))
    plan.source_loaders = loader_verdicts(model)
    if sketched and CONFIG in plan.config_files:  # config.json changes: the output's verdicts need its headers
        return plan_conversion(model, layout, to, output_format, tp, tp_bf16, dequantize, scales)
    if CONFIG not in plan.config_files and (copies_only or _tensors_unchanged(plan, ckpt)):
        plan.loaders = plan.source_loaders  # what verdicts read (config.json, tensor names, dtypes, shapes) is SOURCE's
    else:
        plan.loaders = loader_verdicts(output_model(plan, model))
    return plan


def kept_as_is(name: str, outputs: list[OutputTensor], sources: dict[str, TensorInfo]) -> bool:
    """A replacement that writes source tensor `name` as `plan_shard` copies it (a fused module kept as it is)."""
    source = sources.get(name)
    if source is None or len(outputs) != 1 or not outputs[0].unchanged or outputs[0].source != name:
        return False
    t = outputs[0]
    return (t.dtype, tuple(t.shape)) == (source.dtype, source.shape) and _own_bytes(t, source)


def _own_bytes(out: OutputTensor, source: TensorInfo | None) -> bool:
    """`out` is one copy of exactly `source`'s bytes."""
    if source is None or len(out.pieces) != 1 or type(out.pieces[0]) is not CopyRange:
        return False
    piece = out.pieces[0]
    return (piece.path, piece.start, piece.end) == (source.path, source.start, source.end)


def _tensors_unchanged(plan: ConversionPlan, ckpt: Checkpoint) -> bool:
    """Every SOURCE tensor written as it is, under its name, and nothing else: the output's headers say
    what SOURCE's do (a DeepSeek-V3 kept as it is: 91k tensors not described a second time)."""
    written = [t for shard in plan.shards for t in shard.tensors]
    source = ckpt.tensors
    if len(written) != len(source):
        return False
    for t in written:
        s = source.get(t.name)
        if s is None or not t.unchanged or t.dtype != s.dtype or tuple(t.shape) != s.shape:
            return False
    return True


def _no_compressed_tensors(arch_name: str, layout: Layout) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"{arch_name}: compressed-tensors output needs an AutoFP8, Quark, ModelOpt or FBGEMM source whose config "
        "one compressed-tensors group can say (no per-layer overrides, no modules_to_not_convert) and whose "
        f"weight scales the {layout} layout leaves all per tensor or all per channel"
    )


def channel_format(model: CheckpointModel) -> OutputFormat | None:
    """The output format the channel layout of this checkpoint is written in (compressed-tensors, the
    one format vLLM takes per-row scales in): its own for compressed-tensors, `compressed-tensors`
    from AutoFP8, Quark, ModelOpt or FBGEMM that one group can describe; None when there is none."""
    fmt = model.format
    if fmt is not None and fmt.name == COMPRESSED_TENSORS.name:
        return None if fmt.block else "keep"
    return "compressed-tensors" if compressed_tensors.can_write(model) else None


def _require_channel_format(model: CheckpointModel, output_format: OutputFormat, arch_name: str) -> None:
    """Refuse the channel layout where `channel_format` has none, or where another format was asked for."""
    fmt = model.require_format()
    needed = channel_format(model)
    if needed is None:
        raise UnsupportedCheckpoint(
            f"{arch_name}: the channel layout is written as compressed-tensors, from compressed-tensors, AutoFP8, "
            "Quark, ModelOpt or FBGEMM checkpoints with per-tensor, per-shard or per-row scales that one "
            "compressed-tensors group "
            f"can describe; this checkpoint is {fmt.label}"
        )
    if output_format != needed:
        why = "this checkpoint is already" if needed == "keep" else f"vLLM rejects {fmt.label} with per-row scales"
        if fmt.name == "fbgemm_fp8":
            why = f"vLLM refuses {fmt.label} whatever its scales"
        raise UnsupportedCheckpoint(
            f"{arch_name}: the channel layout is written as compressed-tensors ({why}); use --format {needed}"
        )


def whole_model_plan(
    model: CheckpointModel, arch_name: str, shards: list[OutputShard], config_files: dict[str, Any], **fields: Any
) -> ConversionPlan:
    """The plan of a rewrite of every FP8 weight that leaves the module layout alone (`--to bf16`, `--blocks`):
    `shards` and `config_files` as planned, the other `fields` of ConversionPlan as given."""
    ckpt = model.checkpoint
    return ConversionPlan(
        source=ckpt.root,
        architecture=arch_name,
        format=model.require_format(),
        layout="fused" if model.fused else "unfused",
        layout_was_default=False,
        modules=[],
        shards=shards,
        renames={},
        has_index=ckpt.index is not None,
        sources=ckpt.tensors,
        config_files=config_files,
        **fields,
    )


def plan_shard(
    name: str, metadata: dict[str, str], tensors: dict[str, TensorInfo], replacements: dict[str, list[OutputTensor]]
) -> OutputShard:
    out: list[OutputTensor] = []
    for t in tensors.values():
        if t.name in replacements:  # rewritten, or dropped (an empty list: the scale of a BF16 module)
            out.extend(replacements[t.name])
        else:
            out.append(OutputTensor.copy_of(t))
    return OutputShard(name, {**metadata, "format": "pt"}, out)


def check_pieces_inside_sources(shards: list[OutputShard], sources: dict[str, TensorInfo]) -> None:
    """The plan's invariant: every byte range a piece reads lies inside one source tensor's bytes.

    Shape checks upstream name the usual causes; this catches any they miss, so no output
    tensor is ever filled with the bytes of its neighbours. And every output name once (`_check_unique_names`).
    """
    _check_unique_names(shards)
    by_file: dict[Path, list[TensorInfo]] = {}
    for t in sources.values():
        by_file.setdefault(t.path, []).append(t)
    ordered = {path: sorted(ts, key=lambda t: t.start) for path, ts in by_file.items()}
    starts = {path: [t.start for t in ts] for path, ts in ordered.items()}  # once per file, not per piece
    for shard in shards:
        for out in shard.tensors:
            if _own_bytes(out, sources.get(out.source)):
                continue  # the source tensor's own bytes (most tensors of most plans)
            pieces = [
                r
                for p in out.pieces
                for r in (p.rows if isinstance(p, Ue8m0Scales | MxBlockScales | MxScales) else (p,))
            ]
            for piece in pieces:  # (a power-of-two scale tensor is made from its weight's rows)
                if isinstance(piece, Fill):  # written from nothing
                    continue
                tensors = ordered.get(piece.path, [])
                i = bisect.bisect_right(starts.get(piece.path, []), piece.start) - 1
                inside = i >= 0 and tensors[i].start <= piece.start <= piece.end <= tensors[i].end
                if not inside:
                    src = sources.get(out.source)
                    raise InvalidCheckpoint(
                        f"{piece.path.name}: output tensor '{out.name}' would read bytes {piece.start}-{piece.end}, "
                        f"outside its source tensor '{out.source}'"
                        + (f" ({src.dtype} {list(src.shape)})" if src else "")
                        + ": the checkpoint's shapes are inconsistent; nothing was written"
                    )


def _check_unique_names(shards: list[OutputShard]) -> None:
    names = [t.name for shard in shards for t in shard.tensors]
    if len(set(names)) == len(names):
        return
    seen: dict[str, str] = {}
    for shard in shards:
        for t in shard.tensors:
            if t.name in seen:
                raise UnsupportedCheckpoint(
                    f"{shard.name}: the output would hold '{t.name}' twice (from '{t.source}'); the checkpoint "
                    "already has a tensor of the name the conversion writes (the per-shard names of a fused module, "
                    "or an unquantized weight beside its packed FP4 one)"
                )
            seen[t.name] = shard.name

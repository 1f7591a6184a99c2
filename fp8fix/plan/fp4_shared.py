"""NVFP4 projections a runtime packs into one layer, given the one global scale that layer uses.

vLLM (0.19 - 0.32) and SGLang pack q / k / v and gate / up into one layer with one NVFP4 global scale, the largest
(`weight_global_scale.max()`, ModelOpt's `weight_scale_2.max()`), a warning only: a projection exported with a
global scale of its own computes with weights off by the ratio, and SGLang's weight-only NVFP4 refuses the layer.
Here every module of such a layer is given the scale the layer uses (the largest multiplier: compressed-tensors'
smallest `weight_global_scale`, ModelOpt's largest `weight_scale_2`, what llm-compressor gives fused projections),
its group scales and elements moved to it (`numerics.nvfp4_shared`: exact where the ratio keeps a scale on e4m3fn's
grid, else requantized once, bounded and counted), its global scale the shared one's bytes. Every other tensor
and the config are as the plan had them: this is a pass over a finished plan (an FP8 conversion's, whose FP4
modules it copied as they are, or a copy of the whole checkpoint where it holds FP4 modules only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.fp4_modules import Fp4Weight, PackedNvfp4, packed_nvfp4
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import CheckpointModel
from fp8fix.numerics.nvfp4 import NVFP4_GROUP
from fp8fix.plan import planner
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan, CopyRange, Nvfp4Shared, OutputTensor, Piece, ScaleRef
from fp8fix.verdicts import loader_verdicts

#: Packed bytes a piece reads at most (a window of rows: the tables' lookups hold a few times it).
WINDOW_BYTES = 1 << 22


@dataclass
class SharedModule:
    """One NVFP4 module moved to its layer's global scale; the figures are filled in once written."""

    module: str
    weight: str  # the packed weight
    layer: list[str]  # the modules packed with it, itself included
    ratio: float  # its multiplier over the shared one (< 1)
    global_scale: str  # the tensor whose bytes its global scale now holds
    groups: int
    groups_exact: int | None = None
    max_error: float | None = None
    max_steps: float | None = None  # E2M1 steps of the source value, at its source scale


def differing_layers(model: CheckpointModel) -> list[PackedNvfp4]:
    """The packed NVFP4 layers whose modules' global scales differ (read: a folder's values)."""
    return [p for p in packed_nvfp4(model.checkpoint, model.fp4) if p.differ]


def copy_plan(model: CheckpointModel) -> ConversionPlan:
    """Every tensor and file as SOURCE holds it: what the shared global scales are planned over where there is no
    FP8 conversion (a checkpoint of FP4 modules only)."""
    arch_name, _ = model.require_architecture()
    model.require_convertible()
    ckpt = model.checkpoint
    shards = [planner.plan_shard(name, h.metadata, h.tensors, {}) for name, h in ckpt.shards.items()]
    plan = planner.whole_model_plan(model, arch_name, shards, {})
    plan.source_loaders = loader_verdicts(model)
    return plan


def share_global_scales(plan: ConversionPlan, model: CheckpointModel) -> None:
    """Rewrite, in `plan`, each NVFP4 module of a layer whose global scales differ at the layer's shared scale; the
    verdicts on OUTPUT worked out again. A module's tensors must be in `plan` as SOURCE's (`fp4_kept`)."""
    layers = differing_layers(model)
    if not layers:
        return
    outputs = {t.name: t for shard in plan.shards for t in shard.tensors}
    rewritten: dict[str, OutputTensor] = {}  # new tensors in place of the copies (theirs are left unedited)
    for layer in layers:
        assert layer.multipliers is not None  # `differ`: read
        shared = max(layer.multipliers)
        chosen = layer.modules[layer.multipliers.index(shared)]
        assert chosen.global_scale is not None
        names = [w.module for w in layer.modules]
        for w, m in zip(layer.modules, layer.multipliers, strict=True):
            if m == shared:
                continue
            assert w.scale is not None and w.global_scale is not None  # read NVFP4 (`packed_nvfp4`)
            for t in (w.packed, w.scale, w.global_scale):
                if t.name not in outputs or not planner.kept_as_is(t.name, [outputs[t.name]], plan.sources):
                    raise UnsupportedCheckpoint(
                        f"{model.checkpoint.root.name}: '{t.name}' is rewritten by this conversion, so its NVFP4 "
                        f"module '{w.module}' cannot also be moved to the global scale its packed layer shares"
                    )
            windows = _windows(w, m / shared, shared)
            g = chosen.global_scale
            pieces: list[list[Piece]] = [list(windows), [replace(p, part="scales") for p in windows]]
            pieces.append([CopyRange(g.path, g.start, g.end)])
            for t, made in zip((w.packed, w.scale, w.global_scale), pieces, strict=True):
                rewritten[t.name] = OutputTensor(t.name, t.dtype, t.shape, made, t.name)
            groups = w.rows * w.cols // NVFP4_GROUP
            plan.shared_fp4.append(SharedModule(w.module, w.packed.name, names, m / shared, g.name, groups))
    for shard in plan.shards:
        shard.tensors = [rewritten.get(t.name, t) for t in shard.tensors]
    plan.loaders = loader_verdicts(output_model(plan, model))


def _windows(w: Fp4Weight, ratio: float, shared: float) -> list[Nvfp4Shared]:
    """The module's rows in windows of at most WINDOW_BYTES packed bytes, each with its own scale bytes."""
    assert w.scale is not None
    row_bytes, groups = w.cols // 2, w.cols // NVFP4_GROUP
    per = max(1, WINDOW_BYTES // row_bytes)
    t: TensorInfo = w.packed
    s: TensorInfo = w.scale
    return [
        Nvfp4Shared(
            t.path,
            t.start + first * row_bytes,
            t.start + last * row_bytes,
            w.cols,
            ScaleRef(s.path, s.start + first * groups, (last - first) * groups, s.dtype, s.name),
            ratio,
            shared,
            t.name,
            "packed",
            first,
        )
        for first in range(0, w.rows, per)
        for last in (min(w.rows, first + per),)
    ]

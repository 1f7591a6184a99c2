"""Choosing the layout for the loaders a conversion is for (`--target`), from the verdicts on each
candidate output.

Every layout the planner accepts (that can differ: see `_distinct_layouts`) is planned and judged by
`fp8fix.verdicts` as the output it would write; one that writes every tensor and config.json as they are
is judged by SOURCE's verdicts without planning its shards (a sketch, planned whole only if chosen).
Where some candidate rewrites modules, they are planned and judged on one layer of each class
(`layer_classes`: what decides a verdict is alike in every layer of a class) and only the chosen one is
planned on the whole checkpoint: a Phi-3 of 112k tensors is judged on 84 (6 layers).
The target's loaders are counted first (those that load exactly, then those that load at least `rounded`:
half a step on some weights beats a refusal); then exactness: where a fused module's shards carry
different scales, every layout but `channel` leaves them to be requantized (by fp8fix for
`fused`, by the runtime at load for the others), so `channel` comes first among outputs the
target's loaders take; then every loader; ties go to `unfused` (splitting fused modules into the
per-shard modules runtimes know by name: the job fp8fix was made for), then to the
architecture's default layout (what the registry says fused-MoE loaders and old vLLMs
expect, which no verdict tells apart), then to the layout that leaves the checkpoint as
it is, then `fused`, then `per-shard`. Only outputs that still load in every one of the
target's loaders SOURCE loads in are candidates, where SOURCE's own layout is one (it always is,
unless SOURCE's layout is one convert rewrites): a target of several loaders (every vLLM since
0.19 and transformers) is never served by trading a loader that works for one that does not. With an
encoding change (`--to`) every candidate is planned with it and judged as written: no candidate is SOURCE
as it is, so SOURCE's own rows name the loaders to keep, where some candidate can.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.errors import Fp8fixError, UnsupportedCheckpoint
from fp8fix.io.checkpoint import check_scale_values
from fp8fix.model import CheckpointModel
from fp8fix.plan.fp4_kept import check_fp4_kept
from fp8fix.plan.layer_classes import representatives
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.plan.planner import channel_format, plan_conversion
from fp8fix.registry.loader_rows import TRANSFORMERS, VLLM_LEGACY, VLLM_ROWS
from fp8fix.verdicts import LoaderVerdict, packed_groups
from fp8fix.vocab import LAYOUTS, OUTPUT_FORMATS, Encoding, Layout, OutputFormat, Target

#: The loaders each target is for, counted first.
TARGET_LOADERS: dict[Target, tuple[str, ...]] = {
    "auto": (*VLLM_ROWS, TRANSFORMERS),  # every vLLM since 0.19 (one row per era), transformers
    "vllm": VLLM_ROWS,
    "vllm-legacy": (VLLM_LEGACY,),
    "transformers": (TRANSFORMERS,),
}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    output_format: OutputFormat
    plan: ConversionPlan
    unchanged: bool  # every fused module kept as it is, in the source's format
    lossy: bool  # shards with different scales end up requantized (by fp8fix or at load)
    whole: bool = True  # planned on the whole checkpoint, not on one layer of each class (`layer_classes`)

    def score(self, target: Target) -> tuple[int, int, int]:
        return score(self.plan.loaders, target)


def score(verdicts: dict[str, LoaderVerdict], target: Target) -> tuple[int, int, int]:
    """(target loaders that load exactly, target loaders that load at least rounded, all loaders that load
    exactly): a loader that rounds some weights by half a step (`rounded`) beats one that refuses or misreads."""
    wanted = TARGET_LOADERS[target]
    return (
        sum(verdicts[name].loads for name in wanted),
        sum(verdicts[name].verdict in ("loads", "rounded") for name in wanted),
        sum(v.loads for v in verdicts.values()),
    )


def candidates(
    model: CheckpointModel,
    layout: Layout | None = None,
    output_format: OutputFormat | None = None,
    by_class: bool = True,
    to: Encoding | None = None,
) -> list[Candidate]:
    """Every layout x output format the planner accepts for this checkpoint (only those given, where
    given), planned with the encoding change `to` (judged as what is written: an e4m3fnuz source's rows are
    not its e4m3fn output's); `by_class`: on one layer of each class where the
    checkpoint has modules a candidate rewrites (`layer_classes`; the verdicts, formats and losses are the
    whole checkpoint's), so the chosen candidate is planned whole again (`Candidate.whole`)."""
    whole = True
    if by_class and (_may_rewrite(model) or to is not None):  # with `to` every candidate is a whole plan
        reduced = representatives(model)
        if reduced is not None:
            model, whole = reduced, False
    found = []
    differ = shard_scales_differ(model)
    for lay in [layout] if layout else _distinct_layouts(model):
        for fmt in [output_format] if output_format else OUTPUT_FORMATS:
            try:
                plan = plan_conversion(model, lay, to, output_format=fmt, sketch=to is None)
                check_fp4_kept(plan, model)  # a candidate that would move or re-declare an FP4 module is none
            except (UnsupportedCheckpoint, OSError):  # no unfused names; no such format; Hub headers only
                continue
            unchanged = to is None and fmt == "keep" and all(m.action == "keep" for m in plan.modules)
            lossy = (differ and lay != "channel") or _requantizes(plan, model)
            found.append(Candidate(lay, fmt, plan, unchanged, lossy, whole))
    return found


def _may_rewrite(model: CheckpointModel) -> bool:
    """Some candidate rewrites modules (fused ones; per-row scales for the channel layout): only then are
    there plans worth reducing; otherwise every candidate is SOURCE's verdicts or a format's renames, and
    working out the classes costs more than it saves (non-fused block-FP8 at 100k tensors: +15%)."""
    return bool(model.fused or model.fused_experts()) or channel_format(model) is not None


def _distinct_layouts(model: CheckpointModel) -> tuple[Layout, ...]:
    """The layouts whose outputs can differ: per-shard and fused write what unfused writes when nothing
    is fused (no fused module, no fused stacked experts), and lose every tie to it (`best`), so they are
    not planned again (DeepSeek-V3: 91k tensors, seconds per plan)."""
    if model.fused or model.fused_experts():
        return LAYOUTS
    return tuple(lay for lay in LAYOUTS if lay not in ("per-shard", "fused"))


def _requantizes(plan: ConversionPlan, model: CheckpointModel) -> bool:
    """Blocks of a split requantized by fp8fix, or pre-sharded chunks (block grid per chunk) kept, which
    runtimes requantize at load (vLLM's mimo_v2.py, unless the tensor-parallel size is the chunk count)."""
    kept_chunks = any(
        m.action == "keep" and m.scale == "block" and model.fused[m.module].spec.block_grid == "per-group"
        for m in plan.modules
        if m.module in model.fused
    )
    return kept_chunks or any(m.blocks_requantized for m in plan.modules)


def shard_scales_differ(model: CheckpointModel) -> bool:
    """A fused module whose shards carry different weight scales, or modules vLLM packs into one layer
    (q / k / v, gate / up) whose per-tensor scales differ: one scale for them means requantizing (by fp8fix,
    or by vLLM at load, `requantize_with_max_scale`); only per-row scales keep every weight."""
    try:
        if any(len({check_scale_values(w.scale)[0] for w in g if w.scale}) > 1 for g in packed_groups(model)):
            return True
    except (OSError, Fp8fixError):  # headers only (a Hub source), or a scale convert refuses anyway
        return False
    for w in model.module_weights():
        if w.fused is None or w.scale_kind != "shard" or w.scale is None:
            continue
        try:
            if len(set(check_scale_values(w.scale))) > 1:
                return True
        except (OSError, Fp8fixError):  # headers only (a Hub source), or a scale convert refuses anyway
            return False
    return False


def best(found: list[Candidate], target: Target, default: Layout) -> Candidate:
    """The candidate the target's loaders take best, of those that keep every target loader SOURCE loads in;
    ties as the module docstring says."""
    wanted = TARGET_LOADERS[target]
    source = next((c for c in found if c.unchanged), None)
    if source is not None:
        loading = {name for name in wanted if source.plan.loaders[name].loads}
        found = [c for c in found if all(c.plan.loaders[name].loads for name in loading)]
    elif found:  # an encoding change: no candidate is SOURCE as it is; keep its loaders where some output can
        loading = {name for name in wanted if found[0].plan.source_loaders[name].loads}
        found = [c for c in found if all(c.plan.loaders[name].loads for name in loading)] or found

    def rank(c: Candidate) -> tuple[int, int, bool, int, int, bool]:
        correct, loading, everywhere = c.score(target)
        ties = [c.layout == "unfused", c.layout == default, c.unchanged, c.layout == "fused", True]
        return (-correct, -loading, c.lossy, -everywhere, ties.index(True), c.output_format != "keep")

    return min(found, key=rank)

"""`inspect`: what a checkpoint is, what is wrong with it, and which loaders will take it.

Reads config.json and the safetensors headers, plus the few bytes of the scales
(local files only). `scan_data` also reads every FP8 weight (memchr-fast, through
a sliding memory map) to find NaN codes and e4m3fnuz data under an e4m3fn label.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fp8fix.collector import collector_paused
from fp8fix.errors import Fp8fixError
from fp8fix.fp4_modules import Fp4Weight
from fp8fix.gate import Row, default_candidate, default_options, gate_rows
from fp8fix.io.checkpoint import Checkpoint, first_invalid_scale, open_checkpoint, scale_values
from fp8fix.io.source_files import SourceFiles
from fp8fix.model import CheckpointModel, Fp8Weight, describe_checkpoint
from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ, FP8_WEIGHT_DTYPES, NAN_CODES, SCALE_DTYPES
from fp8fix.numerics.fp8 import e4m3_value
from fp8fix.numerics.recodings import FNUZ_TO_FN_SAME_SCALE, inexact_codes
from fp8fix.parallel import heads_refusal, tensor_parallel_report
from fp8fix.plan.targets import score
from fp8fix.registry.architectures import Registry, unregistered_note
from fp8fix.registry.formats import quantization_config
from fp8fix.registry.loader_rows import CALLS, TRANSFORMERS
from fp8fix.registry.parallel import HEADS_EVIDENCE
from fp8fix.report.text import joined
from fp8fix.verdicts import Rounding, facts_of, loader_verdicts, scanned, verdicts_json
from fp8fix.vocab import SCHEMA_VERSION, InputScaleKind, ScaleReport, Target

#: What runtimes do with block scales that are not powers of two where DeepGEMM runs (Hopper, Blackwell).
NOT_UE8M0 = (
    "block scales that are not powers of two: where vLLM runs DeepGEMM (Hopper, Blackwell; "
    "VLLM_USE_DEEP_GEMM_E8M0 is on by default) it requantizes every such block at each load to power-of-two "
    "scales, rounding twice (vllm 0.32 quantization/utils/fp8_utils.py deepgemm_post_process_fp8_weight_block -> "
    "requant_weight_ue8m0_inplace, for float32 scales when utils/deep_gemm.py is_deep_gemm_e8m0_used); SGLang's "
    "DeepGEMM path does too, through bfloat16 (srt/layers/quantization/fp8_utils.py requant_weight_ue8m0; not run)"
)
#: float16's smallest normal: vLLM (since 0.19) requantizes through float16, which loses weights below it.
FLOAT16_MIN_NORMAL = 2.0**-14


@dataclass
class ModuleInfo:
    module: str
    fused: str | None  # registry suffix when fused
    shards: int
    weight_dtype: str
    scale: ScaleReport
    scale_dtype: str | None
    scale_shape: list[int] | None
    input_scale: InputScaleKind


@dataclass
class Finding:
    code: str
    modules: list[str]
    reason: str
    fix: str | None  # the `fp8fix convert` options that make this finding go away; None when convert cannot
    heuristic: bool = False
    #: loaders that load this checkpoint correctly but would not load the fix's output correctly (the fix
    #: for vLLM <= 0.5.0 is a layout current loaders refuse): the price of the fix, said with it
    trade_off: list[str] = field(default_factory=list)
    #: a problem for the loaders `convert`'s default target serves (every vLLM since 0.19, transformers); one that
    #: only an older loader has is reported with its fix
    default_target: bool = True
    #: the loader rows this finding is about: a gate finding (`fp8fix.gate`) names one, and `--strict` fails on it
    loaders: list[str] = field(default_factory=list)


@dataclass
class Report:
    source: str
    format: str
    format_label: str
    format_hints: dict[str, Any]
    convert_supported: bool
    architecture: str | None
    architecture_known: bool
    encoding: str | None
    files: list[dict[str, Any]]
    modules: list[ModuleInfo]
    kv_cache_scales: list[dict[str, Any]]
    findings: list[Finding]
    loaders: dict[str, dict[str, Any]]
    data_scanned: bool
    schema_version: int = SCHEMA_VERSION
    notes: list[str] = field(default_factory=list)
    #: with `--tp`: each size's modules whose rank share is not whole blocks (block-scaled checkpoints)
    tensor_parallel: dict[str, Any] | None = None
    #: with `--scan-data`, of e4m3fnuz weights: the codes e4m3fn parameters round (`verdicts.Rounding`)
    fnuz_rounding: dict[str, Any] | None = None
    #: FP4 modules (NVFP4 / MXFP4: `fp4_modules.Fp4Weight`), one entry each (`fp4_info`)
    fp4_modules: list[dict[str, Any]] = field(default_factory=list)

    #: the target the rows are gated for (`--target`: whose loaders must load, and what convert would write)
    target: Target = "auto"

    @property
    def gate(self) -> list[Finding]:
        """The findings about loader rows (`fp8fix.gate`): what `--strict` fails on, each naming its row."""
        return [f for f in self.findings if f.loaders]

    @property
    def fixable(self) -> list[Finding]:
        """The gate's findings (`gate`), by the name of fp8fix 0.1: what `--strict` fails on."""
        return self.gate

    def to_json(self) -> dict[str, Any]:
        """`asdict`, with the module tables (one entry per FP8 weight: 50k in DeepSeek-V3; per FP4 module) built flat:
        `asdict` recurses into every value of every entry, seconds at that size."""
        out = asdict(replace(self, modules=[], fp4_modules=[]))
        out["modules"] = [{**vars(m), "scale_shape": _copied(m.scale_shape)} for m in self.modules]
        # FP4 modules (100k DeepSeek-V4 experts) likewise: flat dicts of plain values and lists of ints
        out["fp4_modules"] = [
            {**m, "shape": list(m["shape"]), "scale_shape": _copied(m["scale_shape"])} for m in self.fp4_modules
        ]
        return out


def _copied(shape: list[int] | None) -> list[int] | None:
    return None if shape is None else list(shape)


@collector_paused()
def inspect_checkpoint(
    root: Path | Checkpoint,
    scan_data: bool = False,
    registry: Registry | None = None,
    tp: Sequence[int] = (),
    target: Target = "auto",
) -> Report:
    """Inspect a local folder, or a checkpoint whose headers came from the Hub (no data: scale values unread)."""
    ckpt = root if isinstance(root, Checkpoint) else open_checkpoint(root)
    model = describe_checkpoint(ckpt, registry or Registry.builtin())
    qc = quantization_config(ckpt.config) or {}
    fmt = model.format
    note = str(model.format_error).removeprefix("config.json: ") if model.format_error else ""
    modules = [_module_info(w) for w in model.weights.values() if w.is_module_weight]
    refusal = _refusal(model)
    encodings = sorted({FP8_WEIGHT_DTYPES.get(m.weight_dtype, m.weight_dtype) for m in modules})
    report = Report(
        source=str(ckpt.root),
        format=str(qc.get("quant_method") or "none"),
        format_label=fmt.label if fmt else note,
        format_hints={k: qc[k] for k in ("version", "format", "activation_scheme", "quantization_status") if k in qc},
        convert_supported=refusal is None,
        architecture=model.architecture,
        architecture_known=model.spec is not None,
        encoding=", ".join(encodings) or None,
        files=[
            {"name": n, "bytes": sum(t.nbytes for t in h.tensors.values()), "tensors": len(h.tensors)}
            for n, h in ckpt.shards.items()
        ],
        modules=modules,
        kv_cache_scales=[{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in model.kv_cache_scales],
        fp4_modules=[fp4_info(w) for w in model.fp4.values()],
        findings=[],
        loaders={},
        data_scanned=scan_data,
        target=target,
    )
    if fmt is None:
        report.notes.append(note)
    elif refusal is not None:
        report.notes.append(f"convert refuses it: {refusal}")
    elif model.spec is None and model.architecture:
        report.notes.append(unregistered_note(model.architecture))
    if not ckpt.has_data:
        report.notes.append("headers read from the Hub: scale values and weights were not read")
    rounding = fnuz_rounding(model) if scan_data and ckpt.has_data else None
    report.fnuz_rounding = rounding.to_json() if rounding else None
    report.findings = [
        *_row_findings(gate_rows(model, target, tp, rounding)),
        *_findings(model, modules, scan_data and ckpt.has_data),
    ]
    report.loaders = verdicts_json(scanned(loader_verdicts(model), rounding))
    if tp:
        parallel = tensor_parallel_report(model, list(tp))
        if parallel is None:
            report.notes += _unblocked_sizes(ckpt.config, tp, fmt is not None and fmt.mx)
        else:
            report.tensor_parallel = parallel.to_json()
    return report


def _row_findings(rows: list[Row]) -> list[Finding]:
    """The rows a gate fails on, as findings naming them and the command that makes them load (rows that say
    the same, with the same fix, in one finding)."""
    grouped: dict[tuple[str, str, str | None, tuple[str, ...]], list[str]] = defaultdict(list)
    for row in rows:
        said = row.reason if row.in_target else f"{row.verdict}: {row.reason}; the default conversion makes it load"
        grouped[(row.code, said, row.fix, row.trade_off)].append(row.loader)
    return [
        Finding(code, modules=[], reason=said, fix=fix, trade_off=list(lost), loaders=loaders)
        for (code, said, fix, lost), loaders in grouped.items()
    ]


def _unblocked_sizes(config: dict[str, Any], sizes: Sequence[int], mx: bool = False) -> list[str]:
    """`--tp` of a checkpoint without FP8 block scales: its scales split at any size, but attention whose heads
    do not split is refused (vLLM) whatever the scales. MX scales (32 elements of a row): how vLLM's MXFP8
    scheme splits them is not measured here, at any size."""
    notes = []
    for tp in sizes:
        refusal = heads_refusal(config, tp)
        if refusal is not None:
            notes.append(f"--tp {tp}: vLLM refuses it: {refusal} ({HEADS_EVIDENCE})")
        elif mx:
            notes.append(f"--tp {tp}: MXFP8: how vLLM's MXFP8 scheme splits its E8M0 scales is not judged here")
        else:
            notes.append(f"--tp {tp}: not block-scaled: per-tensor and per-channel scales split at any size")
    return notes


def _refusal(model: CheckpointModel) -> str | None:
    """Why `convert` refuses this checkpoint whatever the layout (format, architecture, weights and
    their scales: the same checks it runs first), or None: inspect and convert agree."""
    try:
        model.require_format()
        model.require_architecture()
        model.require_convertible()
    except Fp8fixError as e:
        return str(e)
    return None


def fp4_info(w: Fp4Weight) -> dict[str, Any]:
    """One FP4 module as `--json` lists it: its scheme, elements [out, in], scale and global scale."""
    return {
        "module": w.module,
        "scheme": w.scheme,
        "shape": [w.experts, w.rows // w.experts, w.cols]
        if w.experts and w.cols
        else [w.rows, w.cols]
        if w.cols
        else list(w.packed.shape),
        "scale_dtype": w.scale.dtype if w.scale else None,
        "scale_shape": list(w.scale.shape) if w.scale else None,
        "global_scale": w.global_scale is not None,
        "problem": str(w.problem) if w.problem else None,
    }


def _module_info(w: Fp8Weight) -> ModuleInfo:
    """One FP8 weight: a module's `.weight`, or a stacked-experts tensor (reported under its own name)."""
    scale: ScaleReport
    if w.scale_kind is not None:
        scale = w.scale_kind
    else:
        scale = "missing" if w.scale is None else "unknown"
    input_kind: InputScaleKind = "dynamic"
    if w.input_scale is not None:
        input_kind = "static-per-shard" if w.fused and w.input_scale.shape == (w.n_shards,) else "static"
    fused_experts = f"experts.{w.name.rpartition('.')[2]}" if w.stacked and w.n_shards > 1 else None
    return ModuleInfo(
        module=w.module,
        fused=w.fused.spec.module if w.fused else fused_experts,
        shards=w.n_shards,
        weight_dtype=w.tensor.dtype,
        scale=scale,
        scale_dtype=w.scale.dtype if w.scale else None,
        scale_shape=list(w.scale.shape) if w.scale else None,
        input_scale=input_kind,
    )


def _linear_fused(m: ModuleInfo) -> bool:
    """A fused linear module (the loader table's subject), not stacked experts."""
    return m.fused is not None and not m.fused.startswith("experts.")


AddFinding = Callable[..., None]


@dataclass(frozen=True)
class Fix:
    """The `convert` options of a target's conversion, and the loaders it costs (`Finding.trade_off`)."""

    options: str
    trade_off: tuple[str, ...]


def _layout_fixes(model: CheckpointModel, targets: tuple[Target, ...]) -> dict[Target, Fix | None]:
    """Per target: the options `convert --target TARGET` would choose (layout, and format where it changes:
    `gate.default_candidate`) when its output loads correctly in more of the target's loaders than this
    checkpoint; None when nothing would improve for them (more loaders elsewhere is no fix of the target's
    finding). The same choice convert makes, so inspecting its output finds nothing left to fix (`--strict` is
    a fixpoint for the default target). The candidates are planned once for all targets."""
    fixes: dict[Target, Fix | None] = dict.fromkeys(targets)
    now = loader_verdicts(model)
    for target in targets:
        chosen = default_candidate(model, target)
        if chosen is None or score(chosen.plan.loaders, target)[0] <= score(now, target)[0]:
            continue  # convert refuses it, or no more of the target's loaders
        lost = tuple(name for name, v in now.items() if v.loads and not chosen.plan.loaders[name].loads)
        fixes[target] = Fix(default_options(chosen, "auto"), lost)
    return fixes


def _findings(model: CheckpointModel, modules: list[ModuleInfo], scan: bool) -> list[Finding]:
    ckpt = model.checkpoint
    found: dict[tuple[str, str, str | Fix | None, bool, bool], list[str]] = defaultdict(list)

    def add(
        code: str, module: str, reason: str, fix: str | Fix | None, heuristic: bool = False, default: bool = True
    ) -> None:
        found[(code, reason, fix, heuristic, default)].append(module)

    fixes = _layout_fixes(model, ("auto", "vllm-legacy"))
    layout_fix, legacy_fix = fixes["auto"], fixes["vllm-legacy"]
    raw_codes_in_transformers = facts_of(model).fp8_per_tensor
    # a format fp8fix does not read lays its scales out its own way (MX: one E8M0 byte per 32 elements): their
    # shapes are not wrong, only unread; the format note says so once
    scales_read = not facts_of(model).unread_format
    # vLLM requantizes per-tensor and per-shard weight scales through float16; per-channel and block
    # scales it takes as they are (measured exact, issue 11)
    requantized_scales = {
        w.scale.name for w in model.weights.values() if w.scale is not None and w.scale_kind in ("tensor", "shard")
    }
    for m in modules:
        if _linear_fused(m) and m.scale == "tensor":
            add(
                "single-scale-fused",
                m.module,
                "a fused module with one scale: vLLM <= 0.5.0 expects one scale per shard (vLLM >= 0.5.1 and "
                "transformers take one)",
                legacy_fix,
                default=False,
            )
        if _linear_fused(m) and m.scale == "shard":
            add(
                "per-shard-scales-on-fused",
                m.module,
                "a fused weight with a per-shard scale vector: vLLM >= 0.5.1 and transformers reject it",
                layout_fix,
            )
        if m.scale == "missing" and scales_read:
            add("missing-scale", m.module, "an FP8 weight without a scale: its values cannot be recovered", None)
        if m.scale == "unknown" and scales_read:
            add("unknown-scale-shape", m.module, "a scale whose shape fits no known convention", None)
        if raw_codes_in_transformers and m.scale in ("tensor", "channel", "shard"):
            add(
                "raw-codes-in-transformers",
                m.module,
                "quant_method fp8 with per-tensor or per-channel scales: transformers reads it through its "
                "fine-grained FP8 quantizer, drops weight_scale and computes with the raw codes",
                layout_fix,
            )
        if m.weight_dtype == E4M3FNUZ:
            add(
                "e4m3fnuz-for-vllm",
                m.module,
                "e4m3fnuz weights: vLLM (on ROCm too: measured, its rows say loads-wrong) casts them into e4m3fn "
                "parameters, rounding the odd subnormal codes, and converts e4m3fn checkpoints for MI300 itself",
                "--to e4m3fn",
            )
    block_scales = {w.scale.name: w.module for w in model.weights.values() if w.scale and w.scale_kind == "block"}
    scales = [
        t
        for name, t in (ckpt.tensors.items() if ckpt.has_data else ())
        if name.endswith(("_scale", "_scale_inv")) and t.dtype in SCALE_DTYPES and t.numel <= 1_000_000
    ]
    with SourceFiles() as files:  # a shard's scales in a few reads (100k scales: 160 files)
        for t, values in scale_values(scales, files):
            name = t.name
            stacked = name.rsplit("_scale", 1)[0]  # experts.gate_up_proj_scale belongs to experts.gate_up_proj
            is_stacked = stacked in ckpt.tensors and len(ckpt.tensors[stacked].shape) == 3
            module = stacked if is_stacked else name.rsplit(".", 1)[0]
            bad = first_invalid_scale(values)
            if bad is not None:
                add("bad-scale-value", module, f"a scale that is zero, negative, inf or NaN (e.g. {bad})", None)
            elif name in block_scales and not all(math.frexp(v)[0] == 0.5 for v in values):
                add("block-scales-not-ue8m0", block_scales[name], NOT_UE8M0, "--scales ue8m0", default=False)
            elif name in requantized_scales and min(values) < FLOAT16_MIN_NORMAL:
                add(
                    "tiny-scale",
                    module,
                    "weight scales below float16's normal range: vLLM (since 0.19) requantizes through float16 and "
                    "loses some of these weights",
                    None,
                )
    for m in modules:
        if m.fused and not _linear_fused(m) and m.scale in ("tensor", "expert"):
            add(
                "fused-moe-experts",
                m.module,
                "stacked MoE experts with gate and up fused on the last dimension under one scale per expert "
                "(or tensor): fused-MoE loaders (vLLM's w13_weight_scale) hold one scale per expert and shard",
                "--layout per-shard",
            )
    for w in model.weights.values():
        if w.unknown_experts:
            add(
                "fused-moe-experts",
                w.name,
                "3-D FP8 MoE experts that the architecture's registry entry does not describe: convert refuses "
                "them until an --arch-file entry gives their 'experts' layout",
                None,
            )
    for warning in ckpt.warnings:
        add("checkpoint-files", warning.split(":", 1)[0], warning, None)
    _kv_cache_findings(model, add, layout_fix)
    if scan:
        _scan_findings(model, add)
    return [
        Finding(
            code,
            modules=ms,
            reason=reason,
            fix=fix.options if isinstance(fix, Fix) else fix,
            heuristic=heuristic,
            trade_off=list(fix.trade_off) if isinstance(fix, Fix) else [],
            default_target=default,
        )
        for (code, reason, fix, heuristic, default), ms in found.items()
    ]


def _kv_cache_findings(model: CheckpointModel, add: AddFinding, layout_fix: Fix | None) -> None:
    """kv-cache scales a measured loader's default call will not use: vLLM's (a BF16 cache where the config
    declares no FP8 one; the fix: the default conversion where it writes compressed-tensors, which declares
    `kv_cache_scheme`, measured used), transformers' (dropped)."""
    ignored = [
        name
        for name, v in loader_verdicts(model).items()
        if CALLS[name].measured and v.kv_cache is not None and v.kv_cache.verdict == "ignored"
    ]
    modules = sorted({t.name.rsplit(".", 1)[0] for t in model.kv_cache_scales})
    vllm = [name for name in ignored if name != TRANSFORMERS]
    for module in modules if vllm else ():
        add(
            "kv-cache-scales-unused",
            module,
            f"kv-cache scales that {joined(vllm)} leave unused with the default call: quant_method fp8 "
            "declares no FP8 kv cache vLLM reads, so the cache stays BF16 (or serve with --kv-cache-dtype fp8)",
            layout_fix if layout_fix is not None and "--format compressed-tensors" in layout_fix.options else None,
        )
    for module in modules if TRANSFORMERS in ignored else ():
        add(
            "kv-cache-scales-dropped",
            module,
            "kv-cache scales transformers drops (unexpected keys: its attention layers hold none), in every format",
            None,
        )


def _scan_findings(model: CheckpointModel, add: AddFinding) -> None:
    with SourceFiles() as files:
        for w in model.weights.values():
            if not w.is_module_weight:
                continue
            t = w.tensor
            nan = files.contains(t.path, t.start, t.end, NAN_CODES.get(t.dtype, ()))
            negative_zero = t.dtype == E4M3FN and files.contains(t.path, t.start, t.end, (0x80,))
            if nan and t.dtype == E4M3FN and not negative_zero:
                add(
                    "fnuz-data-under-fn-label",
                    w.module,
                    "e4m3fn NaN codes (0x7F/0xFF) and no -0 (0x80): this looks like e4m3fnuz data (where 0x7F is "
                    "240) labelled e4m3fn",
                    None,
                    True,
                )
            elif nan:
                add("nan-codes", w.module, f"NaN codes in {FP8_WEIGHT_DTYPES.get(t.dtype, t.dtype)} weights", None)


def fnuz_rounding(model: CheckpointModel) -> Rounding | None:
    """Count the e4m3fnuz codes a loader holding e4m3fn parameters rounds (`FNUZ_TO_FN_SAME_SCALE`'s inexact
    codes), reading every e4m3fnuz weight; None without e4m3fnuz weights."""
    weights = [w for w in model.module_weights() if w.tensor.dtype == E4M3FNUZ]
    if not weights:
        return None
    codes = inexact_codes(FNUZ_TO_FN_SAME_SCALE.name)
    rounded = 0
    scales = []  # of the tensors holding such a code: the largest bounds the error
    with SourceFiles() as files:
        for w in weights:
            n = files.count(w.tensor.path, w.tensor.start, w.tensor.end, codes)
            rounded += n
            if n and w.scale is not None and w.scale.dtype in SCALE_DTYPES:
                scales.append(w.scale)
        largest = max((abs(v) for _, values in scale_values(scales, files) for v in values), default=None)
    half_step = e4m3_value(0x01, E4M3FN) / 2  # e4m3fn's step below 2^-6 is its smallest code: half of it, rounded
    error = None if largest is None or not math.isfinite(largest) else half_step * largest
    return Rounding(rounded, sum(w.tensor.nbytes for w in weights), error)

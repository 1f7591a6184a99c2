"""`inspect`: what a checkpoint is, what is wrong with it, and which loaders will take it.

Reads config.json and the safetensors headers, plus the few bytes of the scales
(local files only). `scan_data` also reads every FP8 weight (memchr-fast, through
a sliding memory map) to find NaN codes and e4m3fnuz data under an e4m3fn label.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8fix.checkpoint import Checkpoint, first_invalid_scale, open_checkpoint
from fp8fix.dtypes import E4M3FN, E4M3FNUZ, FP8_WEIGHT_DTYPES, NAN_CODES, SCALE_DTYPES, is_fp8
from fp8fix.encoding_plan import KV_SCALE_SUFFIXES
from fp8fix.errors import Fp8fixError
from fp8fix.experts import experts_scale_kind, is_stacked_experts
from fp8fix.planner import default_layout, find_fused_modules, scale_kind
from fp8fix.registry.architectures import ArchitectureSpec, known_architectures
from fp8fix.registry.formats import AUTOFP8, FormatSpec, detect_format, quantization_config
from fp8fix.registry.loaders import COMPATIBILITY, LOADERS
from fp8fix.safetensors_file import TensorInfo, read_values
from fp8fix.scan import range_contains
from fp8fix.summary import name_pattern

SCHEMA_VERSION = 1
#: float16's smallest normal: vLLM >= 0.20 requantizes through float16, which loses weights below it.
FLOAT16_MIN_NORMAL = 2.0**-14
BLOCK_SCALE = "weight_scale_inv"


@dataclass
class ModuleInfo:
    module: str
    fused: str | None  # registry suffix when fused
    shards: int
    weight_dtype: str
    scale: str  # tensor | shard | channel | block | missing | unknown
    scale_dtype: str | None
    scale_shape: list[int] | None
    input_scale: str  # static | static-per-shard | dynamic


@dataclass
class Finding:
    code: str
    modules: list[str]
    reason: str
    fix: str | None  # the `fp8fix convert` options that fix it; None when convert cannot
    heuristic: bool = False


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

    @property
    def fixable(self) -> list[Finding]:
        return [f for f in self.findings if f.fix]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def inspect_checkpoint(root: Path | Checkpoint, scan_data: bool = False) -> Report:
    """Inspect a local folder, or a checkpoint whose headers came from the Hub (no data: scale values unread)."""
    ckpt = root if isinstance(root, Checkpoint) else open_checkpoint(root)
    root = ckpt.root
    qc = quantization_config(ckpt.config) or {}
    fmt, supported, note = _format(ckpt)
    arch_name, arch = _architecture(ckpt.config)
    fused = {m.path: m for m in find_fused_modules(ckpt, arch)} if arch else {}
    modules = [
        _module_info(ckpt, fmt, t, fused, arch)
        for t in ckpt.tensors.values()
        if is_fp8(t.dtype) and (t.name.endswith(".weight") or is_stacked_experts(t, arch))
    ]
    encodings = sorted({FP8_WEIGHT_DTYPES.get(m.weight_dtype, m.weight_dtype) for m in modules})
    report = Report(
        source=str(root),
        format=str(qc.get("quant_method") or "none"),
        format_label=fmt.label if fmt else note,
        format_hints={k: qc[k] for k in ("version", "format", "activation_scheme", "quantization_status") if k in qc},
        convert_supported=supported,
        architecture=arch_name,
        architecture_known=arch is not None,
        encoding=", ".join(encodings) or None,
        files=[
            {"name": n, "bytes": sum(t.nbytes for t in h.tensors.values()), "tensors": len(h.tensors)}
            for n, h in ckpt.shards.items()
        ],
        modules=modules,
        kv_cache_scales=[
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
            for t in ckpt.tensors.values()
            if t.name.endswith(KV_SCALE_SUFFIXES)
        ],
        findings=[],
        loaders={},
        data_scanned=scan_data,
    )
    if not supported:
        report.notes.append(note)
    if arch is None:
        report.notes.append(f"architecture {arch_name} is not in the registry: fused modules cannot be identified")
    if not ckpt.has_data:
        report.notes.append("headers read from the Hub: scale values and weights were not read")
    report.findings = _findings(ckpt, fmt, arch, modules, scan_data and ckpt.has_data)
    report.loaders = _loaders(ckpt, arch, modules)
    return report


def _format(ckpt: Checkpoint) -> tuple[FormatSpec | None, bool, str]:
    try:
        return detect_format(ckpt.config, ckpt.root, set(ckpt.tensors)), True, ""
    except Fp8fixError as e:
        return None, False, str(e).removeprefix("config.json: ")


def _architecture(config: dict[str, Any]) -> tuple[str | None, ArchitectureSpec | None]:
    names = config.get("architectures")
    name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None
    return name, known_architectures().get(name or "")


def _module_info(
    ckpt: Checkpoint, fmt: FormatSpec | None, weight: TensorInfo, fused: dict[str, Any], arch: ArchitectureSpec | None
) -> ModuleInfo:
    """One FP8 weight: a module's `.weight`, or a stacked-experts tensor (reported under its own name)."""
    stacked = arch.experts if arch and is_stacked_experts(weight, arch) else None
    module = weight.name if stacked else weight.name.rsplit(".", 1)[0]
    f = None if stacked else fused.get(module)
    experts_shards = len(stacked.fused.get(weight.name.rpartition(".")[2], ())) if stacked else 0
    n = len(f.rows) if f else max(experts_shards, 1)
    scale = ckpt.tensors.get((fmt or AUTOFP8).weight_scale_of(weight.name))
    block = ckpt.tensors.get(f"{module}.{BLOCK_SCALE}")
    if scale is None and block is not None:
        scale, kind = block, "block"
    elif scale is None:
        kind = "missing"
    else:
        block_shape = fmt.block if fmt else None
        try:
            if stacked:
                kind = experts_scale_kind(scale, weight.shape, n, block_shape)
            else:
                kind = scale_kind(scale, weight.shape, n if f else None, allow_channel=True, block=block_shape)
        except Fp8fixError:
            kind = "unknown"
    inp = ckpt.tensors.get((fmt or AUTOFP8).input_scale_of(weight.name))
    input_kind = "dynamic" if inp is None else ("static-per-shard" if f and inp.shape == (n,) else "static")
    fused_kind = f"experts.{weight.name.rpartition('.')[2]}" if experts_shards > 1 else None
    return ModuleInfo(
        module=module,
        fused=f.spec.module if f else fused_kind,
        shards=n,
        weight_dtype=weight.dtype,
        scale=kind,
        scale_dtype=scale.dtype if scale else None,
        scale_shape=list(scale.shape) if scale else None,
        input_scale=input_kind,
    )


def _linear_fused(m: ModuleInfo) -> bool:
    """A fused linear module (the loader table's subject), not stacked experts."""
    return m.fused is not None and not m.fused.startswith("experts.")


def _findings(
    ckpt: Checkpoint, fmt: FormatSpec | None, arch: ArchitectureSpec | None, modules: list[ModuleInfo], scan: bool
) -> list[Finding]:
    found: dict[tuple[str, str, str | None, bool], list[str]] = defaultdict(list)

    def add(code: str, module: str, reason: str, fix: str | None, heuristic: bool = False) -> None:
        found[(code, reason, fix, heuristic)].append(module)

    unfused_ok = arch is not None and default_layout(arch) == "unfused"
    for m in modules:
        if _linear_fused(m) and m.scale == "tensor":
            add(
                "single-scale-fused",
                m.module,
                "a fused module with one scale: vLLM <= 0.5.0 expects one scale per shard",
                "--layout unfused" if unfused_ok else "--layout per-shard",
            )
        if _linear_fused(m) and m.scale == "shard":
            add(
                "per-shard-scales-on-fused",
                m.module,
                "a fused weight with a per-shard scale vector: vLLM >= 0.5.1 and transformers reject it",
                "--layout fused" + (" (or --layout unfused)" if unfused_ok else ""),
            )
        if m.scale == "missing":
            add("missing-scale", m.module, "an FP8 weight without a scale: its values cannot be recovered", None)
        if m.scale == "unknown":
            add("unknown-scale-shape", m.module, "a scale whose shape fits no known convention", None)
        if m.weight_dtype == E4M3FNUZ:
            add(
                "e4m3fnuz-for-vllm",
                m.module,
                "e4m3fnuz weights: vLLM copies them into e4m3fn parameters, rounding away the smallest subnormals, "
                "and converts e4m3fn checkpoints for MI300 itself",
                "--to e4m3fn",
            )
    for name, t in ckpt.tensors.items() if ckpt.has_data else ():
        if not name.endswith(("_scale", "_scale_inv")) or t.dtype not in SCALE_DTYPES:
            continue
        if t.numel > 1_000_000:
            continue
        values = read_values(t)
        stacked = name.rsplit("_scale", 1)[0]  # experts.gate_up_proj_scale belongs to experts.gate_up_proj
        is_stacked = stacked in ckpt.tensors and len(ckpt.tensors[stacked].shape) == 3
        module = stacked if is_stacked else name.rsplit(".", 1)[0]
        bad = first_invalid_scale(values)
        if bad is not None:
            add("bad-scale-value", module, f"a scale that is zero, negative, inf or NaN (e.g. {bad})", None)
        elif name.endswith(".weight_scale") and min(values) < FLOAT16_MIN_NORMAL:
            add(
                "tiny-scale",
                module,
                "weight scales below float16's normal range: vLLM >= 0.20 requantizes through float16 and loses "
                "some of these weights",
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
    for t in ckpt.tensors.values():
        if is_fp8(t.dtype) and len(t.shape) == 3 and "experts" in t.name and not is_stacked_experts(t, arch):
            add(
                "fused-moe-experts",
                t.name,
                "3-D FP8 MoE experts that the architecture's registry entry does not describe: convert refuses "
                "them until an --arch-file entry gives their 'experts' layout",
                None,
            )
    if scan:
        _scan_findings(ckpt, modules, add)
    return [
        Finding(code, modules=ms, reason=reason, fix=fix, heuristic=heuristic)
        for (code, reason, fix, heuristic), ms in found.items()
    ]


def _scan_findings(ckpt: Checkpoint, modules: list[ModuleInfo], add: Any) -> None:
    for m in modules:
        t = ckpt.tensors.get(m.module + ".weight") or ckpt.tensors[m.module]
        fd = os.open(t.path, os.O_RDONLY)
        try:
            nan = range_contains(fd, t.start, t.end, NAN_CODES.get(t.dtype, ()))
            negative_zero = t.dtype == E4M3FN and range_contains(fd, t.start, t.end, (0x80,))
        finally:
            os.close(fd)
        if nan and t.dtype == E4M3FN and not negative_zero:
            add(
                "fnuz-data-under-fn-label",
                m.module,
                "e4m3fn NaN codes (0x7F/0xFF) and no -0 (0x80): this looks like e4m3fnuz data (where 0x7F is 240) "
                "labelled e4m3fn",
                None,
                True,
            )
        elif nan:
            add("nan-codes", m.module, f"NaN codes in {FP8_WEIGHT_DTYPES.get(t.dtype, t.dtype)} weights", None)


def _loaders(ckpt: Checkpoint, arch: ArchitectureSpec | None, modules: list[ModuleInfo]) -> dict[str, dict[str, Any]]:
    """Loads/fails per loader, from the layout the checkpoint's fused modules are in."""
    layouts = set()
    for m in modules:
        if _linear_fused(m):
            layouts.add("per-shard" if m.scale == "shard" else "fused")
    if arch is not None and not any(_linear_fused(m) for m in modules):
        unfused_names = {s.unfused for spec in arch.fused_modules for s in spec.shards if s.unfused}
        if any(m.module.endswith(tuple(unfused_names)) for m in modules if unfused_names):
            layouts.add("unfused")
    table: dict[str, dict[str, Any]] = {}
    for loader in LOADERS:
        rows = [COMPATIBILITY[layout][loader] for layout in sorted(layouts)]
        failing = [why for loads, why in rows if not loads]
        if failing:
            table[loader] = {"loads": False, "reason": "; ".join(failing)}
        elif rows:
            table[loader] = {"loads": True, "reason": "; ".join(why for _, why in rows)}
        else:
            table[loader] = {"loads": True, "reason": "no fused modules"}
    if any(m.scale in ("missing", "unknown") for m in modules):
        for row in table.values():
            row.update(loads=False, reason="FP8 weights without a usable scale")
    return table


def report_lines(report: Report) -> list[str]:
    """The report for people: a few header lines, one row per kind of module, findings, loaders."""
    from fp8fix.summary import human_size

    hints = ", ".join(f"{k} {v}" for k, v in report.format_hints.items())
    supported = "" if report.convert_supported else " [convert: not supported yet]"
    arch = report.architecture or "unknown"
    if not report.architecture_known:
        arch += " (not in the registry)"
    total = sum(f["bytes"] for f in report.files)
    lines = [
        f"checkpoint:   {report.source}",
        f"format:       {report.format_label}" + (f" ({hints})" if hints else "") + supported,
        f"architecture: {arch}",
        f"encoding:     {report.encoding or 'no FP8 weights'}",
        f"files:        {len(report.files)} safetensors, {human_size(total)}",
    ]
    groups: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for m in report.modules:
        shape = "-" if m.scale_shape is None else "[" + ", ".join(map(str, m.scale_shape)) + "]"
        key = (m.fused is not None, m.shards, m.scale, m.scale_dtype or "-", shape, m.input_scale)
        groups[key].append(m.module)
    lines.append(f"FP8 modules:  {len(report.modules)}")
    lines.append(f"  {'modules':<48} {'count':>5}  {'fused':<8} {'weight scale':<24} input scale")
    for (is_fused, shards, kind, dtype, shape, inp), names in groups.items():
        fused = f"{shards} shards" if is_fused else "-"
        lines.append(f"  {name_pattern(names):<48} {len(names):>5}  {fused:<8} {f'{kind} {dtype} {shape}':<24} {inp}")
    if report.kv_cache_scales:
        kinds = sorted({s["name"].rsplit(".", 1)[-1] for s in report.kv_cache_scales})
        lines.append(f"kv-cache scales: {len(report.kv_cache_scales)} ({', '.join(kinds)})")
    lines.append(
        f"findings:     {len(report.findings) or 'none'}"
        + ("" if report.data_scanned else " (weights not scanned: --scan-data)")
    )
    for f in report.findings:
        fix = f"fix: fp8fix convert SOURCE OUTPUT {f.fix}" if f.fix else "convert cannot fix this"
        guess = " [heuristic]" if f.heuristic else ""
        where = f"{len(f.modules)} module(s) {name_pattern(f.modules)}"
        lines.append(f"  {f.code}{guess}: {where}: {f.reason}; {fix}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    lines.append("loaders:")
    for loader, row in report.loaders.items():
        lines.append(f"  {'loads' if row['loads'] else 'fails':<5}  {loader}: {row['reason']}")
    return lines

"""`inspect`'s report for people: a few header lines, one row per kind of module, findings, loaders."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fp8fix.inspection import Report
from fp8fix.report.text import human_size, joined, name_pattern
from fp8fix.verdicts import calls_line, kv_cache_line, package_line, verdict_line


def report_lines(report: Report, verbose: bool = False) -> list[str]:
    """The report for people: a few header lines, one row per kind of module (per module with
    `verbose`), findings, loaders."""
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
        groups[(*key, m.module) if verbose else key].append(m.module)
    lines.append(f"FP8 modules:  {len(report.modules)}")
    if report.modules:  # (an FP4-only checkpoint: no table)
        lines.append(f"  {'count':>5}  {'fused':<8}  {'weight scale':<22}  {'input':<16}  modules")
    for (is_fused, shards, kind, dtype, shape, inp, *_), names in groups.items():
        fused = f"{shards} shards" if is_fused else "-"
        scale = f"{kind} {dtype} {shape}"
        lines.append(f"  {len(names):>5}  {fused:<8}  {scale:<22}  {inp:<16}  {name_pattern(names)}")
    lines += fp4_lines(report.fp4_modules)
    if report.kv_cache_scales:
        kinds = sorted({s["name"].rsplit(".", 1)[-1] for s in report.kv_cache_scales})
        lines.append(f"kv-cache scales: {len(report.kv_cache_scales)} ({', '.join(kinds)})")
    lines.append(
        f"findings:     {len(report.findings) or 'none'}"
        + ("" if report.data_scanned else " (weights not scanned: --scan-data)")
    )
    for f in report.findings:
        fix = f"fix: fp8fix convert SOURCE OUTPUT {f.fix}" if f.fix else "convert cannot fix this"
        if f.fix and f.trade_off:
            fix += f" (which {', '.join(f.trade_off)} would then not load correctly)"
        if f.fix and not f.default_target:
            fix += " (not a problem for --target auto's loaders)"
        guess = " [heuristic]" if f.heuristic else ""
        where = joined(f.loaders) if f.loaders else f"{len(f.modules)} module(s) {name_pattern(f.modules)}"
        lines.append(f"  {f.code}{guess}: {where}: {f.reason}; {fix}")
    for note in report.notes:
        lines.append(f"  note: {note}")
    lines.append("loaders:")
    for loader, row in report.loaders.items():
        lines.append(verdict_line(loader, row["verdict"], row["reason"]))
        installed = row.get("with_package")
        if installed:
            lines.append(package_line(installed["package"], installed["verdict"], installed["reason"]))
    kv = kv_cache_line(
        {name: row["kv_cache_scales"]["verdict"] for name, row in report.loaders.items() if row["kv_cache_scales"]}
    )
    lines += [kv] if kv else []
    lines.append(calls_line())
    return lines + tensor_parallel_lines(report.tensor_parallel)


def fp4_lines(modules: list[dict[str, Any]]) -> list[str]:
    """The FP4 modules, a row per (scheme, scale dtype) with the modules' names."""
    if not modules:
        return []
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m in modules:
        groups[(str(m["scheme"] or "unreadable").upper(), str(m["scale_dtype"] or "no scale"))].append(m["module"])
    per = {"NVFP4": "E2M1, an e4m3 scale per 16 / a global scale", "MXFP4": "E2M1, an E8M0 scale per 32"}
    lines = [f"FP4 modules:  {len(modules)}"]
    for (scheme, dtype), names in groups.items():
        what = per.get(scheme, "its scale fits neither scheme")
        lines.append(f"  {len(names):>5}  {scheme} ({what}; {dtype})  {name_pattern(names)}")
    return lines


def tensor_parallel_lines(parallel: dict[str, Any] | None) -> list[str]:
    """`inspect --tp`: per size, each kind of module whose rank share is not whole blocks."""
    if parallel is None:
        return []
    b0, b1 = parallel["block"]
    lines = [f"tensor parallel ({parallel['runtime']}, {b0}x{b1} blocks):"]
    for tp, entry in parallel["sizes"].items():
        if entry["clean"]:
            lines.append(f"  TP {tp}: every rank's share is whole blocks")
            continue
        lines.append(f"  TP {tp}:")
        for g in entry["modules"]:
            share = f"{g['per_rank']} of {g['size']} per rank" if g["per_rank"] is not None else f"{g['size']}"
            lines.append(f"    {g['behaviour']:<12}  {g['modules']} ({g['role']}, {share}): {g['message']}")
    clean = ", ".join(map(str, parallel["clean_sizes"])) or "none"
    lines.append(f"  every share whole blocks at TP: {clean}")
    return lines

"""A conversion's result (`ConvertResult`), described for people (text) and for CI (JSON), compactly.

A 32-layer model has 64 fused modules; people want one line per kind of change,
with the layers it covers, not 64 lines. `--json` keeps every module.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8fix.plan.pieces import ConversionPlan, ModuleChange
from fp8fix.plan.targets import TARGET_LOADERS
from fp8fix.report.text import human_size, joined, name_pattern
from fp8fix.verdicts import kv_cache_line, package_line, verdict_line, verdicts_json
from fp8fix.vocab import SCHEMA_VERSION

if TYPE_CHECKING:
    from fp8fix.verification.report import VerifyReport


@dataclass
class ConvertResult:
    plan: ConversionPlan
    output: Path
    written: bool
    config_edits: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    verification: VerifyReport | None = None
    commit_title: str = ""  # what was converted and how, for a Hub commit
    warnings: list[str] = field(default_factory=list)  # what the user should know but did not stop the conversion
    processes: int = 1  # how many processes wrote the shards (`jobs` applies where the work is CPU-bound)

    def to_json(self) -> dict[str, Any]:
        """What `convert --json` prints (docs/cli-output.md, "JSON output")."""
        return result_json(self)


def module_groups(plan: ConversionPlan) -> list[dict[str, Any]]:
    """Modules grouped by (kind, scale, action), with the name pattern they share."""
    groups: dict[tuple[str, str, str, str], list[ModuleChange]] = defaultdict(list)
    for m in plan.modules:
        groups[(m.fused_module, m.scale, m.action, _generic_reason(m.reason))].append(m)
    out = []
    for (kind, scale, action, _), members in groups.items():
        first = members[0]
        errors = [m.max_error for m in members if m.max_error is not None]
        steps = [m.max_error_steps for m in members if m.max_error_steps is not None]
        out.append(
            {
                "kind": kind,
                "count": len(members),
                "modules": name_pattern([m.module for m in members]),
                "quantized": first.quantized,
                "scale": scale,
                "action": action,
                "reason": first.reason,
                "into": [n.rsplit(".", 1)[-1] for n in first.new_modules],
                "max_error": max(errors) if errors else None,
                "max_error_steps": max(steps) if steps else None,
            }
        )
    return out


def _generic_reason(reason: str) -> str:
    return re.sub(r"\([^)]*\)", "", reason)


VLLM_FNUZ_NOTE = (
    "note: vLLM loads FP8 weights into e4m3fn parameters on every platform and converts e4m3fn checkpoints "
    "for MI300 itself (>= 0.9, in the right order); give vLLM the e4m3fn checkpoint. e4m3fnuz output is for "
    "runtimes that consume e4m3fnuz weights as they are."
)


def encoding_line(plan: ConversionPlan) -> str | None:
    e = plan.encoding
    if e is None:
        return None
    factor = "doubled" if e.target == "e4m3fnuz" else "halved"
    line = (
        f"encoding: {e.source} -> {e.target}: {e.weights} FP8 weights relabelled"
        + (" (0x80, -0, becomes 0x00)" if e.target == "e4m3fnuz" else "")
        + f", {e.scales} weight/input scales {factor}, {e.kv_scales_kept} kv-cache scales kept"
    )
    if e.same_scale_weights:
        line += (
            f"; {len(e.same_scale_weights)} weights hold +-240 (NaN in e4m3fn), so they keep their scale and each "
            "code maps to the same value"
        )
        if e.inexact_codes is not None:
            line += f" ({e.inexact_codes} codes below 2^-6 rounded by half an e4m3fn step)"
    return line


def dequantized_lines(plan: ConversionPlan) -> list[str]:
    """`--to bf16` / `--dequantize`: the weights written unquantized, their growth and worst rounding."""
    written = plan.dequantized
    if not written:
        return []
    dtype = written[0].dtype
    grown = sum(m.added_bytes for m in written)
    errors = [m.max_error for m in written if m.max_error is not None]
    steps = [m.max_error_steps for m in written if m.max_error_steps is not None]
    worst = (
        f"rounding error at most {max(errors):.3g} ({max(steps):.2f} {dtype} steps)"
        if errors and steps
        else "rounding error reported once written"
    )
    if plan.unquantized:
        schemes = Counter(m.scheme for m in written)
        fp8 = schemes.pop("fp8", 0)
        fp4 = ", ".join(f"{n} {scheme.upper()}" for scheme, n in sorted(schemes.items()))
        parts = [f"FP8 weight ({fp8})"] if fp8 or not fp4 else []
        what = "every " + " and ".join([*parts, *([f"FP4 module ({fp4})"] if fp4 else [])])
        what += f" written in {dtype}, unquantized"
    else:
        names = name_pattern([m.module for m in written])
        what = f"{len(written)} module(s) written in {dtype}, listed as unquantized: {names}"
    return [f"unquantized: {what}; code x scale rounded once, {worst}; scales dropped, +{human_size(grown)}"]


def ue8m0_lines(plan: ConversionPlan) -> list[str]:
    """`--scales ue8m0`: blocks kept and requantized, fp8fix's error beside vLLM's load-time requantization;
    `--blocks mx` (the same powers of two, written as MXFP8's E8M0 bytes): blocks kept and requantized."""
    change = plan.ue8m0
    if change is None:
        return []
    modules = change.modules
    blocks = sum(m.blocks for m in modules)
    line = f"scales: ue8m0: {len(modules)} block-scaled weight(s), {blocks} blocks, every scale a power of two"
    if change.mx:
        line = (
            f"blocks: mx: {len(modules)} block-scaled weight(s) written as MXFP8 (an E8M0 byte per 32 elements), "
            f"{blocks} blocks, each at one power of two"
        )
    written = [m for m in modules if m.blocks_kept is not None]
    if not written:
        return [line + "; blocks kept / requantized and errors reported once written"]
    kept = sum(m.blocks_kept or 0 for m in written)
    again = sum(m.blocks_requantized or 0 for m in written)
    halved = sum(m.blocks_halved or 0 for m in written)
    worst = max(m.max_steps or 0.0 for m in written)
    vllm = max(m.vllm_max_steps or 0.0 for m in written)
    rms = max(m.rms_steps or 0.0 for m in written)
    vllm_rms = max(m.vllm_rms_steps or 0.0 for m in written)
    said = (
        f"{line}; {kept} kept as they are (already powers of two), {again} requantized once ({halved} at half "
        f"the smallest power that holds them)"
    )
    if change.mx and not again:
        return [said + ": every value kept exactly"]
    said += f"; error in source fp8 steps: max {worst:.3f}, RMS {rms:.4f} (worst module)"
    if change.mx:  # the comparison is with vLLM's DeepGEMM path, which reads block FP8, not MXFP8
        return [said]
    return [said + f"; vLLM's own load-time requantization of SOURCE: max {vllm:.3f}, RMS {vllm_rms:.4f}"]


def reblocked_lines(plan: ConversionPlan) -> list[str]:
    """`--blocks 128x128`: MX weights (MXFP8, MXFP4) at a power of two per 128 x 128 block; blocks exact and values
    rounded."""
    modules = plan.reblocked
    if not modules:
        return []
    blocks = sum(m.blocks for m in modules)
    line = f"blocks: 128x128: {len(modules)} MX weight(s) in {blocks} blocks, each one power of two"
    written = [m for m in modules if m.blocks_exact is not None]
    if not written:
        return [line + "; blocks kept exactly / rounded reported once written"]
    exact = sum(m.blocks_exact or 0 for m in written)
    rounded = sum(m.values_rounded or 0 for m in written)
    worst = max(m.max_steps or 0.0 for m in written)
    error = max(m.max_error or 0.0 for m in written)
    said = f"{rounded} value(s) rounded once, at most {worst:.2f} e4m3fn steps ({error:.3g})" if rounded else "none"
    return [f"{line}; {exact} of {blocks} blocks keep every value exactly; rounded: {said}"]


def shared_fp4_lines(plan: ConversionPlan) -> list[str]:
    """NVFP4 modules moved to the global scale their packed layer shares: groups kept exactly, values moved."""
    modules = plan.shared_fp4
    if not modules:
        return []
    layers = len({tuple(m.layer) for m in modules})
    groups = sum(m.groups for m in modules)
    line = (
        f"nvfp4: {len(modules)} module(s) of {layers} packed layer(s) (q / k / v, gate / up) given the global scale "
        "vLLM and SGLang use for the whole layer (the largest multiplier)"
    )
    written = [m for m in modules if m.groups_exact is not None]
    if not written:
        return [line + "; groups kept exactly reported once written"]
    exact = sum(m.groups_exact or 0 for m in written)
    worst = max(m.max_steps or 0.0 for m in written)
    error = max(m.max_error or 0.0 for m in written)
    said = f"; the others requantized once, at most {worst:.2f} E2M1 steps ({error:.3g})" if exact < groups else ""
    return [f"{line}; {exact} of {groups} groups of 16 keep every value exactly{said}"]


def plan_loaders(plan: ConversionPlan) -> dict[str, dict[str, Any]]:
    """The loaders' verdicts on the checkpoint the plan writes (`fp8fix.verdicts`), as JSON."""
    return verdicts_json(plan.loaders)


def plan_lines(plan: ConversionPlan, verbose: bool = False) -> list[str]:
    """The plan as text: what the checkpoint is, each kind of module change (each module, and each
    tensor written anew, with `verbose`), the output files."""
    how = f"best for --target {plan.target}" if plan.layout_was_default else "chosen"
    lines = [f"source:  {plan.source} ({plan.architecture}, {plan.format.label})"]
    if plan.unquantized:
        lines.append(f"output:  a plain {plan.unquantized} model (no quantization config), module names kept")
    else:
        lines.append(
            f"layout:  {plan.layout} ({how})"
            + (f"; written as {plan.output_format}" if plan.output_format != "keep" else "")
        )
    groups = [g for m in plan.modules for g in module_groups(_only(plan, m))] if verbose else module_groups(plan)
    encoding = encoding_line(plan)
    if encoding:
        lines.append(encoding)
    lines += padding_lines(plan)
    lines += dequantized_lines(plan)
    lines += ue8m0_lines(plan)
    lines += reblocked_lines(plan)
    lines += shared_fp4_lines(plan)
    if not groups and not plan.unquantized and not plan.reblocked and not (plan.ue8m0 and plan.ue8m0.mx):
        lines.append("modules: no fused modules in this checkpoint")
    for g in groups:
        into = f" -> {', '.join(g['into'])}" if g["into"] else ""
        error = ""
        if g["max_error"] is not None:
            error = f"; max error {g['max_error']:.3g} ({g['max_error_steps']:.2f} fp8 steps)"
        lines.append(f"  {g['action']:<18} {g['modules']}{into} [{g['scale']} scale]: {g['reason']}{error}")
    for shard in plan.shards:
        changed = sum(not t.unchanged for t in shard.tensors)
        size = human_size(shard.nbytes)
        lines.append(f"  file {shard.name}: {len(shard.tensors)} tensors ({changed} new or rewritten), {size}")
        if verbose:
            lines += [
                f"    {t.name} {t.dtype} {list(t.shape)}" + (f" <- {t.source}" if t.source != t.name else "")
                for t in shard.tensors
                if not t.unchanged
            ]
    return lines


def _only(plan: ConversionPlan, module: ModuleChange) -> ConversionPlan:
    return dataclasses.replace(plan, modules=[module])


def padding_lines(plan: ConversionPlan) -> list[str]:
    """`--tp N`: each kind of MLP padded (intermediate before -> after), the growth, the experts note."""
    padding = plan.padding
    if padding is None:
        return []
    total = plan.total_bytes
    grown = padding.added_bytes
    outcome = "outputs unchanged"
    if padding.bf16:
        outcome += f" but for the BF16 rounding of {len(padding.bf16)} module(s)"
    lines = [
        f"tp {padding.tp}: MLP intermediates zero-padded to multiples of {padding.multiple} "
        f"(+{human_size(grown)} in all, {100 * grown / max(total - grown, 1):.2f}% of the checkpoint); {outcome}"
    ]
    groups: dict[tuple[str, int, int], list[Any]] = defaultdict(list)
    for m in padding.mlps:
        groups[(m.size, m.intermediate, m.padded)].append(m)
    for (size, before, after), members in groups.items():
        grown = sum(m.added_bytes for m in members)
        change = f"{before} -> {after}" if after != before else f"{before}, already whole blocks"
        lines.append(f"  pad {name_pattern([m.module for m in members])} ({size}): {change}, +{human_size(grown)}")
    if any(".experts." in m.module and m.padded != m.intermediate for m in padding.mlps):
        lines.append(
            "  note: routed experts need no padding under expert parallelism (vLLM --enable-expert-parallel "
            "keeps each expert whole on one rank)"
        )
    if padding.bf16:
        grown = sum(m.added_bytes for m in padding.bf16)
        errors = [m.max_error for m in padding.bf16 if m.max_error is not None]
        steps = [m.max_error_steps for m in padding.bf16 if m.max_error_steps is not None]
        worst = (
            f"; BF16 rounding error at most {max(errors):.3g} ({max(steps):.2f} BF16 steps)"
            if errors and steps
            else "; BF16 rounding error reported once written"
        )
        lines.append(
            f"  BF16 {name_pattern([m.module for m in padding.bf16])}: split by attention heads, not whole blocks "
            f"per rank; dequantized and listed as unquantized (--tp-bf16), +{human_size(grown)}{worst}"
        )
    return lines


def loader_lines(plan: ConversionPlan) -> list[str]:
    what = f"the plain {plan.unquantized} model" if plan.unquantized else f"the {plan.layout} layout"
    lines = [f"loaders for {what} (what OUTPUT will do):"]
    for name, v in plan.loaders.items():
        was = plan.source_loaders.get(name)
        change = f" (SOURCE: {was.verdict})" if was and was.verdict != v.verdict else ""
        lines.append(verdict_line(name, v.verdict, v.reason + change))
        if v.installed is not None:
            lines.append(package_line(v.package, v.installed.verdict, v.installed.reason))
    kv = kv_cache_line({name: v.kv_cache.verdict for name, v in plan.loaders.items() if v.kv_cache})
    before = kv_cache_line({name: v.kv_cache.verdict for name, v in plan.source_loaders.items() if v.kv_cache})
    if kv:
        source = f" (SOURCE: {before.removeprefix('  kv-cache scales: ')})" if before and before != kv else ""
        lines.append(kv + source)
    return lines


def plan_json(plan: ConversionPlan) -> dict[str, Any]:
    return {
        "source": str(plan.source),
        "architecture": plan.architecture,
        "format": plan.format.name,
        "layout": plan.layout,
        "layout_was_default": plan.layout_was_default,
        "target": plan.target,
        "output_format": plan.output_format,
        "notes": plan.notes,
        "modules": [
            {
                "module": m.module,
                "kind": m.fused_module,
                "quantized": m.quantized,
                "scale": m.scale,
                "action": m.action,
                "reason": m.reason,
                "shards": dict(zip(m.shards, m.rows, strict=True)),
                "new_modules": m.new_modules,
                "blocks": m.blocks,
                "blocks_requantized": m.blocks_requantized,
                "max_error": m.max_error,
                "max_error_steps": m.max_error_steps,
            }
            for m in plan.modules
        ],
        "files": [
            {
                "name": s.name,
                "tensors": len(s.tensors),
                "bytes": s.nbytes,
                "changed_tensors": sum(not t.unchanged for t in s.tensors),
            }
            for s in plan.shards
        ],
        "encoding": None if plan.encoding is None else dataclasses.asdict(plan.encoding),
        "unquantized": plan.unquantized,
        "dequantized": [dataclasses.asdict(m) for m in plan.dequantized],
        "ue8m0": None
        if plan.ue8m0 is None
        else {
            "scale_fmt": plan.ue8m0.scale_fmt,
            "mx": plan.ue8m0.mx,
            "modules": [dataclasses.asdict(m) for m in plan.ue8m0.modules],
        },
        "reblocked": [dataclasses.asdict(m) for m in plan.reblocked],
        "shared_fp4": [dataclasses.asdict(m) for m in plan.shared_fp4],
        "tensor_parallel": None
        if plan.padding is None
        else {
            "tp": plan.padding.tp,
            "multiple": plan.padding.multiple,
            "config": plan.padding.config,
            "added_bytes": plan.padding.added_bytes,
            "mlps": [dataclasses.asdict(m) for m in plan.padding.mlps],
            "bf16": [dataclasses.asdict(m) for m in plan.padding.bf16],
        },
        "loaders": plan_loaders(plan),
        "source_loaders": verdicts_json(plan.source_loaders),
    }


def source_loads_everywhere(plan: ConversionPlan) -> list[str]:
    """The target's loaders, when SOURCE already loads correctly in every one of them; else []."""
    wanted = TARGET_LOADERS[plan.target]
    return list(wanted) if all(plan.source_loaders[name].loads for name in wanted) else []


def result_lines(result: ConvertResult, verbose: bool = False) -> list[str]:
    """What `convert` prints for people: the plan, config edits, copies, loaders, notes, outcome."""
    plan = result.plan
    lines = plan_lines(plan, verbose)
    lines += [f"  config.json: {edit}" for edit in result.config_edits]
    if result.copied_files:
        lines.append(f"  copied: {', '.join(result.copied_files)}")
    lines += loader_lines(plan)
    already = source_loads_everywhere(plan)
    if already:
        lines.append(f"note: SOURCE already loads correctly in {joined(already)}; OUTPUT is written all the same")
    lines += [f"note: {note}" for note in plan.notes]
    if plan.encoding and plan.encoding.target == "e4m3fnuz":
        lines.append(VLLM_FNUZ_NOTE)
    if result.verification:
        lines.append(f"verified: {result.verification.summary()}")
    lines.append(f"wrote {result.output}" if result.written else "dry run: nothing written")
    return lines


def result_json(result: ConvertResult) -> dict[str, Any]:
    payload = {"schema_version": SCHEMA_VERSION, **plan_json(result.plan)}
    payload.update(
        output=str(result.output),
        written=result.written,
        config_edits=result.config_edits,
        copied_files=result.copied_files,
        verification=result.verification.to_json() if result.verification else None,
        warnings=result.warnings,
        processes=result.processes,
    )
    return payload

"""FP4 modules through an FP8 conversion: copied byte for byte and declared in OUTPUT's config as in SOURCE's.

A mixed checkpoint (compressed-tensors `mixed-precision`: FP8 groups beside NVFP4 / MXFP4 ones; ModelOpt
MIXED_PRECISION; DeepSeek-V4's block FP8 beside MXFP4 experts) has its FP8 parts converted as any FP8 checkpoint's
(layouts, `--scales`, encodings, `--dequantize`); its FP4 modules are no input of those rewrites. Each is checked
here once the conversion is planned, whatever planned it: every tensor of the module written under its own name as
SOURCE's bytes, and what config.json says of it unchanged (the config groups that target it, by the format's own
matching, the lists that name it, its format's settings). A conversion that would move, rewrite or re-declare one
(a layout unfusing a module ModelOpt's map names, a config written in another format, `--tp` padding that changes a
size, a rewritten hf_quant_config.json) is refused before anything is written, rather than writing FP4 bytes under
a declaration that reads them wrongly. (NVFP4 projections a runtime packs under one global scale, where theirs
differ, are then given that scale: `fp4_shared`, a pass over the plan checked here.)
"""

from __future__ import annotations

import copy
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel
from fp8fix.plan.pieces import ConversionPlan, OutputTensor
from fp8fix.plan.planner import kept_as_is
from fp8fix.registry.formats import FormatSpec, locations, name_matcher, quantization_config
from fp8fix.vocab import ConvertTo, Grammar

#: How `--to bf16` would convert them instead: what each refusal suggests.
_WHOLE = "`fp8fix convert SOURCE OUTPUT --to bf16` writes every FP4 and FP8 weight unquantized"


def require_fp4_encoding(model: CheckpointModel, to: ConvertTo | None) -> None:
    """An FP8 encoding change leaves MXFP4 modules as they are (their scales are E8M0 bytes); NVFP4 scales are
    e4m3fn values, which a runtime reading the output's FP8 as e4m3fnuz would read at half their value."""
    nvfp4 = [w.module for w in model.fp4.values() if w.scheme == "nvfp4"]
    if to not in (None, "e4m3fn") and nvfp4:
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: --to {to} with NVFP4 module(s) ('{nvfp4[0]}', ...): their scales are "
            f"e4m3fn values, which a runtime reading this output's FP8 as {to} would misread; {_WHOLE}"
        )


def check_fp4_kept(plan: ConversionPlan, model: CheckpointModel) -> None:
    """Raise UnsupportedCheckpoint unless every FP4 module of `model` is written as SOURCE holds it and declared
    by OUTPUT's config as by SOURCE's."""
    if not model.fp4:
        return
    written: dict[str, list[OutputTensor]] = {}
    for t in () if plan.sketch else (t for shard in plan.shards for t in shard.tensors):
        written.setdefault(t.name, []).append(t)
    source_config = model.checkpoint.config
    output_config = plan.config_files.get(CONFIG, (source_config, []))[0]
    fmt = model.require_format()
    refusal = _config_refusal(plan, model, fmt)
    if refusal is not None:
        raise UnsupportedCheckpoint(f"{model.checkpoint.root.name}: {refusal}; {_WHOLE}")
    sources = model.checkpoint.tensors  # as stored (an MXFP4 scale is read as E8M0, stored as U8)
    for w in model.fp4.values():
        names = [] if plan.sketch else [t.name for t in w.tensors]
        moved = next((n for n in names if not kept_as_is(n, written.get(n, []), sources)), None)
        if moved is not None:
            raise UnsupportedCheckpoint(
                f"{model.checkpoint.root.name}: this conversion would rewrite or rename '{moved}' of FP4 module "
                f"'{w.module}' ({(w.scheme or 'fp4').upper()}); FP4 modules pass through FP8 conversions only as they "
                f"are (choose a layout that keeps them, e.g. --layout fused); {_WHOLE}"
            )
    redeclared = None if output_config is source_config else _redeclared(source_config, output_config, model, fmt)
    if redeclared is not None:
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: this conversion would change how config.json declares FP4 module "
            f"'{redeclared}' (the config groups that target it, a list that names it, or the settings of its "
            f"format); FP4 modules pass through FP8 conversions only declared as in SOURCE; {_WHOLE}"
        )


def _config_refusal(plan: ConversionPlan, model: CheckpointModel, fmt: FormatSpec) -> str | None:
    """Why the configs `plan` writes cannot leave its FP4 modules declared as SOURCE's do, before any is matched."""
    first = next(iter(model.fp4))
    if plan.padding is not None and plan.padding.config:
        sizes = ", ".join(f"{k} {v}" for k, v in plan.padding.config.items())
        return (
            f"--tp padding would make config.json say {sizes}, which FP4 module '{first}' (not padded: FP4 modules "
            "pass through as they are) would contradict"
        )
    side = sorted(f for f in plan.config_files if f != CONFIG)
    if side:  # (ModelOpt's hf_quant_config.json: where its FP4 modules may be declared)
        return (
            f"this conversion would rewrite {side[0]}, which declares FP4 module '{first}' too; FP4 modules pass "
            "through FP8 conversions only declared as in SOURCE"
        )
    if fmt.layers and plan.renames:  # ModelOpt MIXED_PRECISION: `quantized_layers` names modules as SOURCE does
        return (
            f"unfusing '{next(iter(plan.renames))}' would leave the ModelOpt config's quantized_layers naming it, not "
            "its shards (a loader then leaves them unquantized); keep the layout (--layout fused)"
        )
    return None


def _redeclared(source: dict[str, Any], output: dict[str, Any], model: CheckpointModel, fmt: FormatSpec) -> str | None:
    """The first FP4 module that config.json `output` declares otherwise than `source`, or None: the settings
    outside the module-name lists (a config group's, where that group targets the module), and the entries of
    each list (config groups' targets, `ignore`, `modules_to_not_convert`, ...) that one config has and the
    other has not, matched against the modules by the list's own grammar. Only what differs is matched: a
    config and 100k FP4 modules (DeepSeek-V4) are not matched entry by entry for each module."""
    modules = list(model.fp4)
    before, after = _without_lists(source, fmt), _without_lists(output, fmt)
    if before.keys() != after.keys() or any(before[k] != after[k] for k in before if k != "config_groups"):
        return modules[0]  # quant_method, format, expert_dtype, ...: every module's declaration
    groups_before, groups_after = before.get("config_groups") or {}, after.get("config_groups") or {}
    changed_groups = {g for g in set(groups_before) | set(groups_after) if groups_before.get(g) != groups_after.get(g)}
    entries: list[tuple[str, Grammar]] = []  # (entry, grammar) that one config has and the other has not
    for name_list in fmt.name_lists:
        if name_list.file != CONFIG:
            continue
        spots: dict[str, set[str]] = {}
        for config in (source, output):
            qc = quantization_config(config) or {}
            for where, holder, key in locations(qc, name_list.path.split("."), "quantization_config"):
                said = set(_entries(holder[key]))
                spots[where] = spots[where] ^ said if where in spots else said
                group = where.split(".")[2] if where.startswith("quantization_config.config_groups.") else None
                if group in changed_groups:  # a group whose settings changed: each module it targets
                    entries += [(e, name_list.grammar) for e in said]
        entries += [(e, name_list.grammar) for spot in spots.values() for e in spot]
    by_grammar: dict[Grammar, list[str]] = {}
    for entry, grammar in dict.fromkeys(entries):
        if grammar == "exact-or-re" and entry[:1].isupper() and "." not in entry and not entry.startswith("re:"):
            if entry == "Linear":  # a compressed-tensors class name: every FP4 module read here is a Linear
                return modules[0]
            continue
        by_grammar.setdefault(grammar, []).append(entry)
    for grammar, listed in by_grammar.items():
        named = name_matcher(listed, grammar)
        found = next((m for m in modules if named(m)), None)
        if found is not None:
            return found
    return None


def _without_lists(config: dict[str, Any], fmt: FormatSpec) -> dict[str, Any]:
    """quantization_config without its module-name lists, and config.json's `expert_dtype` (DeepSeek-V4's)."""
    qc = copy.deepcopy(quantization_config(config) or {})
    for name_list in fmt.name_lists:
        if name_list.file == CONFIG:
            for _, holder, key in locations(qc, name_list.path.split("."), "quantization_config"):
                del holder[key]
    return {**qc, "__expert_dtype": config.get("expert_dtype")}


def _entries(value: Any) -> list[str]:
    return [e for e in value if isinstance(e, str)] if isinstance(value, list) else []

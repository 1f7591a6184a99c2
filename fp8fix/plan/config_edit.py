"""Rewriting config files: the module-name lists that a rename touches, and what a source config
says in compressed-tensors' terms when OUTPUT is written as compressed-tensors (`Scheme`).

When the unfused layout turns `...qkv_proj` into `...q_proj`, `...k_proj`, `...v_proj`,
a list that named the fused module must name its shards instead (vLLM checks every
shard of a fused layer against ignore lists). Formats match entries in different
grammars (`NameList.grammar`): exact names, compressed-tensors' exact-or-`re:`,
transformers' regex-prefix-or-suffix, ModelOpt's fnmatch wildcards. An entry naming the
fused module exactly is replaced by the shard names; a pattern that matched the fused
module but not all its shards gets the missing shard names added after it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8fix.io.checkpoint import CONFIG, read_json, side_config
from fp8fix.model import ignore_linears
from fp8fix.registry.formats import (
    FBGEMM,
    MODELOPT,
    QUARK,
    NameList,
    locations,
    matches,
    quantization_config,
)
from fp8fix.vocab import Grammar

__all__ = ["matches"]  # re-exported: name-list edits and their grammar are read from here

if TYPE_CHECKING:
    from fp8fix.model import CheckpointModel


def output_config(
    config: dict[str, Any],
    root: Path,
    name_lists: tuple[NameList, ...],
    renames: dict[str, list[str]],
    compressed_tensors: Scheme | None = None,
    channel: bool = False,
    unfused_config: dict[str, Any] | None = None,
    sizes: dict[str, int] | None = None,
    unquantized: list[str] | None = None,
    linears: list[str] | None = None,
    scale_fmt: str | None = None,
) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """The config files OUTPUT gets where they differ from SOURCE's: name lists following `renames`,
    and where modules were unfused, the config.json keys the registry entry says describe the layout
    (`unfused_config`: MiMo's `attention_projection_layout`), those config.json already has; then,
    with `compressed_tensors`, quantization_config written as compressed-tensors in that scheme; with
    `channel` (a compressed-tensors source), its weights' strategy made channel; with `sizes` (`--tp`
    padding), those config.json sizes set; with `unquantized` (`--tp-bf16`, `--dequantize`), those modules named in the
    format's lists of modules left unquantized.
    Convert writes these; verify expects them."""
    from fp8fix.plan.compressed_tensors import channel_strategy_config, compressed_tensors_config

    out = rewrite_name_lists(config, root, name_lists, renames)
    layout_keys = {k: v for k, v in (unfused_config or {}).items() if k in config and config[k] != v}
    if renames and layout_keys:
        content, edits = out.get(CONFIG, (config, []))
        content = {**content, **layout_keys}
        out[CONFIG] = (
            content,
            [*edits, *(f"{k}: {config[k]!r} -> {v!r} (modules unfused)" for k, v in layout_keys.items())],
        )
    changed = {k: v for k, v in (sizes or {}).items() if config.get(k) != v}
    if changed:
        content, edits = out.get(CONFIG, (config, []))
        why = "(MLPs zero-padded: whole blocks per tensor-parallel rank)"
        out[CONFIG] = (
            {**content, **changed},
            [*edits, *(f"{k}: {config[k]} -> {v} {why}" for k, v in changed.items())],
        )
    if unquantized:
        content, edits = out.get(CONFIG, (config, []))
        content, added = _leave_unquantized(content, name_lists, unquantized)
        if added:
            out[CONFIG] = (content, [*edits, *added])
    if compressed_tensors is not None:
        content, edits = out.get(CONFIG, (config, []))
        scheme = compressed_tensors
        edit = f"quant_method {scheme.source} -> compressed-tensors ({scheme.strategy} scales, same codes)"
        bound = (quantization_config(content) or {}).get("activation_scale_ub")
        if scheme.source == FBGEMM.name and bound is not None:
            edit += (
                f"; activation_scale_ub {bound} dropped: compressed-tensors' dynamic per-token activation scales "
                "have no upper bound (weights unchanged; activations of outlier tokens quantize at their own scale)"
            )
        out[CONFIG] = (compressed_tensors_config(content, scheme), [*edits, f"quantization_config: {edit}"])
    elif channel:
        content, edits = out.get(CONFIG, (config, []))
        rewritten, groups = channel_strategy_config(content)
        if groups:
            edit = f"quantization_config: {', '.join(groups)} weights strategy tensor -> channel (scales per row)"
            out[CONFIG] = (rewritten, [*edits, edit])
    if scale_fmt:  # `--scales ue8m0`: how the block scales are stored, as DeepSeek-V3.1 says it
        content, edits = out.get(CONFIG, (config, []))
        content = copy.deepcopy(content)
        qc = quantization_config(content)
        if qc is not None and qc.get("scale_fmt") != scale_fmt:
            edits = [*edits, f"quantization_config.scale_fmt: {qc.get('scale_fmt')!r} -> {scale_fmt!r}"]
            qc["scale_fmt"] = scale_fmt
            out[CONFIG] = (content, edits)
    if linears:
        content, edits = out.get(CONFIG, (config, []))
        content, added = ignore_linears(content, linears)
        if added:
            edit = (
                f"quantization_config.ignore: +{len(added)} Linear module(s) holding no FP8 weight "
                f"({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}): a `Linear` target would quantize them"
            )
            out[CONFIG] = (content, [*edits, edit])
    return out


def _leave_unquantized(
    config: dict[str, Any], name_lists: tuple[NameList, ...], modules: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """`config` with `modules` added to each list of modules left unquantized that loaders read
    (`NameList.unquantized`), where no entry names them already; one edit line per list."""
    content = copy.deepcopy(config)
    qc = quantization_config(content)
    edits: list[str] = []
    if qc is None:
        return config, edits
    for name_list in name_lists:
        if name_list.file != CONFIG or not name_list.unquantized or "." in name_list.path:
            continue
        entries = qc.get(name_list.path)
        if name_list.unquantized == "if-set" and not entries:
            continue
        entries = list(entries or [])
        new = [m for m in modules if not any(isinstance(e, str) and matches(e, m, name_list.grammar) for e in entries)]
        if new:
            qc[name_list.path] = entries + new
            edits.append(
                f"quantization_config.{name_list.path}: +{len(new)} module name(s) written in BF16, left unquantized"
            )
    return content, edits


def rewrite_name_lists(
    config: dict[str, Any], root: Path, name_lists: tuple[NameList, ...], renames: dict[str, list[str]]
) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Every config file whose name lists a rename touches: file -> (new content, one line per edit).

    config.json's lists live under its quantization_config; other files (ModelOpt's
    hf_quant_config.json) hold theirs from the top. Files nothing touches are absent.
    """
    out: dict[str, tuple[dict[str, Any], list[str]]] = {}
    if not renames:
        return out
    for file in sorted({n.file for n in name_lists}):
        lists = [n for n in name_lists if n.file == file]
        if file == CONFIG:
            content = copy.deepcopy(config)
            holder, label = quantization_config(content), "quantization_config"
        elif (root / file).is_file():
            content = read_json(root / file)
            holder, label = content, file
        else:
            continue
        edits = _rewrite(holder, lists, renames, label) if holder is not None else []
        if edits:
            out[file] = (content, edits)
    return out


def _rewrite(root: dict[str, Any], lists: list[NameList], renames: dict[str, list[str]], label: str) -> list[str]:
    edits = []
    for name_list in lists:
        for where, holder, key in _lists_at(root, name_list.path.split("."), label):
            entries = holder[key]
            rewritten = _rename_entries(entries, renames, name_list.grammar)
            if rewritten != entries:
                holder[key] = rewritten
                edits.append(f"{where}: {len(entries)} -> {len(rewritten)} entries (fused modules renamed)")
    return edits


def _lists_at(node: Any, parts: list[str], where: str) -> list[tuple[str, dict[str, Any], str]]:
    """(where, holder, key) for every list the dotted `parts` path reaches; '*' matches every key."""
    return [(w, holder, key) for w, holder, key in locations(node, parts, where) if isinstance(holder[key], list)]


def _rename_entries(entries: list[Any], renames: dict[str, list[str]], grammar: Grammar) -> list[Any]:
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, str) and entry in renames:
            out.extend(renames[entry])
            continue
        out.append(entry)
        if isinstance(entry, str):
            for fused, shards in renames.items():
                if matches(entry, fused, grammar):
                    out.extend(s for s in shards if not matches(entry, s, grammar))
    return list(dict.fromkeys(out)) if all(isinstance(e, str) for e in out) else out


@dataclass(frozen=True)
class Scheme:
    """What compressed-tensors' one config group says of a per-tensor FP8 checkpoint written as it."""

    strategy: str  # of the weight scales: tensor or channel
    dynamic_input: bool
    ignore: tuple[str, ...]  # compressed-tensors entries: exact names or `re:` patterns
    kv_scales: bool
    source: str  # the source format's quant_method, for the config edit line


def source_scheme(model: CheckpointModel) -> tuple[bool, tuple[str, ...]] | None:
    """(dynamic input activations, `ignore`) of an AutoFP8, Quark, ModelOpt or FBGEMM checkpoint, from its
    config; None where its config says what one compressed-tensors group cannot (Quark per-layer
    overrides, output or kv-cache quantization without the kv scales fp8fix renames, `modules_to_not_convert`).
    Worked out once per description: `--target` asks it for every compressed-tensors candidate, and its
    name lists are matched against every tensor name (112k of them in a 7,500-layer Phi-3)."""
    found: tuple[bool, tuple[str, ...]] | None = model.once("source_scheme", _source_scheme)
    return found


def _source_scheme(model: CheckpointModel) -> tuple[bool, tuple[str, ...]] | None:
    fmt = model.format
    qc = quantization_config(model.checkpoint.config) or {}
    if fmt is None:
        return None
    if model.is_autofp8:
        if qc.get("modules_to_not_convert"):
            return None  # transformers' prefix-or-suffix matching has no exact compressed-tensors form
        ignore = named_modules(model, qc.get("ignored_layers"), "exact")
        return qc.get("activation_scheme", "static") != "static", ignore
    if fmt.name == QUARK.name:
        config = qc.get("global_quant_config") or {}
        inputs = config.get("input_tensors")
        export = qc.get("export") or {}
        if qc.get("layer_quant_config") or qc.get("layer_type_quant_config") or export.get("kv_cache_group"):
            return None
        if config.get("output_tensors") or not isinstance(inputs, dict):
            return None  # weight-only FP8 has no compressed-tensors float-quantized W8A8 form here
        if inputs.get("dtype") != "fp8_e4m3" or inputs.get("qscheme") != "per_tensor":
            return None
        return bool(inputs.get("is_dynamic")), named_modules(model, qc.get("exclude"), "exact-or-re")
    if fmt.name == MODELOPT.name:
        quantization = (side_config(model.checkpoint.root) or {}).get("quantization") or {}
        entries = [*(quantization.get("exclude_modules") or []), *(qc.get("ignore") or [])]
        return False, named_modules(model, [*entries, *(qc.get("exclude_modules") or [])], "fnmatch")
    if fmt.name == FBGEMM.name:
        # per-row weight scales, activations quantized per token at run time: compressed-tensors' channel
        # weights with dynamic token activations (the activation scale's upper bound, activation_scale_ub,
        # has no compressed-tensors form: the conversion notes it); its skip list as transformers matches it
        return True, named_modules(model, qc.get("modules_to_not_convert"), "transformers")
    return None


def named_modules(model: CheckpointModel, entries: Any, grammar: Grammar) -> tuple[str, ...]:
    """The modules of the checkpoint that a name list's `entries` name, as the source's loader matches
    them (`grammar`), by exact name: a list is carried into another format by what it means, never as
    text (an AutoFP8 `ignored_layers` entry `re:.*proj` names nothing in vLLM, which compares exactly;
    copied into compressed-tensors' `ignore` it would be a pattern naming every projection)."""
    texts = [e for e in entries or [] if isinstance(e, str)]
    if not texts:
        return ()
    modules = [n.removesuffix(".weight") for n, t in model.checkpoint.tensors.items() if _linear_weight(n, t.shape)]
    return tuple(m for m in dict.fromkeys(modules) if any(matches(e, m, grammar) for e in texts))


def _linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A module weight a name list can mean: a matrix (or stacked experts), not a norm's vector."""
    return name.endswith(".weight") and len(shape) >= 2


def can_write(model: CheckpointModel) -> bool:
    """An AutoFP8, Quark, ModelOpt or FBGEMM checkpoint whose config one compressed-tensors group can say
    (`source_scheme`) and whose weight scales are all per tensor or per channel (or per shard, which
    a layout may make per tensor or per row)."""
    return bool(model.once("can_write_compressed_tensors", _can_write))  # once per description, as `source_scheme`


def _can_write(model: CheckpointModel) -> bool:
    kinds = {w.scale_kind for w in model.weights.values() if w.is_module_weight}
    return bool(kinds) and kinds <= {"tensor", "channel", "shard"} and source_scheme(model) is not None


def scheme_of(model: CheckpointModel, strategy: str) -> Scheme:
    """The compressed-tensors scheme of `model` written with `strategy` weight scales (`can_write` first)."""
    found = source_scheme(model)
    assert found is not None and model.format is not None, "can_write(model) first"
    dynamic, ignore = found
    return Scheme(strategy, dynamic, ignore, bool(model.kv_cache_scales), model.format.name)

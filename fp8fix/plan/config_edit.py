"""Rewriting config files: the module-name lists that a rename touches, and quantization_config written as
compressed-tensors in a `Scheme` (`plan.scheme`) when OUTPUT is.

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
from pathlib import Path
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.checkpoint import CONFIG, read_json
from fp8fix.model import ignore_linears
from fp8fix.plan.compressed_tensors import channel_strategy_config, compressed_tensors_config
from fp8fix.plan.scheme import Scheme
from fp8fix.registry.formats import FBGEMM, NameList, locations, matches, quantization_config
from fp8fix.vocab import Grammar

__all__ = ["matches"]  # re-exported: name-list edits and their grammar are read from here


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
        if name_list.keyed:
            _refuse_keyed_renames(root, name_list, renames, label)
            continue
        for where, holder, key in _lists_at(root, name_list.path.split("."), label):
            entries = holder[key]
            rewritten = _rename_entries(entries, renames, name_list.grammar)
            if rewritten != entries:
                holder[key] = rewritten
                edits.append(f"{where}: {len(entries)} -> {len(rewritten)} entries (fused modules renamed)")
    return edits


def _refuse_keyed_renames(root: dict[str, Any], name_list: NameList, renames: dict[str, list[str]], label: str) -> None:
    """A dict keyed by module names (Quark's `layer_quant_config`) whose key names a module the conversion
    renames: its settings would silently stop applying (the loader falls back to the global ones), and a key
    pattern has no faithful rewrite for the new names. Refused, naming the key and the ways out."""
    for where, holder, key in locations(root, name_list.path.split("."), label):
        settings = holder[key]
        for entry in settings if isinstance(settings, dict) else ():
            fused = next((f for f in renames if matches(entry, f, name_list.grammar)), None)
            if fused is not None:
                raise UnsupportedCheckpoint(
                    f"config.json: {where} sets {entry!r:.80}, which names the fused module '{fused}'; the unfused "
                    f"layout renames it to {', '.join(renames[fused])}, and fp8fix does not rewrite these per-layer "
                    "settings (the loader would fall back to the global ones): use --layout per-shard or --layout "
                    "fused, which keep the fused names"
                )


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

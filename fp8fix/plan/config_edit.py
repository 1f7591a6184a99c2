"""Rewriting config files: only the module-name lists that a rename touches.

When the unfused layout turns `...qkv_proj` into `...q_proj`, `...k_proj`, `...v_proj`,
a list that named the fused module must name its shards instead (vLLM checks every
shard of a fused layer against ignore lists). Formats match entries in different
grammars (`NameList.grammar`): exact names, compressed-tensors' exact-or-`re:`,
transformers' substrings, Quark's and ModelOpt's fnmatch wildcards. An entry naming the
fused module exactly is replaced by the shard names; a pattern that matched the fused
module but not all its shards gets the missing shard names added after it.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from pathlib import Path
from typing import Any

from fp8fix.io.checkpoint import CONFIG, read_json
from fp8fix.registry.formats import NameList, locations, quantization_config
from fp8fix.vocab import Grammar


def matches(entry: str, name: str, grammar: Grammar) -> bool:
    if grammar == "exact":
        return entry == name
    if grammar == "exact-or-re":
        return entry == name or (entry.startswith("re:") and re.match(entry[3:], name) is not None)
    if grammar == "substring":
        return entry in name
    if grammar == "fnmatch":
        return fnmatch.fnmatchcase(name, entry)
    raise ValueError(f"unknown name-list grammar {grammar!r}")


def output_config(
    config: dict[str, Any],
    root: Path,
    name_lists: tuple[NameList, ...],
    renames: dict[str, list[str]],
    compressed_tensors: tuple[str, bool] | None = None,
    channel: bool = False,
) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """The config files OUTPUT gets where they differ from SOURCE's: name lists following `renames`,
    then, with `compressed_tensors` = (strategy, has kv-cache scales), quantization_config written
    as compressed-tensors; with `channel` (a compressed-tensors source), its weights' strategy made
    channel. Convert writes these; verify expects them."""
    from fp8fix.plan.compressed_tensors import channel_strategy_config, compressed_tensors_config

    out = rewrite_name_lists(config, root, name_lists, renames)
    if compressed_tensors is not None:
        content, edits = out.get(CONFIG, (config, []))
        strategy, kv = compressed_tensors
        edits = [*edits, f"quantization_config: quant_method fp8 -> compressed-tensors ({strategy} scales, same bytes)"]
        out[CONFIG] = (compressed_tensors_config(content, strategy, kv), edits)
    elif channel:
        content, edits = out.get(CONFIG, (config, []))
        rewritten, groups = channel_strategy_config(content)
        if groups:
            edit = f"quantization_config: {', '.join(groups)} weights strategy tensor -> channel (scales per row)"
            out[CONFIG] = (rewritten, [*edits, edit])
    return out


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

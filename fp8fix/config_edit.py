"""Rewriting config.json: only the quantization_config name lists that a rename touches.

When the unfused layout turns `...qkv_proj` into `...q_proj`, `...k_proj`, `...v_proj`,
an ignore list that named the fused module must name its shards instead (vLLM checks
every shard of a fused layer against it). Entries are exact module names or, in
compressed-tensors, `re:` patterns matched from the start of the name.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from fp8fix.registry.formats import quantization_config


def rewrite_config(
    config: dict[str, Any], name_lists: tuple[str, ...], renames: dict[str, list[str]]
) -> tuple[dict[str, Any] | None, list[str]]:
    """The new config (None when nothing changes) and one line per edit made."""
    if not renames:
        return None, []
    new = copy.deepcopy(config)
    qc = quantization_config(new)
    edits: list[str] = []
    if qc is None:
        return None, []
    for path in name_lists:
        for where, holder, key in _lists_at(qc, path.split("."), "quantization_config"):
            entries = holder[key]
            rewritten = _rename_entries(entries, renames)
            if rewritten != entries:
                holder[key] = rewritten
                edits.append(f"{where}: {len(entries)} -> {len(rewritten)} entries (fused modules renamed)")
    return (new if edits else None), edits


def _lists_at(node: Any, parts: list[str], where: str) -> list[tuple[str, dict[str, Any], str]]:
    """(where, holder, key) for every list the dotted `parts` path reaches; '*' matches every key."""
    if not isinstance(node, dict) or not parts:
        return []
    head, rest = parts[0], parts[1:]
    keys = list(node) if head == "*" else [head] if head in node else []
    found = []
    for key in keys:
        if rest:
            found += _lists_at(node[key], rest, f"{where}.{key}")
        elif isinstance(node[key], list):
            found.append((f"{where}.{key}", node, key))
    return found


def _rename_entries(entries: list[Any], renames: dict[str, list[str]]) -> list[Any]:
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, str) and entry in renames:
            out.extend(renames[entry])
        elif isinstance(entry, str) and entry.startswith("re:"):
            out.append(entry)
            pattern = re.compile(entry[3:])
            for fused, shards in renames.items():
                if pattern.match(fused):
                    out.extend(s for s in shards if not pattern.match(s))
        else:
            out.append(entry)
    return list(dict.fromkeys(out)) if all(isinstance(e, str) for e in out) else out

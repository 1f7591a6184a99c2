"""`--dequantize PATTERN`: which FP8 modules a user keeps in BF16, and the names the config lists get.

Patterns are shell-style (`fnmatch`) on whole module names. A module vLLM packs into one layer with
others (q with k and v, gate with up) takes them along: vLLM quantizes a layer whole or not at all and
refuses a mix. A fused module is listed by its own name and its shards' names: vLLM 0.32 matches either,
older releases only the shards' (`quant_utils.is_layer_skipped`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from fp8fix.errors import UnsupportedCheckpoint, UsageError
from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel
from fp8fix.registry.parallel import packed_siblings

#: Longest `--dequantize` pattern: module names are a few hundred characters.
MAX_PATTERN_CHARS = 1000


@dataclass
class Selection:
    """The modules `--dequantize` writes in BF16, the names the config's lists get, and what to tell."""

    modules: list[str]  # FP8 modules, in checkpoint order
    listed: list[str]  # for the lists of modules left unquantized: each module, and a fused one's shard names
    notes: list[str] = field(default_factory=list)


def select_modules(model: CheckpointModel, patterns: tuple[str, ...]) -> Selection:
    """The FP8 modules the shell-style `patterns` name (fnmatch, on whole module names), with the modules
    vLLM packs into one layer with them (q with k and v: a layer is quantized whole or not at all)."""
    fmt = model.require_format()
    if not any(n.unquantized and n.file == CONFIG for n in fmt.name_lists):
        raise UnsupportedCheckpoint(
            f"--dequantize: {fmt.label} checkpoints have no config.json list of modules left unquantized that "
            "fp8fix writes yet; --to bf16 writes the whole model unquantized"
        )
    weights = model.module_weights()
    chosen: set[str] = set()
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise UsageError(f"--dequantize: a pattern of {len(pattern)} characters is not a module name")
        matched = {w.module for w in weights if fnmatch.fnmatchcase(w.module, pattern)}
        if not matched:
            example = weights[0].module if weights else "model.layers.0.self_attn.q_proj"
            raise UsageError(
                f"--dequantize {pattern!r}: names no FP8 module of this checkpoint (patterns are shell-style and "
                f"match whole module names, e.g. '{example}' or '*.self_attn.*')"
            )
        chosen |= matched
    by_module = {w.module: w for w in weights}
    experts = sorted(m for m in chosen if by_module[m].stacked or ".experts." in m)
    if experts:
        raise UnsupportedCheckpoint(
            f"--dequantize: '{experts[0]}' is a routed expert: runtimes quantize a layer's experts as one MoE layer, "
            "so some experts cannot be left unquantized; leave experts out of the patterns (or --to bf16)"
        )
    added = {s for m in chosen for s in packed_siblings(m) if s in by_module} - chosen
    modules = [w.module for w in weights if w.module in chosen | added]
    if len(modules) == len(weights):  # nothing left quantized: a plain model, without a config to list them in
        raise UsageError(
            f"--dequantize: the patterns name every FP8 module of this checkpoint ({len(modules)}); that is a plain "
            "BF16 model: use --to bf16 (it drops the quantization config; --dequantize keeps some modules in FP8)"
        )
    notes = []
    if added:
        notes.append(
            f"--dequantize: {len(added)} module(s) added ({', '.join(sorted(added)[:3])}): vLLM packs them into "
            "one layer with modules the patterns name, and a layer is quantized whole or not at all"
        )
    listed = []
    for m in modules:
        fused = by_module[m].fused
        listed.append(m)
        if fused is not None and fused.spec.can_unfuse:  # vLLM checks a fused layer's shards by their names
            listed += [fused.spec.unfused_path(m, s) for s in fused.spec.shards]
    return Selection(modules, list(dict.fromkeys(listed)), notes)

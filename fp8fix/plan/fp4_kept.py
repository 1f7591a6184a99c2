"""FP4 modules through an FP8 conversion: copied byte for byte and declared in OUTPUT's config as in SOURCE's.

A mixed checkpoint (compressed-tensors `mixed-precision`: FP8 groups beside NVFP4 / MXFP4 ones) has its FP8 parts
converted as any FP8 checkpoint's (layouts, `--tp`, `--scales`, encodings, `--dequantize`); its FP4 modules are no
input of those rewrites. Each is checked here once the conversion is planned, whatever planned it: every tensor of
the module written under its own name as SOURCE's bytes, and the config groups that declare it (those whose
targets match it, by compressed-tensors' own matching, and whether `ignore` names it) unchanged. A conversion that
would move, rewrite or re-declare one (a layout unfusing a fused FP4 module, a config written in another format)
is refused before anything is written, rather than writing FP4 bytes under a declaration that reads them wrongly.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.fp4_modules import Fp4Weight
from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel
from fp8fix.plan.pieces import ConversionPlan, OutputTensor
from fp8fix.plan.planner import kept_as_is
from fp8fix.registry.formats import COMPRESSED_TENSORS, FormatSpec, locations, matches, quantization_config
from fp8fix.vocab import ConvertTo

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
    if plan.padding is not None and plan.padding.config:
        sizes = ", ".join(f"{k} {v}" for k, v in plan.padding.config.items())
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: --tp padding would make config.json say {sizes}, which FP4 module "
            f"'{next(iter(model.fp4))}' (not padded: FP4 modules pass through as they are) would contradict; {_WHOLE}"
        )
    fmt = model.require_format()
    side = sorted(f for f in plan.config_files if f != CONFIG)
    if side:  # (ModelOpt's hf_quant_config.json: where its FP4 modules may be declared)
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: this conversion would rewrite {side[0]}, which declares FP4 module "
            f"'{next(iter(model.fp4))}' too; FP4 modules pass through FP8 conversions only declared as in SOURCE; "
            f"{_WHOLE}"
        )
    if fmt.layers and plan.renames:  # ModelOpt MIXED_PRECISION: `quantized_layers` names modules as SOURCE does
        fused = next(iter(plan.renames))
        raise UnsupportedCheckpoint(
            f"{model.checkpoint.root.name}: unfusing '{fused}' would leave the ModelOpt config's quantized_layers "
            f"naming it, not its shards (a loader then leaves them unquantized); keep the layout (--layout fused); "
            f"{_WHOLE}"
        )
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
        if output_config is not source_config and declaration(source_config, w, fmt) != declaration(
            output_config, w, fmt
        ):
            raise UnsupportedCheckpoint(
                f"{model.checkpoint.root.name}: this conversion would change how config.json declares FP4 module "
                f"'{w.module}' ({(w.scheme or 'fp4').upper()}: the config groups that target it, or `ignore`); FP4 "
                f"modules pass through FP8 conversions only declared as in SOURCE; {_WHOLE}"
            )


def declaration(config: dict[str, Any], w: Fp4Weight, fmt: FormatSpec) -> str:
    """What `config` says of FP4 module `w`, as text to compare: for compressed-tensors, every config group whose
    targets match it (a class name such as `Linear` matches every Linear; `re:` patterns and exact names by
    compressed-tensors' matching) and whether `ignore` names it; for another format (DeepSeek-V4), its
    quantization_config but the module-name lists, which of those lists name it (each by its loader's matching),
    and config.json's `expert_dtype`."""
    qc = quantization_config(config) or {}
    if qc.get("quant_method") != COMPRESSED_TENSORS.name:
        said = copy.deepcopy(qc)
        named = []
        for name_list in fmt.name_lists:
            for where, holder, key in locations(said, name_list.path.split("."), "quantization_config"):
                if any(matches(entry, w.module, name_list.grammar) for entry in _entries(holder[key])):
                    named.append(where)
                del holder[key]  # (a list convert creates, `--dequantize`'s, is no change of this module's)
        return json.dumps({"config": said, "named": named, "expert_dtype": config.get("expert_dtype")}, sort_keys=True)
    groups = qc.get("config_groups")
    matched = {
        str(name): group
        for name, group in (groups.items() if isinstance(groups, dict) else ())
        if isinstance(group, dict) and any(_targets(entry, w.module) for entry in _entries(group.get("targets")))
    }
    ignored = any(_targets(entry, w.module) for entry in _entries(qc.get("ignore")))
    return json.dumps({"groups": matched, "ignored": ignored, "format": qc.get("format")}, sort_keys=True)


def _entries(value: Any) -> list[str]:
    return [e for e in value if isinstance(e, str)] if isinstance(value, list) else []


def _targets(entry: str, module: str) -> bool:
    """A compressed-tensors target or ignore entry names Linear `module`: a class name (no dot, capitalised: the
    module's class, Linear for every FP4 module read here), or an exact name or `re:` pattern."""
    if entry[:1].isupper() and "." not in entry and not entry.startswith("re:"):
        return entry == "Linear"
    return matches(entry, module, "exact-or-re")

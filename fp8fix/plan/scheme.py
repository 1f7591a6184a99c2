"""What a source config says in compressed-tensors' terms, for OUTPUT written as compressed-tensors (`Scheme`):
worked out from SOURCE's description (its format, name lists and scales), below both the compressed-tensors
config writer and the config rewriting that uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8fix.io.checkpoint import side_config
from fp8fix.model import CheckpointModel
from fp8fix.registry.formats import FBGEMM, MODELOPT, QUARK, matches, quantization_config
from fp8fix.vocab import Grammar


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
    found: set[str] = set()
    for entry in texts:  # entry by entry: each pattern compiled once, however long the list
        found.update(m for m in modules if m not in found and matches(entry, m, grammar))
    return tuple(m for m in dict.fromkeys(modules) if m in found)


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
    if model.fp4:  # one FP8 group says nothing of FP4 modules (their groups are kept with the format kept)
        return False
    return bool(kinds) and kinds <= {"tensor", "channel", "shard"} and source_scheme(model) is not None


def scheme_of(model: CheckpointModel, strategy: str) -> Scheme:
    """The compressed-tensors scheme of `model` written with `strategy` weight scales (`can_write` first)."""
    found = source_scheme(model)
    assert found is not None and model.format is not None, "can_write(model) first"
    dynamic, ignore = found
    return Scheme(strategy, dynamic, ignore, bool(model.kv_cache_scales), model.format.name)

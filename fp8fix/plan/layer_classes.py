"""One layer of each kind: the checkpoint `--target` judges its candidates on.

A checkpoint of 100k tensors is a few hundred tensors repeated once per layer. Every fact the
candidates are judged by (the loader verdicts, which layouts and formats the planner accepts,
whether a conversion leaves fused modules as they are, whether shard scales end up requantized) is
decided per module from its tensors' names, dtypes and shapes, config.json, the rows config.json gives
fused modules, and whether (and how) the values of its scales differ. Two layers that agree on all of
these are judged alike, so the candidates are planned on the tensors outside the layers plus the first
layer of each class (a Phi-3 of 112k tensors: 84), and only the chosen candidate on the whole checkpoint.

A layer's class is every such fact, read off the layer itself: its tensors' names (less the layer
number), dtypes and shapes; its fused modules' rows and storage order; and, for its small scales (at
most `SMALL_SCALE` values each: per-tensor and per-shard ones), which values equal which across the
layer and their order within each scale. Where a config file could name a layer by a pattern
(`re:` entries, globs) the classes cannot be trusted and nothing is reduced; a layer whose number a
config string holds (an `ignore` entry naming `model.layers.6.mlp`) is a class of its own.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from fp8fix.errors import Fp8fixError
from fp8fix.io.checkpoint import Checkpoint, first_invalid_scale, scale_values, side_config
from fp8fix.io.safetensors_file import SafetensorsHeader, TensorInfo
from fp8fix.io.source_files import SourceFiles
from fp8fix.model import CheckpointModel, describe_checkpoint

#: A layer: the first dotted component that is a number (`model.layers.12.mlp...`).
LAYER = re.compile(r"\.(\d{1,18})\.")
#: Scales of at most this many values are told apart by value; a fused module's larger scale
#: (per-row, per-block) means no reduction: the requantization it may need depends on every value.
SMALL_SCALE = 64
#: Reduce only where the classes keep at most this share of the tensors: otherwise planning the
#: reduced checkpoint and then the chosen candidate whole costs more than planning every candidate whole.
MOST_KEPT = 0.5
#: Strings of config files walked for layer numbers and patterns; more, and nothing is reduced.
MOST_CONFIG_ITEMS = 100_000
_PATTERN = re.compile(r"^re:|[*?\[]")
_DIGITS = re.compile(r"\d{1,18}")
#: Keys whose values are release numbers (`transformers_version`, Quark's `version`, ModelOpt's producer
#: `version`): "0.13" names no layer 13, and would make layers 0 and 13 classes of their own in every checkpoint.
_VERSION_KEY = re.compile(r"(?:^|_)version$")

Layer = tuple[str, str]  # (the names' prefix before the number, the number as written)


def representatives(model: CheckpointModel) -> CheckpointModel | None:
    """`model` reduced to the tensors outside its layers and the first layer of each class; None where
    it cannot be reduced faithfully (headers only, a config pattern that may name layers, a large fused
    scale, a scale no weight can be recovered from) or where reducing saves little."""
    ckpt = model.checkpoint
    if not ckpt.has_data:
        return None
    named = _config_numbers(ckpt)
    if named is None:
        return None
    layers: dict[Layer, list[TensorInfo]] = {}
    kept: set[str] = set()  # the tensors outside the layers, then the first layer of each class
    for t in ckpt.tensors.values():
        at = _layer_of(t.name)
        if at is None:
            kept.add(t.name)
        else:
            layers.setdefault(at, []).append(t)
    if len(layers) < 2:
        return None
    patterns = _value_patterns(model, layers)
    if patterns is None:
        return None
    fused = _fused_facts(model)
    first: dict[tuple[Any, ...], Layer] = {}
    for layer, tensors in layers.items():
        prefix, number = layer
        names = tuple(sorted((_in_layer(t.name, layer), t.dtype, t.shape) for t in tensors))
        own = number if str(int(number)) in named else None  # a layer a config string may name
        key = (prefix, len(number), own, names, fused.get(layer), patterns[layer])
        first.setdefault(key, layer)
    kept.update(t.name for layer in first.values() for t in layers[layer])
    if len(kept) > MOST_KEPT * len(ckpt.tensors):
        return None
    return describe_checkpoint(_subset(ckpt, kept), model.registry)


def _layer_of(name: str) -> Layer | None:
    m = LAYER.search(name)
    return None if m is None else (name[: m.start()], m.group(1))


def _in_layer(name: str, layer: Layer) -> str:
    """`name` less its layer's prefix and number: what layers of one class share."""
    return name[len(layer[0]) + len(layer[1]) + 2 :]


def _config_numbers(ckpt: Checkpoint) -> set[str] | None:
    """Every number config.json and hf_quant_config.json hold in a string (key or value; not a release number
    under a `version` key), without leading zeros; None where a string holding a number is also a pattern (it
    may match layers by number) or the files hold more strings than `MOST_CONFIG_ITEMS`."""
    try:
        documents: list[Any] = [ckpt.config, side_config(ckpt.root)]
    except Fp8fixError:
        return None
    numbers: set[str] = set()
    stack = documents
    seen = 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > MOST_CONFIG_ITEMS:
            return None
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(v for k, v in item.items() if not _VERSION_KEY.search(str(k)))
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            found = _DIGITS.findall(item)
            if found and _PATTERN.search(item):
                return None
            numbers.update(str(int(n)) for n in found)
    return numbers


def _value_patterns(model: CheckpointModel, layers: dict[Layer, list[TensorInfo]]) -> dict[Layer, Any] | None:
    """Per layer: its small scales' values as a pattern (each value's label by first appearance across the
    layer, and each scale's order of its values); None where a fused module's scale is larger than
    `SMALL_SCALE` or a small scale holds a value no weight can be recovered from."""
    small: set[str] = {t.name for t in model.kv_cache_scales if t.numel <= SMALL_SCALE}
    for w in model.weights.values():
        for s in (w.scale, w.input_scale):
            if s is None:
                continue
            if s.numel <= SMALL_SCALE:
                small.add(s.name)
            elif w.fused is not None or w.n_shards > 1:
                return None
    wanted = [t for tensors in layers.values() for t in tensors if t.name in small]
    values: dict[str, list[float]] = {}
    try:
        with SourceFiles() as files:
            for scale, read in scale_values(wanted, files):
                if first_invalid_scale(read) is not None:
                    return None
                values[scale.name] = read
    except (OSError, Fp8fixError):
        return None
    patterns: dict[Layer, Any] = {}
    for layer, tensors in layers.items():
        labels: dict[float, int] = {}
        pattern = []
        for t in sorted((t for t in tensors if t.name in values), key=lambda t: _in_layer(t.name, layer)):
            v = values[t.name]
            order = tuple(sorted(range(len(v)), key=v.__getitem__))
            pattern.append((tuple(labels.setdefault(x, len(labels)) for x in v), order))
        patterns[layer] = tuple(pattern)
    return patterns


def _fused_facts(model: CheckpointModel) -> dict[Layer, Any]:
    """Per layer: its fused modules' rows and storage order and its stacked experts' sizes (config.json
    may size each layer's on its own)."""
    facts: dict[Layer, list[Any]] = {}
    for module in model.fused.values():
        layer = _layer_of(module.path + ".")
        if layer is not None:
            facts.setdefault(layer, []).append((_in_layer(module.path, layer), module.rows, module.segments))
    for w in model.weights.values():
        layer = _layer_of(w.tensor.name)
        if layer is not None and w.experts is not None:
            x = w.experts
            facts.setdefault(layer, []).append((_in_layer(w.tensor.name, layer), x.count, x.param, x.shards, x.widths))
    return {layer: tuple(sorted(map(repr, f))) for layer, f in facts.items()}


def _subset(ckpt: Checkpoint, names: set[str]) -> Checkpoint:
    """`ckpt` holding only the tensors `names`: its shards' headers and the index filtered (shards left
    with no tensor kept, so every file keeps its name)."""
    shards = {
        file: SafetensorsHeader(h.path, h.metadata, {n: t for n, t in h.tensors.items() if n in names})
        for file, h in ckpt.shards.items()
    }
    index = ckpt.index
    if index is not None and isinstance(index.get("weight_map"), dict):
        index = {**index, "weight_map": {n: f for n, f in index["weight_map"].items() if n in names}}
    tensors = {n: t for n, t in ckpt.tensors.items() if n in names}
    return replace(ckpt, index=index, shards=shards, tensors=tensors, warnings=list(ckpt.warnings))

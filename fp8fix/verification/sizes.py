"""config.json's sizes read against the weights: the sizes a model builds its layers from must be the
shapes of the tensors it then loads.

verify's other config check compares keys with SOURCE's; this one reads what they mean. A model
builds `nn.Embedding(vocab_size, hidden_size)`, MLPs of `intermediate_size` (MoE experts of
`moe_intermediate_size`), attention of `num_attention_heads` / `num_key_value_heads` heads of
`head_dim` (else hidden_size / heads), `num_hidden_layers` layers; a weight of another shape is a
load error ("size mismatch") or, where a loader slices, wrong weights. Worked out here from
HF's config names and tensor names alone (no registry, no plan), so a `--tp` padding that
changed a size and not its weights, or the reverse, is caught whichever code made it.

Only where SOURCE agrees: a size SOURCE's own config.json and tensors disagree on (a gated
q_proj, MLA attention, DeepSeek's extra MTP layer) is a convention these rules do not know,
not something the conversion did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fp8fix.io.checkpoint import Checkpoint

_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")
_EXPERT = re.compile(r"\.mlp\.experts\.\d{1,9}$")
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim")


def size_disagreements(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Each config.json size (by the key it is named after) that the tensors of `shapes` contradict: the
    first such tensor, as a line."""
    found: dict[str, str] = {}
    for key, name, axis, expected in _expectations(config, shapes):
        shape = shapes[name]
        if key not in found and len(shape) > axis and shape[axis] != expected:
            what = "rows" if axis == 0 else "columns"
            found[key] = (
                f"{key} (with the sizes beside it) gives '{name}' {expected} {what}; its shape is {list(shape)}"
            )
    count = _size(config, "num_hidden_layers")
    layers = [int(m.group(1)) for m in map(_LAYER.match, shapes) if m]
    if count and layers and max(layers) + 1 != count:
        found["num_hidden_layers"] = f"num_hidden_layers is {count}; the tensors hold layers 0 to {max(layers)}"
    return found


def check_sizes(out: Checkpoint, src: Checkpoint) -> list[str]:
    """The lines for sizes OUTPUT's config.json and tensors disagree on where SOURCE's agree."""
    source = size_disagreements(src.config, {n: t.shape for n, t in src.tensors.items()})
    output = size_disagreements(out.config, {n: t.shape for n, t in out.tensors.items()})
    return [
        f"config.json: {line}; SOURCE's config.json and tensors agree on it, so the conversion broke it"
        for key, line in output.items()
        if key not in source
    ]


def _size(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _expectations(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, str, int, int]]:
    """(key, tensor, axis, size) for every tensor whose shape a config.json size fixes."""
    hidden, vocab = _size(config, "hidden_size"), _size(config, "vocab_size")
    embedding = "model.embed_tokens.weight"
    if embedding in shapes:
        if vocab:
            yield "vocab_size", embedding, 0, vocab
        if hidden:
            yield "hidden_size", embedding, 1, hidden
    yield from _mlp(config, shapes)
    yield from _attention(config, shapes, hidden)


def _mlp(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, str, int, int]]:
    sizes = {key: _size(config, key) for key in ("intermediate_size", "moe_intermediate_size")}
    for name in shapes:
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        if not name.endswith(".weight") or not parent.startswith("model.layers."):
            continue
        key = "intermediate_size" if parent.endswith(".mlp") else "moe_intermediate_size"
        size = sizes[key]
        if size is None or (key == "moe_intermediate_size" and not _EXPERT.search(parent)):
            continue
        if leaf in ("gate_proj", "up_proj"):
            yield key, name, 0, size
        elif leaf == "down_proj":
            yield key, name, 1, size
        elif leaf == "gate_up_proj" and key == "intermediate_size":
            yield key, name, 0, 2 * size


#: The attention sizes are one rule: a fused source qkv_proj and the q / k / v it is split into are
#: checked under one key, so a convention the rule does not know (MiMo's own v_head_dim, a gated q) that
#: SOURCE's qkv_proj breaks is not blamed on the split.
ATTENTION = "num_attention_heads / num_key_value_heads x head_dim"


def _attention(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], hidden: int | None
) -> Iterator[tuple[str, str, int, int]]:
    heads = _size(config, "num_attention_heads")
    if heads is None or any(k in config for k in _MLA_KEYS):
        return
    kv = _size(config, "num_key_value_heads") or heads
    head_dim = _size(config, "head_dim") or (hidden // heads if hidden and hidden % heads == 0 else None)
    if head_dim is None:
        return
    rows = {"q_proj": heads, "k_proj": kv, "v_proj": kv, "qkv_proj": heads + 2 * kv}
    for name in shapes:
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        if not name.endswith(".weight") or not parent.startswith("model.layers.") or not parent.endswith(".self_attn"):
            continue
        if leaf in rows:
            yield ATTENTION, name, 0, rows[leaf] * head_dim
        elif leaf == "o_proj":
            yield ATTENTION, name, 1, heads * head_dim

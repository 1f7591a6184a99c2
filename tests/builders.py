"""Tiny but real FP8 checkpoints, written the way exporters write them.

Independent of fp8fix's own writer on purpose: tensors are quantized here with
torch and saved with `safetensors.torch.save_file`, the index and config.json are
written as AutoFP8 / llm-compressor write them. Tests read fp8fix's output back
with `safetensors.safe_open`. Also used by `scripts/make_example.py` and
`scripts/bench_convert.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class FusedModule:
    suffix: str  # e.g. "self_attn.qkv_proj"
    rows: list[int]  # rows of each shard
    in_features: int


@dataclass
class Model:
    """What to build: an architecture, its config, the per-layer modules."""

    architecture: str
    config: dict[str, Any]
    layer_prefix: str  # e.g. "model.layers.{i}."
    layers: int
    fused: list[FusedModule]
    plain: list[tuple[str, int, int]] = field(default_factory=list)  # (suffix, out, in)
    hidden: int = 64
    vocab: int = 256


def phi3(hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, layers: int = 2) -> Model:
    head_dim = hidden // heads
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
    }
    return Model(
        "Phi3ForCausalLM",
        config,
        "model.layers.{i}.",
        layers,
        fused=[
            FusedModule("self_attn.qkv_proj", [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], hidden),
            FusedModule("mlp.gate_up_proj", [intermediate, intermediate], hidden),
        ],
        plain=[("self_attn.o_proj", hidden, heads * head_dim), ("mlp.down_proj", hidden, intermediate)],
        hidden=hidden,
    )


def quantization_config(fmt: str, scale: str, static_input: bool, ignore: list[str]) -> dict[str, Any]:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static_input else "dynamic",
            "ignored_layers": ignore,
        }
    strategy = "channel" if scale == "channel" else "tensor"
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
    }
    if static_input:
        group["input_activations"] = {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "symmetric": True,
            "dynamic": False,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ignore,
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    }


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What exporters do: divide by the scale, clamp to the fp8 range, round to nearest even."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def scale_tensor(values: torch.Tensor, fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = torch.float32 if fmt == "fp8" else torch.bfloat16
    return values.to(dtype).reshape(shape)


def quantized_linear(
    gen: torch.Generator, rows: list[int], in_features: int, fmt: str, scale: str, magnitudes: list[float]
) -> dict[str, torch.Tensor]:
    """An FP8 weight and its weight_scale; `scale` is tensor, shard (per fused shard) or channel."""
    parts = [torch.randn(r, in_features, generator=gen) * m for r, m in zip(rows, magnitudes, strict=True)]
    w = torch.cat(parts)
    per_tensor_shape = () if fmt == "fp8" else (1,)
    if scale == "tensor":
        s = scale_tensor(w.abs().max() / FP8_MAX, fmt, per_tensor_shape)
        codes = quantize(w, s.float())
    elif scale == "shard":
        s = scale_tensor(torch.stack([p.abs().max() / FP8_MAX for p in parts]), fmt, (len(parts),))
        codes = torch.cat([quantize(p, s[i].float()) for i, p in enumerate(parts)])
    elif scale == "channel":
        s = scale_tensor(w.abs().amax(dim=1) / FP8_MAX, fmt, (w.shape[0], 1))
        codes = quantize(w, s.float())
    else:
        raise ValueError(scale)
    return {"weight": codes, "weight_scale": s}


def build(
    root: Path,
    model: Model,
    *,
    fmt: str = "fp8",
    scale: str = "tensor",
    static_input: bool = True,
    kv_scales: bool = True,
    bias: bool = False,
    files: int = 2,
    seed: int = 0,
    ignore: list[str] | None = None,
    scale_in_other_file: bool = True,
    extra_files: bool = True,
) -> Path:
    """Write `model` as an FP8 checkpoint into `root`; return `root`."""
    gen = torch.Generator().manual_seed(seed)
    per_tensor_shape = () if fmt == "fp8" else (1,)
    ignore = ["lm_head"] if ignore is None else ignore
    layers: list[dict[str, torch.Tensor]] = []
    for i in range(model.layers):
        prefix = model.layer_prefix.format(i=i)
        tensors: dict[str, torch.Tensor] = {}
        for f in model.fused:
            module = prefix + f.suffix
            magnitudes = [0.02 * (k + 1) for k in range(len(f.rows))]
            if module in ignore:
                tensors[module + ".weight"] = torch.randn(sum(f.rows), f.in_features, generator=gen).to(torch.bfloat16)
                continue
            for name, t in quantized_linear(gen, f.rows, f.in_features, fmt, scale, magnitudes).items():
                tensors[f"{module}.{name}"] = t
            if bias:
                tensors[module + ".bias"] = torch.randn(sum(f.rows), generator=gen).to(torch.bfloat16)
            if static_input:
                if scale == "shard":
                    values = torch.tensor([0.01 * (k + 1) for k in range(len(f.rows))])
                    tensors[module + ".input_scale"] = scale_tensor(values, fmt, (len(f.rows),))
                else:
                    tensors[module + ".input_scale"] = scale_tensor(torch.tensor(0.0125), fmt, per_tensor_shape)
        for suffix, out, inp in model.plain:
            plain_scale = "channel" if scale == "channel" else "tensor"
            for name, t in quantized_linear(gen, [out], inp, fmt, plain_scale, [0.05]).items():
                tensors[f"{prefix}{suffix}.{name}"] = t
            if static_input:
                tensors[f"{prefix}{suffix}.input_scale"] = scale_tensor(torch.tensor(0.02), fmt, per_tensor_shape)
        if kv_scales:
            for kv in ("k_scale", "v_scale"):
                tensors[f"{prefix}self_attn.{kv}"] = scale_tensor(torch.tensor(0.0625), fmt, per_tensor_shape)
        tensors[prefix + "input_layernorm.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
        layers.append(tensors)
    head = {"model.embed_tokens.weight": torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)}
    tail = {
        "model.norm.weight": torch.ones(model.hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16),
    }
    root.mkdir(parents=True, exist_ok=True)
    groups = _split(head, layers, tail, files)
    if scale_in_other_file and files > 1 and model.fused:
        # Exporters sometimes store a scale in another shard than its weight.
        moved = model.layer_prefix.format(i=model.layers - 1) + model.fused[0].suffix + ".weight_scale"
        if moved in groups[-1] and model.layer_prefix.format(i=model.layers - 1) + model.fused[0].suffix not in ignore:
            groups[0][moved] = groups[-1].pop(moved)
    config = dict(model.config)
    config["quantization_config"] = quantization_config(fmt, scale, static_input, ignore)
    write_files(root, groups, config)
    if extra_files:
        (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
        (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}) + "\n")
    return root


def _split(
    head: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]], tail: dict[str, torch.Tensor], files: int
) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    groups[0].update(head)
    for i, layer in enumerate(layers):
        groups[min(files - 1, i * files // max(1, len(layers)))].update(layer)
    groups[-1].update(tail)
    return groups


def shard_names(files: int) -> list[str]:
    if files == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]


def write_files(root: Path, groups: list[dict[str, torch.Tensor]], config: dict[str, Any]) -> None:
    names = shard_names(len(groups))
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in zip(names, groups, strict=True):
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")

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
    rows: list[int]  # rows of each shard, in total
    in_features: int
    groups: int = 1  # >1: stored per group (head / kv group), each group holding its share of every shard

    def segments(self) -> list[tuple[int, int]]:
        """(shard, rows) in storage order, as the architecture's documentation lays them out."""
        return [(i, r // self.groups) for _ in range(self.groups) for i, r in enumerate(self.rows)]


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


@dataclass(frozen=True)
class Format:
    """How one exporter names and shapes things (from the formats' own definitions, not fp8fix's registry)."""

    weight_scale: str = "weight_scale"
    scale_dtype: torch.dtype = torch.float32
    scalar_shape: tuple[int, ...] = ()
    input_scale: str | None = "input_scale"
    channel_shape: str = "2d"  # per-channel scale as [out, 1] ("2d") or [out] ("1d")
    block: tuple[int, int] | None = None
    kv: tuple[str, ...] = ("k_scale", "v_scale")


FORMATS = {
    "fp8": Format(),
    "fp8-legacy": Format(input_scale="act_scale", kv=("kv_scale",)),
    "compressed-tensors": Format(scale_dtype=torch.bfloat16, scalar_shape=(1,)),
    "block-fp8": Format(weight_scale="weight_scale_inv", input_scale=None, block=(32, 32), kv=()),
    "block-fp8-e8m0": Format(
        weight_scale="weight_scale_inv", scale_dtype=torch.float8_e8m0fnu, input_scale=None, block=(32, 32), kv=()
    ),
    # Qwen3 FP8 as published: BF16 block scales (some releases F16)
    "block-fp8-bf16": Format(
        weight_scale="weight_scale_inv", scale_dtype=torch.bfloat16, input_scale=None, block=(32, 32), kv=()
    ),
    "ct-block": Format(scale_dtype=torch.bfloat16, scalar_shape=(1,), input_scale=None, block=(32, 32)),
    "quark": Format(channel_shape="1d", kv=()),
    "modelopt": Format(),
    "fbgemm": Format(input_scale=None, kv=()),
}


def quantization_config(fmt: str, scale: str, static_input: bool, ignore: list[str]) -> dict[str, Any] | None:
    """quantization_config as each exporter writes it (ModelOpt writes hf_quant_config.json instead)."""
    spec = FORMATS[fmt]
    if fmt in ("fp8", "fp8-legacy"):
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static_input else "dynamic",
            "ignored_layers": ignore,
        }
    if fmt.startswith("block-fp8"):
        assert spec.block
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(spec.block),
            "modules_to_not_convert": ignore,
        }
    if fmt == "quark":
        qscheme = "per_channel" if scale == "channel" else "per_tensor"
        weight = {
            "dtype": "fp8_e4m3",
            "qscheme": qscheme,
            "is_dynamic": False,
            "ch_axis": 0 if scale == "channel" else None,
        }
        config: dict[str, Any] = {"weight": weight, "input_tensors": None, "output_tensors": None}
        if static_input:
            config["input_tensors"] = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
        return {
            "quant_method": "quark",
            "export": {"kv_cache_group": []},
            "global_quant_config": config,
            "exclude": ignore,
        }
    if fmt == "modelopt":
        return None
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ignore}
    strategy = "block" if spec.block else "channel" if scale == "channel" else "tensor"
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
    }
    if spec.block:
        weights["block_structure"] = f"{spec.block[0]}x{spec.block[1]}"
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if static_input and spec.input_scale:
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
    dtype = FORMATS[fmt].scale_dtype
    if dtype == torch.float8_e8m0fnu:  # a power of two: round the scale up so no code clips
        values = torch.exp2(torch.ceil(torch.log2(values)))
    return values.to(dtype).reshape(shape)


def input_scale(values: torch.Tensor, fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Activation and kv scales: the format's float dtype (never E8M0)."""
    dtype = FORMATS[fmt].scale_dtype
    return values.to(torch.float32 if dtype == torch.float8_e8m0fnu else dtype).reshape(shape)


def quantized_linear(
    gen: torch.Generator,
    rows: list[int],
    in_features: int,
    fmt: str,
    scale: str,
    magnitudes: list[float],
    segments: list[tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """An FP8 weight and its weight scale; `scale` is tensor, shard (per fused shard), channel or block.

    `segments` gives the storage order as (shard, rows) runs; by default one run per shard.
    """
    spec = FORMATS[fmt]
    segments = segments or list(enumerate(rows))
    parts = [torch.randn(n, in_features, generator=gen) * magnitudes[i] for i, n in segments]
    w = torch.cat(parts)
    if scale == "shard":
        shard_max = [
            max(p.abs().max() for (i, _), p in zip(segments, parts, strict=True) if i == k) for k in range(len(rows))
        ]
        s = scale_tensor(torch.stack(shard_max) / FP8_MAX, fmt, (len(rows),))
        codes = torch.cat([quantize(p, s[i].float()) for (i, _), p in zip(segments, parts, strict=True)])
        return {"weight": codes, spec.weight_scale: s}
    if spec.block:
        scale = "block"
    if scale == "tensor":
        s = scale_tensor(w.abs().max() / FP8_MAX, fmt, spec.scalar_shape)
        codes = quantize(w, s.float())
    elif scale == "channel":
        shape = (w.shape[0], 1) if spec.channel_shape == "2d" else (w.shape[0],)
        s = scale_tensor(w.abs().amax(dim=1) / FP8_MAX, fmt, shape)
        codes = quantize(w, s.float().reshape(-1, 1))
    elif scale == "block":
        assert spec.block
        b0, b1 = spec.block
        grid = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[: w.shape[0], : w.shape[1]] = w.abs()
        absmax = padded.reshape(grid[0], b0, grid[1], b1).amax(dim=(1, 3)).clamp(min=1e-8)
        s = scale_tensor(absmax / FP8_MAX, fmt, grid)
        per_element = s.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: w.shape[0], : w.shape[1]]
        codes = quantize(w, per_element)
    else:
        raise ValueError(scale)
    return {"weight": codes, spec.weight_scale: s}


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
    spec = FORMATS[fmt]
    per_tensor_shape = spec.scalar_shape
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
            for name, t in quantized_linear(gen, f.rows, f.in_features, fmt, scale, magnitudes, f.segments()).items():
                tensors[f"{module}.{name}"] = t
            if bias:
                tensors[module + ".bias"] = torch.randn(sum(f.rows), generator=gen).to(torch.bfloat16)
            if static_input and spec.input_scale:
                if scale == "shard":
                    values = torch.tensor([0.01 * (k + 1) for k in range(len(f.rows))])
                    tensors[f"{module}.{spec.input_scale}"] = input_scale(values, fmt, (len(f.rows),))
                else:
                    tensors[f"{module}.{spec.input_scale}"] = input_scale(torch.tensor(0.0125), fmt, per_tensor_shape)
        for suffix, out, inp in model.plain:
            plain_scale = "channel" if scale == "channel" else "tensor"
            for name, t in quantized_linear(gen, [out], inp, fmt, plain_scale, [0.05]).items():
                tensors[f"{prefix}{suffix}.{name}"] = t
            if static_input and spec.input_scale:
                tensors[f"{prefix}{suffix}.{spec.input_scale}"] = input_scale(torch.tensor(0.02), fmt, per_tensor_shape)
        if kv_scales:
            for kv in spec.kv:
                tensors[f"{prefix}self_attn.{kv}"] = input_scale(torch.tensor(0.0625), fmt, per_tensor_shape)
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
    qc = quantization_config(fmt, scale, static_input, ignore)
    if qc is not None:
        config["quantization_config"] = qc
    else:  # ModelOpt
        modelopt = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ignore}
        (root / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": modelopt})
        )
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

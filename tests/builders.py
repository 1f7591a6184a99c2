"""Tiny but real FP8 checkpoints, written the way exporters write them.

Independent of fp8fix's own writer on purpose: tensors are quantized here with
torch and saved with `safetensors.torch.save_file`, the index and config.json are
written as AutoFP8 / llm-compressor write them. Tests read fp8fix's output back
with `safetensors.safe_open`. Also used by `scripts/make_example.py` and
`scripts/bench_convert.py`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from scripts.bench_tensor_count import deepseek_v4_config

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


def loadable(model: Model) -> Model:
    """`model` with no pad / bos / eos token ids in its config: transformers' config classes default them to ids
    beyond these tiny vocabularies (Phi-3's pad_token_id 32000), which its embeddings refuse."""
    model.config.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return model


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


def _dense_config(
    architecture: str,
    model_type: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    layers: int,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "vocab_size": 256,
        **extra,
        "torch_dtype": "bfloat16",
    }


def _attention(hidden: int, heads: int, kv_heads: int) -> list[tuple[str, int, int]]:
    """q / k / v / o apart on disk: (suffix, out, in)."""
    head_dim = hidden // heads
    return [
        ("self_attn.q_proj", heads * head_dim, hidden),
        ("self_attn.k_proj", kv_heads * head_dim, hidden),
        ("self_attn.v_proj", kv_heads * head_dim, hidden),
        ("self_attn.o_proj", hidden, heads * head_dim),
    ]


def llama(hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, layers: int = 2) -> Model:
    """LlamaForCausalLM: q/k/v and gate/up apart on disk (most published FP8 models), which vLLM packs."""
    config = _dense_config(
        "LlamaForCausalLM", "llama", hidden, heads, kv_heads, intermediate, layers, tie_word_embeddings=False
    )
    mlp = [("mlp.gate_proj", intermediate, hidden), ("mlp.up_proj", intermediate, hidden)]
    plain = [*_attention(hidden, heads, kv_heads), *mlp, ("mlp.down_proj", hidden, intermediate)]
    return Model("LlamaForCausalLM", config, "model.layers.{i}.", layers, fused=[], plain=plain, hidden=hidden)


def glm(hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, layers: int = 2) -> Model:
    """GLM-4-0414's dense predecessor (transformers' GlmForCausalLM): q/k/v/o apart, gate_up_proj fused."""
    config = _dense_config("GlmForCausalLM", "glm", hidden, heads, kv_heads, intermediate, layers, attention_bias=False)
    plain = [*_attention(hidden, heads, kv_heads), ("mlp.down_proj", hidden, intermediate)]
    fused = [FusedModule("mlp.gate_up_proj", [intermediate, intermediate], hidden)]
    return Model("GlmForCausalLM", config, "model.layers.{i}.", layers, fused, plain=plain, hidden=hidden)


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
    weight_only: bool = False  # compressed-tensors block: no input_activations (W8A16), not FP8_BLOCK's


FORMATS = {
    "fp8": Format(),
    "fp8-legacy": Format(input_scale="act_scale", kv=("kv_scale",)),
    # AMD's quant_method fp8 exports with kv-cache scales (amd/Llama-3.1-8B-Instruct-FP8-KV)
    "fp8-amd-kv": Format(kv=("k_proj.output_scale", "v_proj.output_scale")),
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
    "ct-block-w8a16": Format(
        scale_dtype=torch.bfloat16, scalar_shape=(1,), input_scale=None, block=(32, 32), weight_only=True
    ),
    "quark": Format(channel_shape="1d", kv=()),
    "modelopt": Format(),
    "fbgemm": Format(input_scale=None, kv=()),
}


def quantization_config(fmt: str, scale: str, static_input: bool, ignore: list[str]) -> dict[str, Any] | None:
    """quantization_config as each exporter writes it (ModelOpt writes hf_quant_config.json instead)."""
    spec = FORMATS[fmt]
    if fmt in ("fp8", "fp8-legacy", "fp8-amd-kv"):
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static_input else "dynamic",
            "ignored_layers": ignore,
            **({"kv_cache_scheme": "static"} if fmt == "fp8-amd-kv" else {}),
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
        return _quark_config(scale, static_input, ignore)
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
    if spec.block and not spec.weight_only:  # llm-compressor's FP8_BLOCK: activations per group of a block's width
        group["input_activations"] = {
            "num_bits": 8,
            "type": "float",
            "strategy": "group",
            "group_size": spec.block[1],
            "symmetric": True,
            "dynamic": True,
        }
    elif spec.input_scale:  # static per tensor, or llm-compressor's FP8_DYNAMIC (per token, at run time)
        group["input_activations"] = {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor" if static_input else "token",
            "symmetric": True,
            "dynamic": not static_input,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ignore,
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    }


def _quark_spec(qscheme: str, ch_axis: int | None, observer: str, dynamic: bool) -> dict[str, Any]:
    """One Quark QuantizationSpec as amd-quark's exporter writes it (every field; amd-quark's own reader,
    which transformers uses, requires them)."""
    return {
        "dtype": "fp8_e4m3",
        "is_dynamic": dynamic,
        "qscheme": qscheme,
        "ch_axis": ch_axis,
        "group_size": None,
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "scale_format": None,
        "scale_calculation_mode": None,
        "mx_element_dtype": None,
        "observer_cls": observer,
        "is_scale_quant": False,
    }


def _quark_config(scale: str, static_input: bool, ignore: list[str]) -> dict[str, Any]:
    """quantization_config as amd-quark 0.x exports FP8 (amd/Llama-3.1-8B-Instruct-FP8-KV's layout)."""
    if scale == "channel":
        weight = _quark_spec("per_channel", 0, "PerChannelMinMaxObserver", dynamic=False)
    else:
        weight = _quark_spec("per_tensor", None, "PerTensorMinMaxObserver", dynamic=False)
    inputs = _quark_spec("per_tensor", None, "PerTensorMinMaxObserver", dynamic=False) if static_input else None
    return {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "version": "0.13",
        "algo_config": None,
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
        "global_quant_config": {
            "input_tensors": inputs,
            "output_tensors": None,
            "weight": weight,
            "bias": None,
            "target_device": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "softmax_quant_spec": None,
        "exclude": ignore,
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
    complete: bool = False,
) -> Path:
    """Write `model` as an FP8 checkpoint into `root`; return `root`. `complete`: every norm the model has
    (post_attention_layernorm too), as a loader of an unquantized model requires (vLLM checks that every
    parameter was loaded only when no quantization method is set: DefaultModelLoader.load_weights)."""
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
        if complete:
            tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
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


#: MiMo-V2.5-Pro's config.json, shrunk (issue 15): the keys and quantization_config of the published
#: release as vLLM 0.32's models/mimo_v2.py and llama.cpp's MiMo converter read them, with dimensions
#: cut down but the same structure: Q/K head_dim 192 and v_head_dim 128 (so K and V share blocks),
#: qkv_proj pre-sharded in num_key_value_heads chunks whose rows are not a whole number of 128-row
#: blocks (704 = 5.5 here, 3,392 = 26.5 in the Pro), a sliding-window layer with other kv heads (two per
#: chunk, a whole number of blocks: 1,024 = 8 here, 3,712 = 29 in V2.5) and an MTP layer with the
#: sliding-window dims. Dense MLPs (`moe_layer_freq` all 0) keep the real-loader test on vLLM's CPU build.
MIMO_BLOCK = (128, 128)


MIMO_CONFIG_CODE = """from transformers import PretrainedConfig


class MiMoV2Config(PretrainedConfig):
    model_type = "mimo_v2"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def mimo_v2_config(layers: int = 2) -> dict[str, Any]:
    return {
        "architectures": ["MiMoV2ForCausalLM"],
        "model_type": "mimo_v2",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 192,
        "v_head_dim": 128,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 192,
        "swa_v_head_dim": 128,
        "hybrid_layer_pattern": [i % 2 for i in range(layers)],
        "moe_layer_freq": [0] * layers,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_shared_experts": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": None,
        "attention_projection_layout": "fused_qkv",
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.707,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000,
        "swa_rope_theta": 10000,
        "sliding_window": 128,
        "sliding_window_size": 128,
        "layernorm_epsilon": 1e-05,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 4096,
        "vocab_size": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "auto_map": {"AutoConfig": "configuration_mimo_v2.MiMoV2Config"},
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(MIMO_BLOCK),
            "ignored_layers": [f"model.layers.{i}.self_attn.o_proj" for i in range(layers)]
            + ["model.mtp.layers.0.self_attn.o_proj"],
        },
    }


def mimo_qkv_chunks(config: dict[str, Any], swa: bool) -> tuple[int, list[int]]:
    """(chunks, [Q_c, K_c, V_c] rows of one chunk) of a layer's fused qkv_proj, as vLLM's
    `_shard_fp8_qkv_proj` computes them (chunks = config num_key_value_heads, for every layer)."""
    p = "swa_" if swa else ""
    chunks = config["num_key_value_heads"]
    heads, kv = config[f"{p}num_attention_heads"], config[f"{p}num_key_value_heads"]
    head_dim, v_head_dim = config[f"{p}head_dim"], config[f"{p}v_head_dim"]
    return chunks, [heads // chunks * head_dim, kv // chunks * head_dim, kv // chunks * v_head_dim]


def mimo_unfused_rows(config: dict[str, Any], swa: bool, shard: int) -> list[tuple[int, int]]:
    """(source row, source block-scale row) of each row of unfused shard `shard` (0 q, 1 k, 2 v), in
    head order: chunk c's rows of that shard, chunk after chunk (the index arithmetic of vLLM 0.32's
    `_shard_fp8_qkv_proj`, which gathers a rank's Q, K and V rows the same way)."""
    chunks, per_chunk = mimo_qkv_chunks(config, swa)
    chunk_rows = sum(per_chunk)
    grid_rows = -(-chunk_rows // MIMO_BLOCK[0])
    rows = []
    for c in range(chunks):
        for within in range(per_chunk[shard]):
            local = sum(per_chunk[:shard]) + within
            rows.append((c * chunk_rows + local, c * grid_rows + local // MIMO_BLOCK[0]))
    return rows


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes of `w` and their F32 128x128 block scales (absmax / 448), as DeepSeek-style exporters write."""
    b0, b1 = MIMO_BLOCK
    rows, cols = w.shape
    grid = (-(-rows // b0), -(-cols // b1))
    padded = torch.zeros(grid[0] * b0, grid[1] * b1)
    padded[:rows, :cols] = w.abs()
    s = (padded.reshape(grid[0], b0, grid[1], b1).amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-8)
    return quantize(w, s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]), s


def mimo_v2(root: Path, layers: int = 2, seed: int = 0) -> Path:
    """A MiMo-V2.5-Pro-shaped block-FP8 checkpoint (see `mimo_v2_config`): each chunk of every fused
    qkv_proj quantized with its own block grid of ceil(chunk rows / 128) rows, as the release is."""
    gen = torch.Generator().manual_seed(seed)
    config = mimo_v2_config(layers)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(config["vocab_size"], hidden, generator=gen).to(torch.bfloat16),
    }
    prefixes = [(f"model.layers.{i}.", config["hybrid_layer_pattern"][i] == 1) for i in range(layers)]
    for prefix, swa in [*prefixes, ("model.mtp.layers.0.", True)]:
        chunks, per_chunk = mimo_qkv_chunks(config, swa)
        codes, scales = [], []
        for c in range(chunks):  # chunk c: [Q_c | K_c | V_c], magnitudes differing per shard and chunk
            parts = [torch.randn(n, hidden, generator=gen) * 0.02 * (k + 1) * (c + 1) for k, n in enumerate(per_chunk)]
            w = torch.cat(parts)
            w[:, 0] *= 6  # larger values in one column block, so its scales differ from the other's
            chunk_codes, chunk_scales = block_quantize(w)
            codes.append(chunk_codes)
            scales.append(chunk_scales)
        heads = config["swa_num_attention_heads" if swa else "num_attention_heads"]
        v_dim = config["swa_v_head_dim" if swa else "v_head_dim"]
        tensors[prefix + "self_attn.qkv_proj.weight"] = torch.cat(codes)
        tensors[prefix + "self_attn.qkv_proj.weight_scale_inv"] = torch.cat(scales)
        tensors[prefix + "self_attn.o_proj.weight"] = (torch.randn(hidden, heads * v_dim, generator=gen) * 0.02).to(
            torch.bfloat16
        )
        if swa:
            tensors[prefix + "self_attn.attention_sink_bias"] = torch.randn(heads, generator=gen).to(torch.bfloat16)
        for name, rows, cols in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ):
            w, s = block_quantize(torch.randn(rows, cols, generator=gen) * 0.02)
            tensors[f"{prefix}mlp.{name}.weight"], tensors[f"{prefix}mlp.{name}.weight_scale_inv"] = w, s
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    root.mkdir(parents=True, exist_ok=True)
    # the release's own config class, which transformers lacks (loaded with trust_remote_code, as vLLM's
    # MiMo recipes serve it): a plain PretrainedConfig of model_type mimo_v2 here
    (root / "configuration_mimo_v2.py").write_text(MIMO_CONFIG_CODE)
    names = sorted(tensors)
    groups = [{n: tensors[n] for n in names[: len(names) // 2]}, {n: tensors[n] for n in names[len(names) // 2 :]}]
    write_files(root, groups, config)
    return root


def block_fp8_checkpoint(
    root: Path,
    config: dict[str, Any],
    linears: dict[str, tuple[int, int]],
    extra: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> Path:
    """A block-FP8 checkpoint as DeepSeek-style exporters write it: every module of `linears` (path ->
    [rows, cols]) an e4m3fn weight with F32 128x128 `weight_scale_inv`; BF16 embeddings, norms and
    lm_head, and `extra` tensors as given; `config` as given (its quantization_config included)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
    }
    for layer in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for module, (rows, cols) in linears.items():
        codes, scales = block_quantize(torch.randn(rows, cols, generator=gen) * 0.02)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = codes, scales
    tensors.update(extra or {})
    root.mkdir(parents=True)
    names = sorted(tensors)
    write_files(root, [{n: tensors[n] for n in names[::2]}, {n: tensors[n] for n in names[1::2]}], config)
    return root


def mlp_linears(prefix: str, intermediate: int, hidden: int) -> dict[str, tuple[int, int]]:
    return {
        f"{prefix}.gate_proj": (intermediate, hidden),
        f"{prefix}.up_proj": (intermediate, hidden),
        f"{prefix}.down_proj": (hidden, intermediate),
    }


def block_fp8_shards(root: Path, shards: int, shard_mib: int, hidden: int = 1024, random_codes: bool = False) -> Path:
    """A block-FP8 checkpoint of `shards` files of about `shard_mib` MiB, one layer's MLP each: real headers
    and scale grids (2^-8); the codes a hole (zeros: FP8 0.0, so gigabytes take no disk until copied), or
    random bytes but the NaN codes with `random_codes` (for timing)."""
    root.mkdir(parents=True)
    block = 128
    inter = (shard_mib * 2**20 // (3 * hidden)) // block * block
    weight_map: dict[str, str] = {}
    for layer in range(shards):
        name = f"model-{layer + 1:05d}-of-{shards:05d}.safetensors"
        header: dict[str, dict[str, object]] = {}
        offset = 0
        for module, (rows, cols) in {
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
        }.items():
            prefix = f"model.layers.{layer}.mlp.{module}"
            grid = [rows // block, cols // block]
            header[f"{prefix}.weight"] = {
                "dtype": "F8_E4M3",
                "shape": [rows, cols],
                "data_offsets": [offset, offset + rows * cols],
            }
            offset += rows * cols
            header[f"{prefix}.weight_scale_inv"] = {
                "dtype": "F32",
                "shape": grid,
                "data_offsets": [offset, offset + grid[0] * grid[1] * 4],
            }
            offset += grid[0] * grid[1] * 4
        weight_map.update({t: name for t in header})
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
            for t in header.values():
                begin, end = t["data_offsets"]  # type: ignore[misc]
                f.seek(8 + len(raw) + begin)
                if t["dtype"] == "F32":
                    f.write(struct.pack("<f", 2.0**-8) * ((end - begin) // 4))
                elif random_codes:
                    f.write(os.urandom(end - begin).replace(b"\x7f", b"\x01").replace(b"\xff", b"\x81"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": shards,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 1024,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


#: compressed-tensors' MXFP8 preset (compressed_tensors 0.20 quantization/quant_scheme.py MXFP8): E4M3 weights in
#: groups of 32 along the input dimension with E8M0 scales stored as uint8, activations quantized the same way
#: at run time; the checkpoint's format `mxfp8-quantized` (compressors/mxfp8: weight_scale U8 [out, in / 32]).
MXFP8_ARGS = {
    "num_bits": 8,
    "type": "float",
    "strategy": "group",
    "group_size": 32,
    "symmetric": True,
    "dynamic": False,
    "scale_dtype": "torch.uint8",
    "zp_dtype": "torch.uint8",
}


def mxfp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes of `w` [out, in] and their E8M0 bytes [out, in / 32]: each group's scale the power of two at
    or above amax / 448, as vLLM's and llm-compressor's MXFP8 quantizers choose it."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.ceil(torch.log2(amax / FP8_MAX)) + 127).clamp(0, 254)
    codes = (groups / torch.exp2(exponent - 127)[..., None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return codes, exponent.to(torch.uint8)


def mxfp8_compressed_tensors(root: Path, model: Model | None = None, seed: int = 0, files: int = 1) -> Path:
    """`model` (a Llama by default) as llm-compressor writes it with the MXFP8 preset: every linear layer but
    lm_head MXFP8, BF16 embeddings, norms and lm_head; in `files` shards, the tensors dealt out in name order
    (so a weight and its scale are mostly in different files)."""
    gen = torch.Generator().manual_seed(seed)
    model = model or llama()
    tensors: dict[str, torch.Tensor] = {}
    for i in range(model.layers):
        prefix = model.layer_prefix.format(i=i)
        linears = [(f.suffix, sum(f.rows), f.in_features) for f in model.fused] + list(model.plain)
        for suffix, out, inp in linears:
            codes, scales = mxfp8_quantize(torch.randn(out, inp, generator=gen) * 0.02)
            tensors[f"{prefix}{suffix}.weight"], tensors[f"{prefix}{suffix}.weight_scale"] = codes, scales
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    group = {
        "targets": ["Linear"],
        "weights": MXFP8_ARGS,
        "input_activations": {**MXFP8_ARGS, "dynamic": True},
        "format": "mxfp8-quantized",
    }
    config = {
        **model.config,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp8-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    write_files(root, [{n: tensors[n] for n in names[i::files]} for i in range(files)], config)
    return root


#: compressed-tensors' NVFP4 and MXFP4 presets (compressed_tensors 0.20 quantization/quant_scheme.py NVFP4, MXFP4):
#: 4-bit float weights, NVFP4 `tensor_group` in groups of 16 with e4m3 scales (and a global scale), MXFP4 `group`
#: in groups of 32 with E8M0 bytes as uint8; activations quantized the same way (NVFP4's with a static global scale).
NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
    "scale_dtype": "torch.float8_e4m3fn",
    "zp_dtype": "torch.float8_e4m3fn",
}
MXFP4_ARGS = {
    **NVFP4_ARGS,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "torch.uint8",
    "zp_dtype": "torch.uint8",
}
FP4_PRESETS = {
    "nvfp4": ("nvfp4-pack-quantized", NVFP4_ARGS, {**NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"}),
    "mxfp4": ("mxfp4-pack-quantized", MXFP4_ARGS, {**MXFP4_ARGS, "dynamic": True}),
}
#: E2M1's magnitudes by the low three bits of a nibble (OCP MX v1.0 section 5.3.3, table 5); bit 3 the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: llm-compressor's FP8_DYNAMIC preset: e4m3fn weights with a scale per row, activations per token at run time.
FP8_CHANNEL_ARGS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKEN_ARGS = {**FP8_CHANNEL_ARGS, "strategy": "token", "dynamic": True}


def e2m1_nibbles(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 nibble of each value (sign in bit 3), as compressed-tensors' pack_fp4_to_uint8 picks it."""
    magnitudes = torch.tensor(E2M1, dtype=x.dtype)
    index = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    return (index + torch.signbit(x).long() * 8).to(torch.uint8)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """[out, in] nibbles packed two a byte, the element at the even index in the low four bits."""
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def nvfp4_quantize(w: torch.Tensor, amax: float | None = None) -> dict[str, torch.Tensor]:
    """`w` [out, in] as compressed-tensors writes NVFP4: a global scale 448 x 6 / amax (`amax`: the largest
    magnitude of the modules sharing it, else `w`'s), each 16's e4m3 scale amax / 6 x global, elements
    x / (scale / global) to the nearest E2M1."""
    rows, cols = w.shape
    amax = float(w.abs().max()) if amax is None else amax
    global_scale = torch.tensor([FP8_MAX * 6.0 / amax], dtype=torch.float32)
    groups = w.reshape(rows, cols // 16, 16)
    scales = (groups.abs().amax(-1) / 6.0 * global_scale).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn)
    step = scales.to(torch.float64) / global_scale.to(torch.float64)
    nibbles = e2m1_nibbles((groups / step[..., None]).reshape(rows, cols))
    return {"weight_packed": pack_nibbles(nibbles), "weight_scale": scales, "weight_global_scale": global_scale}


def mxfp4_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """`w` [out, in] as MXFP4: each 32's E8M0 byte the power of two at or above amax / 6, elements to the nearest
    E2M1 at it."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-120)
    exponent = (torch.ceil(torch.log2(amax / 6.0)) + 127).clamp(0, 254)
    nibbles = e2m1_nibbles((groups / torch.exp2(exponent - 127)[..., None]).reshape(rows, cols))
    return {"weight_packed": pack_nibbles(nibbles), "weight_scale": exponent.to(torch.uint8)}


def _group_targets(suffixes: set[str], every: list[str]) -> list[str]:
    """`re:` targets naming `suffixes`: a whole parent (`re:.*self_attn[.].*`) where the group holds every linear
    layer under it (so a runtime's fused q / k / v layer matches too), else each suffix."""
    targets = []
    for parent in sorted({s.rpartition(".")[0] for s in suffixes}):
        under = {s for s in every if s.rpartition(".")[0] == parent}
        if under <= suffixes:
            targets.append(f"re:.*{parent.replace('.', '[.]')}[.].*")
        else:
            targets += [f"re:.*{s.replace('.', '[.]')}$" for s in sorted(under & suffixes)]
    return targets


#: The modules llm-compressor gives one NVFP4 global scale (update_fused_layer_weight_global_scales: "q,k,v layers
#: are treated as one tensor with the same global_scale and gate_proj/up_proj layers ... the same global scale",
#: as vLLM requires), by suffix.
SHARED_GLOBAL = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def draw_linears(
    model: Model, gen: torch.Generator, shared_global: bool
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One layer's linear weights [out, in] by suffix, drawn N(0, 0.02), and the amax each one's global scale is
    made from: its own, or (`shared_global`) the largest of its `SHARED_GLOBAL` group's."""
    linears = [(f.suffix, sum(f.rows), f.in_features) for f in model.fused] + list(model.plain)
    drawn = {suffix: torch.randn(out, inp, generator=gen) * 0.02 for suffix, out, inp in linears}
    amax = {suffix: float(w.abs().max()) for suffix, w in drawn.items()}
    for group in SHARED_GLOBAL if shared_global else ():
        shared = max((amax[s] for s in group if s in amax), default=0.0)
        amax.update({s: shared for s in group if s in amax})
    return drawn, amax


def fp4_compressed_tensors(
    root: Path,
    schemes: dict[str, str],
    model: Model | None = None,
    seed: int = 0,
    files: int = 1,
    shared_global: bool = True,
) -> Path:
    """`model` (a Llama by default) as llm-compressor writes FP4 and mixed checkpoints: each linear layer whose
    suffix (`self_attn.q_proj`) ends with a key of `schemes` in that scheme (nvfp4, mxfp4, fp8: FP8_DYNAMIC,
    e4m3fn with a scale per row, or fp8block: FP8_BLOCK, 128 x 128 blocks), the rest BF16 (embeddings, norms,
    lm_head; a linear no key names). One scheme: a group targeting `Linear` (lm_head ignored), `format` its own;
    several: a group per scheme targeting its suffixes (`re:`), `format: mixed-precision`. `shared_global`: NVFP4
    q / k / v and gate / up share one global scale (`SHARED_GLOBAL`), as llm-compressor writes them; else each its
    own, as other exporters do."""
    gen = torch.Generator().manual_seed(seed)
    model = model or llama()
    tensors: dict[str, torch.Tensor] = {}
    used: dict[str, set[str]] = {}
    for i in range(model.layers):
        prefix = model.layer_prefix.format(i=i)
        drawn, amax = draw_linears(model, gen, shared_global)
        for suffix, w in drawn.items():
            scheme = next((s for key, s in schemes.items() if suffix.endswith(key)), None)
            if scheme is None:
                tensors[f"{prefix}{suffix}.weight"] = w.to(torch.bfloat16)
                continue
            used.setdefault(scheme, set()).add(suffix)
            if scheme == "fp8":
                scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).to(torch.float32)
                quantized = {"weight": quantize(w, scale), "weight_scale": scale}
            elif scheme == "fp8block":
                codes, scale = block_quantize(w)
                quantized = {"weight": codes, "weight_scale": scale}
            else:
                quantized = nvfp4_quantize(w, amax[suffix]) if scheme == "nvfp4" else mxfp4_quantize(w)
                if scheme == "nvfp4":
                    quantized["input_global_scale"] = torch.tensor([FP8_MAX * 6.0 / 4.0], dtype=torch.float32)
            tensors.update({f"{prefix}{suffix}.{name}": t for name, t in quantized.items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    groups = {}
    for n, (scheme, suffixes) in enumerate(sorted(used.items())):
        fmt, weights, inputs = FP4_PRESETS.get(scheme, ("float-quantized", FP8_CHANNEL_ARGS, FP8_TOKEN_ARGS))
        if scheme == "fp8block":  # llm-compressor's FP8_BLOCK preset: 128 x 128 weight blocks, activations per group
            weights = {**FP8_CHANNEL_ARGS, "strategy": "block", "block_structure": list(MIMO_BLOCK)}
            inputs = {**FP8_TOKEN_ARGS, "strategy": "group", "group_size": MIMO_BLOCK[1]}
        targets = _group_targets(suffixes, list(drawn)) if len(used) > 1 else ["Linear"]
        group = {"targets": targets, "weights": weights, "format": fmt}
        groups[f"group_{n}"] = {**group, "input_activations": inputs}
    formats = {g["format"] for g in groups.values()}
    config = {
        **model.config,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": ["lm_head"],
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    write_files(root, [{n: tensors[n] for n in names[i::files]} for i in range(files)], config)
    return root


#: gpt-oss's MXFP4 expert tensors by name (transformers 5.24 quantizers/quantizer_mxfp4.py, vLLM 0.32
#: models/gpt_oss.py): `<proj>_blocks` U8 [experts, out, in / 32, 16] (two E2M1 a byte, the lower nibble first),
#: `<proj>_scales` U8 [experts, out, in / 32] (E8M0 bytes), `<proj>_bias` BF16 [experts, out].
GPT_OSS_PROJECTIONS = ("gate_up_proj", "down_proj")


def gpt_oss(
    root: Path,
    layers: int = 2,
    experts: int = 4,
    hidden: int = 64,
    intermediate: int = 64,
    seed: int = 0,
    files: int = 1,
) -> Path:
    """A tiny gpt-oss as OpenAI publishes it (openai/gpt-oss-20b's config.json and tensor names): attention,
    router, embeddings and norms in BF16, each layer's experts in MXFP4 (`GPT_OSS_PROJECTIONS`, quantized by
    `mxfp4_quantize`), `quantization_config` {quant_method: mxfp4, modules_to_not_convert: [...]}; in `files`
    safetensors files (tensors dealt round, so scales mostly lie apart from their blocks)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = 4, 2, 16
    tensors: dict[str, torch.Tensor] = {}

    def bf16(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    for i in range(layers):
        p = f"model.layers.{i}."
        for proj, out, inp in (
            ("q_proj", heads * head_dim, hidden),
            ("k_proj", kv_heads * head_dim, hidden),
            ("v_proj", kv_heads * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
        ):
            tensors[f"{p}self_attn.{proj}.weight"] = bf16(out, inp)
            tensors[f"{p}self_attn.{proj}.bias"] = bf16(out)
        tensors[f"{p}self_attn.sinks"] = bf16(heads, std=1.0)
        tensors[f"{p}mlp.router.weight"] = bf16(experts, hidden, std=0.5)
        tensors[f"{p}mlp.router.bias"] = bf16(experts)
        for proj, out, inp in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
            w = torch.randn(experts * out, inp, generator=gen) * 0.05
            quantized = mxfp4_quantize(w)
            blocks = quantized["weight_packed"].reshape(experts, out, inp // 32, 16)
            tensors[f"{p}mlp.experts.{proj}_blocks"] = blocks
            tensors[f"{p}mlp.experts.{proj}_scales"] = quantized["weight_scale"].reshape(experts, out, inp // 32)
            tensors[f"{p}mlp.experts.{proj}_bias"] = bf16(experts, out)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    vocab = 256
    tensors["model.embed_tokens.weight"] = bf16(vocab, hidden, std=1.0)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = bf16(vocab, hidden, std=1.0)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "vocab_size": vocab,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 1,
        "pad_token_id": 0,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    write_files(root, [{n: tensors[n] for n in names[i::files]} for i in range(files)], config)
    return root


def modelopt_nvfp4(root: Path, model: Model | None = None, seed: int = 0, shared_global: bool = True) -> Path:
    """`model` (a Llama by default) as NVIDIA ModelOpt exports NVFP4 (export_hf_checkpoint; the names vLLM 0.32
    modelopt.py ModelOptNvFp4Config reads): every linear layer but lm_head packed in its `weight` (U8 [out, in / 2],
    the lower nibble first), an e4m3 `weight_scale` per 16 (amax / 6 / scale_2), an F32 scalar `weight_scale_2`
    (amax / (6 x 448), multiplying them) and `input_scale`; elements x / (scale x scale_2) to the nearest E2M1.
    hf_quant_config.json says `quant_algo: NVFP4`, `group_size: 16`, lm_head excluded. `shared_global`: q / k / v
    and gate / up share one scale_2 (`SHARED_GLOBAL`, as ModelOpt's export unifies fused layers); else each its own."""
    return modelopt_mixed(root, {"proj": "nvfp4"}, model, seed, shared_global)


def modelopt_mixed(
    root: Path, schemes: dict[str, str], model: Model | None = None, seed: int = 0, shared_global: bool = True
) -> Path:
    """ModelOpt's export of `model` with each linear layer whose suffix ends with a key of `schemes` in that scheme:
    nvfp4 (`modelopt_nvfp4`'s tensors) or fp8 (per tensor: e4m3fn `weight`, F32 scalar `weight_scale` amax / 448 and
    `input_scale`), the rest BF16. One scheme: hf_quant_config.json says it (`quant_algo` NVFP4 or FP8); several:
    `quant_algo: MIXED_PRECISION` with `quantized_layers` naming each module's recipe, as ModelOpt writes it."""
    gen = torch.Generator().manual_seed(seed)
    model = model or llama()
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    for i in range(model.layers):
        prefix = model.layer_prefix.format(i=i)
        drawn, amax = draw_linears(model, gen, shared_global)
        for suffix, w in drawn.items():
            scheme = next((s for key, s in schemes.items() if suffix.endswith(key)), None)
            name = f"{prefix}{suffix}"
            if scheme == "fp8":
                scale = torch.tensor(float(w.abs().max()) / FP8_MAX, dtype=torch.float32)
                tensors[f"{name}.weight"] = quantize(w, scale)
                tensors[f"{name}.weight_scale"] = scale
                tensors[f"{name}.input_scale"] = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
                layers[name] = {"quant_algo": "FP8"}
                continue
            if scheme is None:
                tensors[f"{name}.weight"] = w.to(torch.bfloat16)
                continue
            rows, cols = w.shape
            scale_2 = torch.tensor(amax[suffix] / (6.0 * FP8_MAX), dtype=torch.float32)
            groups = w.reshape(rows, cols // 16, 16)
            scales = (groups.abs().amax(-1) / 6.0 / scale_2).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn)
            step = scales.to(torch.float64) * scale_2.to(torch.float64)
            nibbles = e2m1_nibbles((groups / step[..., None]).reshape(rows, cols))
            tensors[f"{name}.weight"] = pack_nibbles(nibbles)
            tensors[f"{name}.weight_scale"] = scales
            tensors[f"{name}.weight_scale_2"] = scale_2
            tensors[f"{name}.input_scale"] = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
            layers[name] = {"quant_algo": "NVFP4", "group_size": 16}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["model.embed_tokens.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(model.hidden, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(model.vocab, model.hidden, generator=gen).to(torch.bfloat16)
    root.mkdir(parents=True, exist_ok=True)
    write_files(root, [tensors], dict(model.config))
    algos = {recipe["quant_algo"] for recipe in layers.values()}
    quantization: dict[str, Any] = {"quant_algo": algos.pop() if len(algos) == 1 else "MIXED_PRECISION"}
    quantization |= {"kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    if quantization["quant_algo"] == "NVFP4":
        quantization["group_size"] = 16
    elif quantization["quant_algo"] == "MIXED_PRECISION":
        quantization["quantized_layers"] = layers
    producer = {"name": "modelopt", "version": "0.33.0"}
    (root / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quantization}))
    return root


def modelopt_mxfp8(root: Path, model: Model | None = None, side_file: bool = False) -> Path:
    """`model` (a Llama by default) as NVIDIA ModelOpt exports MXFP8: the MXFP8 tensors (e4m3fn `weight`, E8M0
    `weight_scale` U8 [out, in / 32]: `mxfp8_compressed_tensors`'s) under config.json's quantization_config
    {quant_method: modelopt, quant_algo: MXFP8}, or (`side_file`) hf_quant_config.json's `quantization` only."""
    mxfp8_compressed_tensors(root, model)
    config = json.loads((root / "config.json").read_text())
    quantization = {"quant_algo": "MXFP8", "ignore": ["lm_head"]}
    config["quantization_config"] = {"quant_method": "modelopt", **quantization}
    if side_file:
        del config["quantization_config"]
        side = {
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "MXFP8", "exclude_modules": ["lm_head"]},
        }
        (root / "hf_quant_config.json").write_text(json.dumps(side))
    (root / "config.json").write_text(json.dumps(config))
    return root


def deepseek_v4(
    root: Path,
    layers: int = 1,
    experts: int = 2,
    hidden: int = 256,
    seed: int = 0,
    expert_dtype: str = "fp4",
    files: int = 1,
) -> Path:
    """A DeepSeek-V4-shaped checkpoint as DeepSeek ships it (deepseek-ai/DeepSeek-V4-Flash: `model_type:
    deepseek_v4`, `expert_dtype: fp4`, quantization_config fp8 128 x 128 with `scale_fmt: ue8m0`): attention and
    shared experts e4m3fn with their block scales as `<module>.scale` F8_E8M0 (powers of two), routed experts
    `ffn.experts.E.wK.weight` packed E2M1 (I8, two a byte, the lower nibble first) with an F8_E8M0 `.scale` per 32,
    names without a `model.` prefix. `expert_dtype="fp8"` (V4-Flash-Base): the routed experts block FP8 too, and
    every `.scale` F32 (absmax / 448). `files`: the tensors dealt over that many shards in name order, so most
    scales sit in another shard than their weights."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {"embed.weight": torch.randn(64, hidden, generator=gen).to(torch.bfloat16)}

    def block_fp8(name: str) -> None:
        w = torch.randn(hidden, hidden, generator=gen) * 0.02
        scale = block_quantize(w)[1]
        if expert_dtype == "fp4":  # UE8M0: the power of two at or above absmax / 448
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        per = scale.repeat_interleave(MIMO_BLOCK[0], 0).repeat_interleave(MIMO_BLOCK[1], 1)
        tensors[f"{name}.weight"] = quantize(w, per[: w.shape[0], : w.shape[1]])
        tensors[f"{name}.scale"] = scale.to(torch.float8_e8m0fnu if expert_dtype == "fp4" else torch.float32)

    for i in range(layers):
        for module in ("attn.wq_a", "attn.wo_a", *(f"ffn.shared_experts.w{k}" for k in (1, 2, 3))):
            block_fp8(f"layers.{i}.{module}")
        for e in range(experts):
            for k in (1, 2, 3):
                name = f"layers.{i}.ffn.experts.{e}.w{k}"
                if expert_dtype != "fp4":
                    block_fp8(name)
                    continue
                packed = mxfp4_quantize(torch.randn(hidden, hidden, generator=gen) * 0.02)
                tensors[f"{name}.weight"] = packed["weight_packed"].view(torch.int8)
                tensors[f"{name}.scale"] = packed["weight_scale"].view(torch.float8_e8m0fnu)
        tensors[f"layers.{i}.ffn.gate.weight"] = torch.randn(experts, hidden, generator=gen).to(torch.bfloat16)
    config = deepseek_v4_config(layers, experts, hidden, expert_dtype)
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    write_files(root, [{n: tensors[n] for n in names[i::files]} for i in range(files)], config)
    return root

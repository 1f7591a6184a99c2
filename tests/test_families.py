"""Current FP8 families with nothing fused on disk (issue 15): shrunk copies convert and verify, and
the architecture policy: an architecture without a registry entry converts when none of its FP8
weights looks fused, and is refused, naming the tensor, when one does.

Shapes and formats follow ../shared/reference/fp8-checkpoints.md section 7 ("Real published configs
worth mirroring"): DeepSeek-V3/R1 is block FP8 (`quant_method: fp8`, `weight_block_size`,
`activation_scheme: dynamic`) with a `kv_a_proj_with_mqa` whose rows end inside a block (576 of
5 x 128 there; 36 of 2 x 32 here); GLM-4.5/4.6/4.7-FP8 (`Glm4MoeForCausalLM`) is
compressed-tensors with per-channel weight scales; Phi-3.5-MoE FP8 (`PhiMoEForCausalLM`) is
per-tensor `quant_method: fp8` with `block_sparse_moe.experts.N.w1/w2/w3`. Dimensions are shrunk.
`deepseek_r1` below goes further: DeepSeek-R1's published config.json verbatim (sizes shrunk), its
tensor names and 128x128 block grids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import Model, build, phi3
from tests.conftest import load_tensors, raw, run_cli

HIDDEN = 64


def family(architecture: str, plain: list[tuple[str, int, int]]) -> Model:
    config = {**phi3().config, "architectures": [architecture], "model_type": architecture.lower()}
    return Model(architecture, config, "model.layers.{i}.", 2, fused=[], plain=plain, hidden=HIDDEN)


DEEPSEEK_V3 = [
    ("self_attn.q_a_proj", 48, HIDDEN),
    ("self_attn.q_b_proj", 96, 48),
    ("self_attn.kv_a_proj_with_mqa", 36, HIDDEN),  # rows end inside a 32-row block, as 576 does in 128s
    ("self_attn.kv_b_proj", 128, 32),
    ("self_attn.o_proj", HIDDEN, 64),
    ("mlp.experts.0.gate_proj", 32, HIDDEN),
    ("mlp.experts.0.up_proj", 32, HIDDEN),
    ("mlp.experts.0.down_proj", HIDDEN, 32),
    ("mlp.shared_experts.gate_proj", 32, HIDDEN),
]
#: Llama-style attention, unfused: GLM-4 MoE and Phi-3.5-MoE store it so.
ATTENTION = [
    ("self_attn.q_proj", 64, HIDDEN),
    ("self_attn.k_proj", 32, HIDDEN),
    ("self_attn.v_proj", 32, HIDDEN),
    ("self_attn.o_proj", HIDDEN, 64),
]
GLM4_MOE = [
    *ATTENTION,
    ("mlp.experts.0.gate_proj", 32, HIDDEN),
    ("mlp.experts.0.up_proj", 32, HIDDEN),
    ("mlp.experts.0.down_proj", HIDDEN, 32),
]
PHI_MOE = [
    *ATTENTION,
    ("block_sparse_moe.experts.0.w1", 32, HIDDEN),
    ("block_sparse_moe.experts.0.w3", 32, HIDDEN),
    ("block_sparse_moe.experts.0.w2", HIDDEN, 32),
]
FAMILIES = {
    "DeepseekV3ForCausalLM": (DEEPSEEK_V3, {"fmt": "block-fp8", "scale": "block", "static_input": False}),
    "Glm4MoeForCausalLM": (GLM4_MOE, {"fmt": "compressed-tensors", "scale": "channel"}),
    "PhiMoEForCausalLM": (PHI_MOE, {"fmt": "fp8", "scale": "tensor"}),
}


@pytest.mark.parametrize("architecture", list(FAMILIES))
@pytest.mark.parametrize("options", [(), ("--to", "e4m3fnuz")])
def test_families_with_nothing_fused_convert_and_verify(tmp_path: Path, architecture: str, options: tuple) -> None:
    plain, build_options = FAMILIES[architecture]
    src = build(tmp_path / "src", family(architecture, plain), **build_options)  # type: ignore[arg-type]
    result = run_cli("convert", src, tmp_path / "out", "--json", "-q", *options)  # run_cli verifies it too
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["modules"] == [] and report["notes"] == []  # registered: no note about the architecture
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    weight = "model.layers.1.self_attn.o_proj.weight"
    if options:  # e4m3fnuz: -0 becomes 0, every scale of the weight doubles exactly
        codes = s[weight].view(torch.uint8)
        assert torch.equal(o[weight].view(torch.uint8), torch.where(codes == 0x80, 0, codes))
        scale = next(n for n in s if n.startswith(weight.removesuffix("weight")) and "weight_scale" in n)
        doubled = o[scale].float().reshape(-1)  # [] may become [1], or one per row (the channel layout)
        assert torch.equal(doubled, (s[scale].float().reshape(-1) * 2).expand_as(doubled))
    else:
        assert raw(o[weight]) == raw(s[weight])
    inspected = json.loads(run_cli("inspect", src, "--json").output)
    assert inspected["convert_supported"] and inspected["architecture_known"]


def test_an_unregistered_architecture_without_fused_names_converts_with_a_note(tmp_path: Path) -> None:
    src = build(tmp_path / "src", family("NewMoeForCausalLM", GLM4_MOE), fmt="fp8")
    result = run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz", "--json", "-q")
    assert result.exit_code == 0, result.output
    assert any("NewMoeForCausalLM has no registry entry" in n for n in json.loads(result.stdout)["notes"])
    inspected = json.loads(run_cli("inspect", src, "--json").output)
    assert inspected["convert_supported"] and not inspected["architecture_known"]
    assert any("has no registry entry" in n for n in inspected["notes"])


@pytest.mark.parametrize(
    "architecture, module",
    [
        ("NewForCausalLM", "self_attn.qkv_proj"),  # unregistered, a fused-looking FP8 weight
        ("NewForCausalLM", "attn.c_attn"),
        ("LlamaForCausalLM", "self_attn.qkv_proj"),  # registered without such a module
    ],
)
def test_a_fused_looking_weight_no_entry_describes_is_refused(tmp_path: Path, architecture: str, module: str) -> None:
    plain = [*GLM4_MOE[:1], (module, 128, HIDDEN)]
    src = build(tmp_path / "src", family(architecture, plain))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3
    assert f"'model.layers.0.{module}.weight' looks fused" in result.output and "--arch-file" in result.output
    assert not (tmp_path / "out").exists()
    inspected = json.loads(run_cli("inspect", src, "--json").output)
    assert not inspected["convert_supported"]
    assert any("looks fused" in n for n in inspected["notes"])


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Put `tensors` into the checkpoint's last shard, and into its index."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    content = load_file(folder / last)
    content.update(tensors)
    save_file(content, str(folder / last), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, last))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    index_path.write_text(json.dumps(index))


def test_amd_prob_output_scales_and_per_head_kv_scales_are_kv_cache_scales(tmp_path: Path) -> None:
    """AMD exports' `self_attn.prob_output_scale` and compressed-tensors' per-head kv scales
    ([heads, 1, 1]) are listed as kv-cache scales and kept, byte for byte, by every conversion."""
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors", kv_scales=False)
    extra = {
        "model.layers.0.self_attn.prob_output_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.k_scale": torch.rand(2, 1, 1, dtype=torch.float32) + 0.1,
        "model.layers.0.self_attn.v_scale": torch.rand(2, 1, 1, dtype=torch.float32) + 0.1,
    }
    add_tensors(src, extra)
    listed = {s["name"]: s["shape"] for s in json.loads(run_cli("inspect", src, "--json").output)["kv_cache_scales"]}
    assert listed == {name: list(t.shape) for name, t in extra.items()}
    assert run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz", "-q").exit_code == 0
    out = load_tensors(tmp_path / "out")
    assert all(raw(out[name]) == raw(t) and out[name].shape == t.shape for name, t in extra.items())


@pytest.mark.parametrize("options", [(), ("--to", "e4m3fnuz"), ("--layout", "unfused")])
def test_bf16_block_scales_as_qwen3_ships_them(tmp_path: Path, options: tuple) -> None:
    """Qwen3 FP8 checkpoints ship BF16 `weight_scale_inv` block grids: converted and verified, the scales
    kept in BF16 (doubled exactly for e4m3fnuz)."""
    src = build(tmp_path / "src", phi3(), fmt="block-fp8-bf16", scale="block", static_input=False)
    assert run_cli("convert", src, tmp_path / "out", "-q", *options).exit_code == 0  # run_cli verifies it
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert s[name].dtype == o[name].dtype == torch.bfloat16
    assert torch.equal(o[name], s[name] * (2 if "--to" in options else 1))


def qwen3_next() -> Model:
    """Qwen3-Next's linear-attention layers, shrunk: in_proj_qkvz / in_proj_ba interleaved per key-head
    group as vLLM 0.32's qwen_gdn_linear_attn.fix_query_key_value_ordering reads them."""
    from tests.builders import FusedModule

    model = family("Qwen3NextForCausalLM", [("linear_attn.out_proj", HIDDEN, 64), *GLM4_MOE[4:]])
    dims = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2}
    model.config.update(dims, linear_num_value_heads=4)
    per_group_v = 4 // 2 * 16
    model.fused = [
        FusedModule("linear_attn.in_proj_qkvz", [2 * 16, 2 * 16, 2 * per_group_v, 2 * per_group_v], HIDDEN, groups=2),
        FusedModule("linear_attn.in_proj_ba", [2 * 2, 2 * 2], HIDDEN, groups=2),
    ]
    return model


@pytest.mark.parametrize("options", [(), ("--to", "e4m3fnuz"), ("--layout", "per-shard")])
def test_qwen3_next_linear_attention_is_described(tmp_path: Path, options: tuple) -> None:
    """in_proj_qkvz / in_proj_ba are fused per key-head group; with their registry entry the checkpoint
    converts and verifies; per-shard scales land on the interleaved rows of each shard."""
    src = build(tmp_path / "src", qwen3_next(), scale="tensor")
    result = run_cli("convert", src, tmp_path / "out", "--json", "-q", *options)
    assert result.exit_code == 0, result.output
    modules = {m["module"]: m for m in json.loads(result.stdout)["modules"]}
    qkvz = modules["model.layers.0.linear_attn.in_proj_qkvz"]
    assert qkvz["shards"] == {"q": 32, "k": 32, "v": 64, "z": 64}
    if "per-shard" in options:
        out = load_tensors(tmp_path / "out")
        assert out["model.layers.0.linear_attn.in_proj_qkvz.weight_scale"].shape == (4,)


#: DeepSeek-R1's config.json as published (deepseek-ai/DeepSeek-R1, transformers_version 4.46.3), every
#: key and the quantization_config verbatim; only the sizes are shrunk below (DEEPSEEK_R1_SHRUNK).
DEEPSEEK_R1_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
#: Shrunk, keeping what matters to a converter: 128x128 blocks, kv_lora_rank + qk_rope_head_dim = 576
#: rows for kv_a_proj_with_mqa (4.5 blocks: a partial block row), one dense and one MoE layer.
DEEPSEEK_R1_SHRUNK = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "q_lora_rank": 192,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 2,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 256,
}


def deepseek_r1(root: Path) -> Path:
    """A DeepSeek-R1-shaped block-FP8 checkpoint: the published config (shrunk), its tensor names and
    F32 128x128 `weight_scale_inv` grids, BF16 norms, router, embeddings and lm_head."""
    from tests.builders import block_fp8_checkpoint, mlp_linears

    c = {**DEEPSEEK_R1_CONFIG, **DEEPSEEK_R1_SHRUNK}
    hidden, heads, qk = c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    linears: dict[str, tuple[int, int]] = {}
    extra: dict[str, torch.Tensor] = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        linears.update(
            {
                f"{p}self_attn.q_a_proj": (c["q_lora_rank"], hidden),
                f"{p}self_attn.q_b_proj": (heads * qk, c["q_lora_rank"]),
                f"{p}self_attn.kv_a_proj_with_mqa": (c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden),
                f"{p}self_attn.kv_b_proj": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                f"{p}self_attn.o_proj": (hidden, heads * c["v_head_dim"]),
            }
        )
        if layer < c["first_k_dense_replace"]:
            linears.update(mlp_linears(f"{p}mlp", c["intermediate_size"], hidden))
        else:
            for e in range(c["n_routed_experts"]):
                linears.update(mlp_linears(f"{p}mlp.experts.{e}", c["moe_intermediate_size"], hidden))
            linears.update(mlp_linears(f"{p}mlp.shared_experts", c["moe_intermediate_size"], hidden))
            extra[f"{p}mlp.gate.weight"] = torch.zeros(c["n_routed_experts"], hidden, dtype=torch.bfloat16)
            extra[f"{p}mlp.gate.e_score_correction_bias"] = torch.zeros(c["n_routed_experts"])
        extra[f"{p}self_attn.q_a_layernorm.weight"] = torch.ones(c["q_lora_rank"], dtype=torch.bfloat16)
        extra[f"{p}self_attn.kv_a_layernorm.weight"] = torch.ones(c["kv_lora_rank"], dtype=torch.bfloat16)
    return block_fp8_checkpoint(root, c, linears, extra=extra, seed=3)


@pytest.mark.parametrize("options", [(), ("--to", "e4m3fnuz")])
def test_deepseek_r1_as_published_converts_and_verifies(tmp_path: Path, options: tuple) -> None:
    src = deepseek_r1(tmp_path / "src")
    grid = load_tensors(src)["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert grid.shape == (5, 2)  # 576 rows: a partial block row, as in the release
    result = run_cli("convert", src, tmp_path / "out", "--json", "-q", *options)  # run_cli verifies it too
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["modules"] == []
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.1.mlp.experts.1.down_proj"):
        codes = s[f"{name}.weight"].view(torch.uint8)
        expected = torch.where(codes == 0x80, 0, codes) if options else codes
        assert torch.equal(o[f"{name}.weight"].view(torch.uint8), expected)
        factor = 2 if options else 1
        assert torch.equal(o[f"{name}.weight_scale_inv"], s[f"{name}.weight_scale_inv"] * factor)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    inspected = json.loads(run_cli("inspect", src, "--json").output)
    assert inspected["convert_supported"] and inspected["architecture_known"]
    assert {m["scale"] for m in inspected["modules"]} == {"block"}

"""`inspect --tp`: block-FP8 modules whose tensor-parallel share is not whole blocks (issue 17), on
shrunk copies of the reported cases, each keeping what matters: the split dimension divided by the
TP size is not a multiple of 128 where the real one is not, and is where the real one is.

- Qwen3-30B-A3B-FP8 at TP 4: routed experts' intermediate 768 -> 192 per rank (here 384 -> 96):
  vLLM 0.32 refines the MoE block grid (64x64 there, 32x32 here), Triton kernels only.
- DeepSeek-R1 at TP 32: dense MLP intermediate 18432 -> 576 per rank (here 4608 -> 144): the
  row-parallel down_proj is refused; MLA's q_b / kv_b / o projections split whole (128 heads).
- Qwen3.6-35B-A3B-FP8 at TP 8: shared expert 512 -> 64 per rank: its down_proj is refused.
tests/loaders/test_tensor_parallel.py calls vLLM's own validation functions with these shares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.builders import block_fp8_checkpoint, build, mlp_linears, phi3
from tests.conftest import run_cli
from tests.test_families import DEEPSEEK_R1_CONFIG

BLOCK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def qwen3_moe(
    root: Path, heads: int = 4, head_dim: int = 128, kv_heads: int = 1, experts: int = 4, moe_intermediate: int = 384
) -> Path:
    """Qwen3-30B-A3B-FP8's config keys, shrunk: 4 heads of 128 (o_proj splits whole at TP 4, as 32 x 128
    does at TP 8 and below); other head counts and sizes for attention that does not split whole."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": moe_intermediate,
        "num_experts": experts,
        "num_experts_per_tok": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-06,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
        "quantization_config": BLOCK_FP8,
    }
    p = "model.layers.0"
    linears = {
        f"{p}.self_attn.q_proj": (heads * head_dim, 256),
        f"{p}.self_attn.k_proj": (kv_heads * head_dim, 256),
        f"{p}.self_attn.v_proj": (kv_heads * head_dim, 256),
        f"{p}.self_attn.o_proj": (256, heads * head_dim),
    }
    for e in range(experts):
        linears.update(mlp_linears(f"{p}.mlp.experts.{e}", moe_intermediate, 256))
    extra = {
        f"{p}.mlp.gate.weight": torch.zeros(experts, 256, dtype=torch.bfloat16),  # the router, BF16
        f"{p}.self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
        f"{p}.self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
    }
    return block_fp8_checkpoint(root, config, linears, extra=extra)


def deepseek_dense(root: Path, intermediate: int = 4608) -> Path:
    """DeepSeek-R1's published config with sizes shrunk: one dense layer, 128 heads (4 per rank at TP 32,
    as in the release) of smaller dims, dense intermediate 32 x 144."""
    config = {
        **DEEPSEEK_R1_CONFIG,
        "hidden_size": 256,
        "intermediate_size": intermediate,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1,
        "vocab_size": 256,
    }
    linears = {**deepseek_attention("model.layers.0"), **mlp_linears("model.layers.0.mlp", intermediate, 256)}
    return block_fp8_checkpoint(root, config, linears)


def deepseek_attention(p: str) -> dict[str, tuple[int, int]]:
    """deepseek_dense's MLA attention linears of layer `p`: (rows, columns)."""
    return {
        f"{p}.self_attn.q_a_proj": (128, 256),
        f"{p}.self_attn.q_b_proj": (128 * 128, 128),
        f"{p}.self_attn.kv_a_proj_with_mqa": (128 + 64, 256),
        f"{p}.self_attn.kv_b_proj": (128 * 128, 128),
        f"{p}.self_attn.o_proj": (256, 128 * 64),
    }


def shared_expert(root: Path) -> Path:
    """A Qwen-MoE with a shared expert of 512 (Qwen3.6-35B-A3B-FP8's), shrunk elsewhere (Qwen2-MoE's
    layout, which vLLM's CPU build loads: BF16 attention in `ignored_layers`, 8 experts for TP 8)."""
    attention = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    config = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 8,
        "num_experts_per_tok": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-06,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
        "quantization_config": {**BLOCK_FP8, "ignored_layers": attention},
    }
    p = "model.layers.0.mlp"
    linears = {**mlp_linears(f"{p}.shared_expert", 512, 256)}
    for e in range(8):
        linears.update(mlp_linears(f"{p}.experts.{e}", 512, 256))
    extra = {f"{m}.weight": torch.randn(256, 256, dtype=torch.float32).mul(0.02).to(torch.bfloat16) for m in attention}
    extra.update({f"{m}.bias": torch.zeros(256, dtype=torch.bfloat16) for m in attention[:3]})
    extra[f"{p}.gate.weight"] = torch.zeros(8, 256, dtype=torch.bfloat16)
    extra[f"{p}.shared_expert_gate.weight"] = torch.zeros(1, 256, dtype=torch.bfloat16)
    return block_fp8_checkpoint(root, config, linears, extra=extra)


CASES = {"qwen3-moe": (qwen3_moe, 4), "deepseek-dense": (deepseek_dense, 32), "shared-expert": (shared_expert, 8)}


def tp_report(src: Path, *sizes: int) -> dict[str, Any]:
    result = run_cli("inspect", src, "--tp", ",".join(map(str, sizes)), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tensor_parallel"]


def groups(report: dict[str, Any], tp: int) -> dict[str, dict[str, Any]]:
    return {g["modules"]: g for g in report["sizes"][str(tp)]["modules"]}


def test_qwen3_moe_experts_are_refined_at_tp_4(tmp_path: Path) -> None:
    report = tp_report(qwen3_moe(tmp_path / "src"), 4, 8)
    assert report["block"] == [128, 128] and report["runtime"] == "vLLM 0.32"
    (experts,) = report["sizes"]["4"]["modules"]
    assert experts["role"] == "fused-moe" and experts["count"] == 12 and experts["per_rank"] == 96
    assert experts["behaviour"] == "refines" and experts["loads"] and "to 32x32" in experts["message"]
    at_8 = groups(report, 8)
    assert any(
        g["message"] == "The output_size of gate's and up's weight = 48 is not divisible by weight quantization "
        "block_n = 128."
        for g in at_8.values()
    )
    attention = [g for g in at_8.values() if "self_attn" in g["modules"]]
    assert sum(g["count"] for g in attention) == 4  # q, k, v, o
    assert {(g["behaviour"], g["message"]) for g in attention} == {
        ("refuses", "num_attention_heads = 4 does not split 8 ways (vLLM's attention asserts it)")
    }
    assert report["clean_sizes"] == [1]


def narrow_heads(root: Path) -> Path:
    """The shrunk Qwen3-MoE with 8 heads of 64 and 2 kv heads: at TP 8 the heads split (one per rank, a
    kv head per 4 ranks) but not into whole blocks: 64 rows of q, k and v, 64 columns of o_proj per rank.
    8 experts: vLLM's Qwen3-MoE wants no fewer experts than ranks."""
    return qwen3_moe(root, heads=8, head_dim=64, kv_heads=2, experts=8)


def test_attention_split_by_heads_into_partial_blocks(tmp_path: Path) -> None:
    found = groups(tp_report(narrow_heads(tmp_path / "src"), 2, 8), 8)
    a = "model.layers.0.self_attn"
    o = found[f"{a}.o_proj"]
    assert (o["per_rank"], o["behaviour"], o["loads"]) == (64, "refuses", False)
    # q, k, v: 64 rows per rank, their scales misaligned, and the last ranks' rounded-up scale ranges run out
    q, kv = found[f"{a}.q_proj"], found["model.layers.0.self_attn.{k_proj,v_proj}"]
    for qkv in (q, kv):
        assert (qkv["role"], qkv["per_rank"], qkv["behaviour"], qkv["loads"]) == ("qkv", 64, "refuses", False)
        assert "with 64 rows per rank they do not line up" in qkv["message"]
    assert "start (7) + length (1) exceeds dimension size (4)." in q["message"]  # q: 4 scale rows, 8 ranks
    assert "start (1) + length (1) exceeds dimension size (1)." in kv["message"]  # k, v: 1 scale row, 2 heads
    at_2 = tp_report(narrow_heads(tmp_path / "src2"), 2)["sizes"]["2"]["modules"]
    attention = [g for g in at_2 if "self_attn" in g["modules"]]
    # q: 256 rows per rank and o_proj 256 columns, whole blocks; k and v: one of the 2 kv heads, 64 rows
    assert [(g["modules"], g["behaviour"]) for g in attention] == [
        ("model.layers.0.self_attn.{k_proj,v_proj}", "refuses")
    ]


def test_deepseek_dense_down_proj_is_refused_at_tp_32(tmp_path: Path) -> None:
    report = tp_report(deepseek_dense(tmp_path / "src"), 32)
    found = groups(report, 32)
    assert set(found) == {"model.layers.0.mlp.down_proj", "model.layers.0.mlp.{gate_proj,up_proj}"}
    down = found["model.layers.0.mlp.down_proj"]
    assert (down["role"], down["size"], down["per_rank"], down["behaviour"]) == ("row-parallel", 4608, 144, "refuses")
    assert (
        down["message"]
        == "Weight input_size_per_partition = 144 is not divisible by weight quantization block_k = 128."
    )
    assert found["model.layers.0.mlp.{gate_proj,up_proj}"]["behaviour"] == "skips-check"
    assert report["clean_sizes"] == [1, 2, 4]  # 4608 / 4 = 9 blocks; as 18432 / 16 is 9 in the release


def test_shared_expert_down_proj_is_refused_at_tp_8(tmp_path: Path) -> None:
    found = groups(tp_report(shared_expert(tmp_path / "src"), 8), 8)
    down = found["model.layers.0.mlp.shared_expert.down_proj"]
    assert (down["per_rank"], down["behaviour"]) == (64, "refuses")
    experts = next(g for g in found.values() if g["role"] == "fused-moe")
    assert experts["behaviour"] == "refines" and "to 64x64" in experts["message"]


def test_text_report_and_checkpoints_without_blocks(tmp_path: Path) -> None:
    text = run_cli("inspect", deepseek_dense(tmp_path / "src"), "--tp", "16,32").output
    assert "tensor parallel (vLLM 0.32, 128x128 blocks):" in text and "  TP 32:" in text
    assert "every share whole blocks at TP: 1, 2, 4" in text
    from tests.builders import build, phi3

    plain = build(tmp_path / "plain", phi3())
    report = json.loads(run_cli("inspect", plain, "--tp", "4", "--json").output)
    assert report["tensor_parallel"] is None and any("not block-scaled" in n for n in report["notes"])


@pytest.mark.parametrize("bad", ["0", "4,x", "-2"])
def test_bad_sizes_are_usage_errors(tmp_path: Path, bad: str) -> None:
    result = run_cli("inspect", tmp_path, "--tp", bad)
    assert result.exit_code == 2 and "--tp" in result.output


def test_a_q_proj_without_k_proj_is_a_plain_column_layer(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite's MLA without q_lora_rank has `q_proj` and no k_proj / v_proj: vLLM builds it as a
    ColumnParallelLinear (models/deepseek_v2.py), which validate_fp8_block_shape checks, not a QKV layer."""
    config = {**DEEPSEEK_R1_CONFIG, "hidden_size": 256, "q_lora_rank": None, "kv_lora_rank": 128}
    config.update(qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_hidden_layers=1, vocab_size=256)
    p = "model.layers.0.self_attn"
    linears = {f"{p}.q_proj": (128 * 64, 256), f"{p}.kv_b_proj": (128 * 64, 128), f"{p}.o_proj": (256, 128 * 32)}
    found = groups(tp_report(block_fp8_checkpoint(tmp_path / "src", config, linears), 128), 128)
    q = found[f"{p}.{{kv_b_proj,q_proj}}"]  # 8192 rows each: 64 per rank at TP 128 (one head each)
    assert (q["role"], q["per_rank"], q["behaviour"]) == ("column-parallel", 64, "refuses")
    assert q["message"] == "Weight output_partition_size = 64 is not divisible by weight quantization block_n = 128."


def partial_q(root: Path) -> Path:
    """The shrunk Qwen3-MoE with 3 heads of 64 and one kv head: q has 192 rows (1.5 blocks), k 64."""
    return qwen3_moe(root, heads=3, head_dim=64, kv_heads=1)


def test_packed_shards_not_whole_blocks_shift_the_next_ones_scales_at_tp_1(tmp_path: Path) -> None:
    """No rank slicing at TP 1, but vLLM packs q / k / v (gate / up) into one layer and puts each shard's
    scales at whole-block offsets: a shard that is not whole blocks and has one after it is wrong-scales
    (vLLM >= 0.20: loads-wrong), or refused where a rounded-up range runs past the packed layer's scale
    rows (vLLM >= 0.20: fails); the last shard (v, up) is not reported."""
    src = partial_q(tmp_path / "src")
    found = groups(tp_report(src, 1), 1)
    assert {k: (g["behaviour"], g["per_rank"]) for k, g in found.items()} == {
        "model.layers.0.self_attn.q_proj": ("wrong-scales", 192),
        "model.layers.0.self_attn.k_proj": ("wrong-scales", 64),
    }
    assert "exceeds" not in found["model.layers.0.self_attn.q_proj"]["message"]
    loaders = json.loads(run_cli("inspect", src, "--json").output)["loaders"]
    # transformers on CPU reads q's 192 rows over 2 grid rows as blocks of 96 (issue 24, tests/loaders)
    assert loaders["vLLM >= 0.32"]["verdict"] == "loads-wrong" and loaders["transformers"]["verdict"] == "loads-wrong"
    dense = deepseek_dense(tmp_path / "dense", intermediate=4608 + 64)  # 36.5 blocks
    found = groups(tp_report(dense, 1), 1)
    assert [(k, g["behaviour"]) for k, g in found.items()] == [("model.layers.0.mlp.gate_proj", "refuses")]
    # up's 37 scale rows would start at row ceil(4672 / 128) = 37 of a packed grid of ceil(9344 / 128) = 73
    assert "start (37) + length (37) exceeds dimension size (73)." in found["model.layers.0.mlp.gate_proj"]["message"]
    loaders = json.loads(run_cli("inspect", dense, "--json").output)["loaders"]
    assert loaders["vLLM >= 0.32"]["verdict"] == "fails"


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 3), (8, 8)])
def test_inspect_tp_names_the_heads_refusal_without_block_scales(tmp_path: Path, heads: int, kv_heads: int) -> None:
    """Per-tensor scales split at any size, but vLLM refuses attention whose heads do not split (issue 27:
    `inspect --tp 3` said the scales split on a model with 4 heads and stopped there)."""
    src = build(tmp_path / "src", phi3(hidden=heads * 16, heads=heads, kv_heads=kv_heads))
    sizes = [1, 2, 3, 4, 8]
    notes = json.loads(run_cli("inspect", src, "--tp", ",".join(map(str, sizes)), "--json").output)["notes"]
    for tp in sizes:
        # vLLM's rule, from its attention: heads % tp == 0, and kv heads split (or replicate) evenly
        splits = heads % tp == 0 and (kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0)
        (note,) = [n for n in notes if n.startswith(f"--tp {tp}:")]
        assert ("vLLM refuses it" in note) == (not splits), note


def test_role_lookup_by_the_last_three_components_is_the_full_search():
    """role_of looks roles up by a module's last three path components (a cache over 45k expert modules):
    for every ending the patterns know, under prefixes that could fool a shorter look, it answers what
    searching every pattern over the whole path does."""
    import itertools
    import re

    from fp8fix.registry.parallel import ROLES, role_of

    leaves = {leaf for r in ROLES for leaf in re.findall(r"[a-z_0-9]+_proj|w[123]|dense_4h_to_h", r.pattern.pattern)}
    prefixes = ["", "model.layers.3.", "x", "experts.", "model.experts.", "mlp.experts.7.", "a.b.c.d."]
    middles = ["", "experts.12.", "xexperts.1.", "experts.x.", "mlp.", "shared_experts.", "experts.", "12."]
    checked = 0
    for prefix, middle, leaf in itertools.product(prefixes, middles, sorted(leaves)):
        module = f"{prefix}{middle}{leaf}"
        full = next((r for r in ROLES if r.pattern.search(module)), None)
        assert role_of(module) is full, module
        checked += 1
    assert checked > 500 and any(role_of(f"model.layers.1.mlp.experts.{e}.w1") for e in range(3))

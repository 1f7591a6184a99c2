"""Fused modules stored per head or per kv group (GPT-NeoX, BLOOM, Falcon, InternLM2), from their documented
row layouts: requantization by segment, and the unfused permutation checked against slicing written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FusedModule, Model, build
from tests.conftest import load_tensors, raw, run_cli
from tests.test_convert_layouts import reference_requantize

H, HEADS, HD = 64, 4, 16


def neox() -> Model:
    config = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS}
    # [heads, 3, head_dim]: per head, its q rows, then k, then v
    fused = [FusedModule("attention.query_key_value", [HEADS * HD] * 3, H, groups=HEADS)]
    return Model("GPTNeoXForCausalLM", config, "gpt_neox.layers.{i}.", 2, fused)


def bloom() -> Model:
    config = {"architectures": ["BloomForCausalLM"], "hidden_size": H, "n_head": HEADS}
    fused = [FusedModule("self_attention.query_key_value", [HEADS * HD] * 3, H, groups=HEADS)]
    return Model("BloomForCausalLM", config, "transformer.h.{i}.", 2, fused)


def falcon_new() -> Model:
    config = {
        "architectures": ["FalconForCausalLM"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
    }
    # per kv group: its 2 q heads, then 1 k head, then 1 v head
    fused = [FusedModule("self_attention.query_key_value", [HEADS * HD, 2 * HD, 2 * HD], H, groups=2)]
    return Model("FalconForCausalLM", config, "transformer.h.{i}.", 2, fused)


def falcon_multi_query() -> Model:
    config = {
        "architectures": ["FalconForCausalLM"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "multi_query": True,
    }
    fused = [FusedModule("self_attention.query_key_value", [HEADS * HD, HD, HD], H)]  # [q; k; v], one kv head
    return Model("FalconForCausalLM", config, "transformer.h.{i}.", 2, fused)


def internlm2() -> Model:
    config = {
        "architectures": ["InternLM2ForCausalLM"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
    }
    fused = [FusedModule("attention.wqkv", [HEADS * HD, 2 * HD, 2 * HD], H, groups=2)]
    return Model("InternLM2ForCausalLM", config, "model.layers.{i}.", 2, fused)


MODELS = {
    "neox": neox,
    "bloom": bloom,
    "falcon-new": falcon_new,
    "falcon-mq": falcon_multi_query,
    "internlm2": internlm2,
}


def shard_rows_by_hand(f: FusedModule, shard: int) -> list[int]:
    """Indices of a shard's rows in storage order, walked group by group (written independently of fp8fix)."""
    per_group = [r // f.groups for r in f.rows]
    group_size = sum(per_group)
    first = sum(per_group[:shard])
    return [g * group_size + first + k for g in range(f.groups) for k in range(per_group[shard])]


@pytest.mark.parametrize("name", list(MODELS))
def test_grouped_modules_are_found_and_requantized_by_segment(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()
    src = build(tmp_path / "src", model, scale="shard")
    report = json.loads(
        run_cli("convert", src, tmp_path / "dry", "--layout", "per-shard", "--dry-run", "--json").output
    )
    assert report["layout"] == "per-shard"
    assert [list(m["shards"].values()) for m in report["modules"]] == [model.fused[0].rows] * model.layers
    assert run_cli("convert", src, tmp_path / "out", "--layout", "fused", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    f = model.fused[0]
    for layer in range(model.layers):
        module = model.layer_prefix.format(i=layer) + f.suffix
        scales, w, got = s[f"{module}.weight_scale"], s[f"{module}.weight"], o[f"{module}.weight"]
        for shard in range(len(f.rows)):
            idx = torch.tensor(shard_rows_by_hand(f, shard))
            expected = reference_requantize(w[idx], scales[shard], scales.max())
            assert raw(got[idx]) == raw(expected), (module, shard)


def neox_arch_file(tmp_path: Path) -> Path:
    entry = json.loads((Path(__file__).parent.parent / "fp8fix/registry/architectures/gpt_neox.json").read_text())
    for shard, suffix in zip(entry["fused_modules"][0]["shards"], ("q", "k", "v"), strict=True):
        shard["unfused"] = f"attention.{suffix}_proj"
    path = tmp_path / "neox-unfused.json"
    path.write_text(json.dumps(entry))
    return path


@pytest.mark.parametrize("fmt,scale", [("fp8", "tensor"), ("compressed-tensors", "channel")])
def test_unfused_permutes_rows_per_head(tmp_path: Path, fmt: str, scale: str) -> None:
    model = neox()
    src = build(tmp_path / "src", model, fmt=fmt, scale=scale, bias=True)
    refused = run_cli("convert", src, tmp_path / "refused", "--layout", "unfused")
    assert refused.exit_code == 3  # no runtime knows per-shard names for GPT-NeoX
    result = run_cli(
        "convert", src, tmp_path / "out", "--layout", "unfused", "--arch-file", neox_arch_file(tmp_path), "-q"
    )
    assert result.exit_code == 0, result.output
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    f = model.fused[0]
    for layer in range(model.layers):
        module = f"gpt_neox.layers.{layer}.attention"
        for shard, name in enumerate(("q_proj", "k_proj", "v_proj")):
            idx = torch.tensor(shard_rows_by_hand(f, shard))
            assert raw(o[f"{module}.{name}.weight"]) == raw(s[f"{module}.query_key_value.weight"][idx])
            assert raw(o[f"{module}.{name}.bias"]) == raw(s[f"{module}.query_key_value.bias"][idx])
            scale_name = f"{module}.query_key_value.weight_scale"
            expected = s[scale_name][idx] if scale == "channel" else s[scale_name]
            assert raw(o[f"{module}.{name}.weight_scale"]) == raw(expected)


def test_block_scales_split_off_block_aligned_heads_requantize_the_mixed_blocks(tmp_path: Path) -> None:
    """16-row heads in 32-row blocks: each output block gathers two heads from two source blocks, so
    unfusing requantizes them (reported); per-shard keeps the module as it is."""
    src = build(tmp_path / "src", neox(), fmt="block-fp8")
    arch = neox_arch_file(tmp_path)
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "--arch-file", arch, "--json", "-q")
    assert result.exit_code == 0, result.output  # run_cli verifies the output too
    module = json.loads(result.stdout)["modules"][0]
    assert module["blocks_requantized"] > 0 and 0 < module["max_error_steps"] <= 0.5
    assert run_cli("convert", src, tmp_path / "kept", "--layout", "per-shard", "-q").exit_code == 0


def test_block_scales_split_per_head_when_heads_are_whole_blocks(tmp_path: Path) -> None:
    heads, head_dim, hidden = 4, 32, 128  # 32-row heads, 32-row scale blocks
    config = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": hidden, "num_attention_heads": heads}
    f = FusedModule("attention.query_key_value", [heads * head_dim] * 3, hidden, groups=heads)
    model = Model("GPTNeoXForCausalLM", config, "gpt_neox.layers.{i}.", 1, [f], hidden=hidden)
    src = build(tmp_path / "src", model, fmt="block-fp8", files=1)
    args = ("--layout", "unfused", "--arch-file", neox_arch_file(tmp_path), "-q")
    assert run_cli("convert", src, tmp_path / "out", *args).exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    module = "gpt_neox.layers.0.attention"
    grid = s[f"{module}.query_key_value.weight_scale_inv"]  # [3 * heads, hidden / 32]: one block row per head and shard
    for shard, name in enumerate(("q_proj", "k_proj", "v_proj")):
        idx = torch.tensor(shard_rows_by_hand(f, shard))
        assert raw(o[f"{module}.{name}.weight"]) == raw(s[f"{module}.query_key_value.weight"][idx])
        block_rows = torch.tensor([h * 3 + shard for h in range(heads)])
        assert raw(o[f"{module}.{name}.weight_scale_inv"]) == raw(grid[block_rows])

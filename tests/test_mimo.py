"""Block grids that do not follow shard boundaries (issue 15, item 5): MiMo-V2.5(-Pro)'s pre-sharded
fused qkv_proj, and any block-scaled fused module whose shard boundaries are not block multiples.

The checkpoint is `builders.mimo_v2`: MiMo-V2.5-Pro's layout shrunk (see its docstring). The
expected values are worked out here from the layout vLLM 0.32's `_shard_fp8_qkv_proj` describes
(chunk c holds [Q_c | K_c | V_c]; its block scales are ceil(chunk rows / 128) grid rows of their
own), never from fp8fix's plan.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.builders import FORMATS, MIMO_BLOCK, build, mimo_unfused_rows, mimo_v2, phi3
from tests.conftest import load_tensors, patch_bytes, raw, run_cli

B0, B1 = MIMO_BLOCK
SHARDS = ("q", "k", "v")
LAYERS = {"model.layers.0.": False, "model.layers.1.": True, "model.mtp.layers.0.": True}  # prefix -> SWA dims


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mimo_v2(tmp_path_factory.mktemp("mimo") / "src")


def true_values(codes: torch.Tensor, grid: torch.Tensor, scale_rows: list[int]) -> torch.Tensor:
    """Dequantized rows: each row's codes times its block-scale row, column block by column block."""
    per_row = grid.float()[scale_rows].repeat_interleave(B1, dim=1)[:, : codes.shape[1]]
    return codes.float() * per_row


def test_mimo_pro_splits_into_standard_block_grids(mimo: Path, tmp_path: Path) -> None:
    """Every output block from one source block keeps its codes and scales exactly; a block that mixes
    source blocks has the largest of their scales (its values: the next test); reported per module."""
    result = run_cli("convert", mimo, tmp_path / "out", "--layout", "unfused", "--json", "-q")  # verified too
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    config = json.loads((mimo / "config.json").read_text())
    s, o = load_tensors(mimo), load_tensors(tmp_path / "out")
    modules = {m["module"]: m for m in report["modules"]}
    for prefix, swa in LAYERS.items():
        weight, grid = s[prefix + "self_attn.qkv_proj.weight"], s[prefix + "self_attn.qkv_proj.weight_scale_inv"]
        assert prefix + "self_attn.qkv_proj.weight" not in o
        mixed_blocks = 0
        for shard, name in enumerate(SHARDS):
            rows = mimo_unfused_rows(config, swa, shard)
            out_w, out_s = (
                o[f"{prefix}self_attn.{name}_proj.weight"],
                o[f"{prefix}self_attn.{name}_proj.weight_scale_inv"],
            )
            assert out_w.shape == (len(rows), weight.shape[1]) and out_s.shape == (-(-len(rows) // B0), grid.shape[1])
            for j in range(out_s.shape[0]):
                block = rows[j * B0 : (j + 1) * B0]
                contributing = sorted({g for _, g in block})
                src_rows = [r for r, _ in block]
                if len(contributing) == 1:  # inside one source block: bytes and scale kept
                    assert raw(out_w[j * B0 : j * B0 + len(block)]) == raw(weight[src_rows])
                    assert raw(out_s[j]) == raw(grid[contributing[0]])
                    continue
                largest = grid[contributing].amax(dim=0)
                assert torch.equal(out_s[j], largest)
                mixed_blocks += int((grid[contributing] != largest).any(dim=0).sum())
        module = modules[prefix + "self_attn.qkv_proj"]
        assert module["action"] == "unfuse" and module["blocks_requantized"] == mixed_blocks
        assert (mixed_blocks > 0) == (not swa)  # GA chunks are 5.5 blocks; the SWA ones 8: whole
        if mixed_blocks:
            assert 0 < module["max_error_steps"] <= 0.5 and "requantized to the largest" in module["reason"]
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_config["attention_projection_layout"] == "split"
    assert {k: v for k, v in out_config.items() if k != "attention_projection_layout"} == {
        k: v for k, v in config.items() if k != "attention_projection_layout"
    }


def test_mimo_requantized_rows_are_within_half_a_step(mimo: Path, tmp_path: Path) -> None:
    """The requantized rows, value by value: within half an fp8 step at the block's new scale."""
    assert run_cli("convert", mimo, tmp_path / "out", "-q").exit_code == 0  # the default layout: unfused
    config = json.loads((mimo / "config.json").read_text())
    s, o = load_tensors(mimo), load_tensors(tmp_path / "out")
    weight, grid = (
        s["model.layers.0.self_attn.qkv_proj.weight"],
        s["model.layers.0.self_attn.qkv_proj.weight_scale_inv"],
    )
    for shard, name in enumerate(SHARDS):
        rows = mimo_unfused_rows(config, False, shard)
        expected = true_values(weight[[r for r, _ in rows]], grid, [g for _, g in rows])
        out_s = o[f"model.layers.0.self_attn.{name}_proj.weight_scale_inv"]
        per_row = out_s.float()[[r // B0 for r in range(len(rows))]].repeat_interleave(B1, dim=1)
        codes = o[f"model.layers.0.self_attn.{name}_proj.weight"].float()
        exact = (expected / per_row).clamp(-448, 448)
        # half a step of e4m3fn at the exact code: 2^(floor(log2|x|) - 3) / 2, at least half the subnormal step
        half_step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2**-6))) - 4)
        assert bool(((codes - exact).abs() <= half_step + 1e-6).all()), name


def test_mimo_to_e4m3fnuz_normalizes_then_requantizes(mimo: Path, tmp_path: Path) -> None:
    assert run_cli("convert", mimo, tmp_path / "fn", "-q").exit_code == 0
    assert run_cli("convert", mimo, tmp_path / "fnuz", "--to", "e4m3fnuz", "-q").exit_code == 0
    fn, fnuz = load_tensors(tmp_path / "fn"), load_tensors(tmp_path / "fnuz")
    for name in ("q", "k", "v"):
        w, scale = (
            f"model.layers.0.self_attn.{name}_proj.weight",
            f"model.layers.0.self_attn.{name}_proj.weight_scale_inv",
        )
        assert fnuz[w].dtype == torch.float8_e4m3fnuz
        assert torch.equal(fnuz[scale], fn[scale] * 2)  # the same largest scales, doubled
        # same values: the fnuz codes at twice the scale dequantize to the fn output's values
        assert torch.equal(fnuz[w].float() * 2, fn[w].float())


def test_mimo_fused_and_per_shard_layouts_keep_the_chunks(mimo: Path, tmp_path: Path) -> None:
    for layout in ("fused", "per-shard"):
        result = run_cli("convert", mimo, tmp_path / layout, "--layout", layout, "--json", "-q")
        assert result.exit_code == 0, result.output
        modules = json.loads(result.stdout)["modules"]
        assert all(m["action"] == "keep" and "pre-sharded chunks kept" in m["reason"] for m in modules)
        s, o = load_tensors(mimo), load_tensors(tmp_path / layout)
        assert all(raw(o[n]) == raw(t) for n, t in s.items())
        assert json.loads((tmp_path / layout / "config.json").read_text())["attention_projection_layout"] == "fused_qkv"


def test_mimo_verdicts_and_inspect(mimo: Path) -> None:
    report = json.loads(run_cli("inspect", mimo, "--json").output)
    assert report["convert_supported"]
    loaders = report["loaders"]
    assert loaders["vLLM >= 0.32"]["verdict"] == "loads" and "regroups" in loaders["vLLM >= 0.32"]["reason"]
    # no MiMoV2ForCausalLM before vLLM 0.21 (its models/registry.py): fails, whatever the layout
    assert loaders["vLLM 0.5.1 - 0.18"]["verdict"] == loaders["vLLM 0.19 - 0.20"]["verdict"] == "fails"
    assert loaders["transformers"]["verdict"] == "fails"


@pytest.mark.parametrize("tamper", ["exact code", "requantized scale"])
def test_verify_catches_a_changed_block(mimo: Path, tmp_path: Path, tamper: str) -> None:
    out = tmp_path / "out"
    assert run_cli("convert", mimo, out, "-q").exit_code == 0
    o = load_tensors(out)
    if tamper == "exact code":  # K rows 0..127 come from one source block: exact
        name, index = "model.layers.0.self_attn.k_proj.weight", 5
        patch_bytes(out, name, {index: (raw(o[name])[index] + 1) % 0x7F})
    else:  # V's first block row mixes two source blocks: its scale is their largest
        name = "model.layers.0.self_attn.v_proj.weight_scale_inv"
        patch_bytes(out, name, {0: raw(o[name])[0] ^ 0x01})
    result = run_cli("verify", mimo, out, check_output=False)
    assert result.exit_code != 0 and name.rsplit(".", 1)[0] in result.output


def test_block_splits_off_block_boundaries_requantize_only_mixed_blocks(tmp_path: Path) -> None:
    """Any block-scaled fused module, not only MiMo's: Phi-3 with 48-row blocks. q/k/v's boundaries
    (64, 96) each fall in one source block, so every output block is exact; gate/up's (128) does not."""
    FORMATS["block-fp8-48"] = replace(FORMATS["block-fp8"], block=(48, 32))
    try:
        src = build(tmp_path / "src", phi3(), fmt="block-fp8-48")
    finally:
        del FORMATS["block-fp8-48"]
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "--json", "-q")
    assert result.exit_code == 0, result.output
    modules = {m["module"]: m for m in json.loads(result.stdout)["modules"]}
    assert modules["model.layers.0.self_attn.qkv_proj"]["blocks_requantized"] == 0
    assert modules["model.layers.0.mlp.gate_up_proj"]["blocks_requantized"] > 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    qkv, grid = s["model.layers.0.self_attn.qkv_proj.weight"], s["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert raw(o["model.layers.0.self_attn.k_proj.weight"]) == raw(qkv[64:96])
    assert raw(o["model.layers.0.self_attn.k_proj.weight_scale_inv"]) == raw(grid[1:2])  # rows 64..95: block 1
    up = o["model.layers.0.mlp.up_proj.weight_scale_inv"]
    source = s["model.layers.0.mlp.gate_up_proj.weight_scale_inv"]
    assert torch.equal(up[0], source[2:4].amax(dim=0))  # up rows 0..47: source rows 128..175, blocks 2 and 3


def test_a_config_that_does_not_size_the_chunks_is_refused(mimo: Path, tmp_path: Path) -> None:
    """Without hybrid_layer_pattern no layer's head counts are known: a clear error naming the module."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(mimo, src)
    config = json.loads((src / "config.json").read_text())
    del config["hybrid_layer_pattern"]
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code != 0 and not (tmp_path / "out").exists()
    assert "config.json has no 'hybrid_layer_pattern'" in result.output
    assert "self_attn.qkv_proj of 'model." in result.output

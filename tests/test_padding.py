"""`convert --tp N` (issue 17): MLP intermediates zero-padded to multiples of N x 128, config.json sizes
following, every MLP output unchanged; verify checks the padding; modules split by attention heads
are refused with the sizes that work. Checkpoints: tests/test_parallel.py's shrunk reported cases."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.builders import FP8, build, phi3
from tests.conftest import load_tensors, patch_bytes, raw, run_cli
from tests.test_parallel import deepseek_dense, qwen3_moe, shared_expert

B = 128


def dequant(codes: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    return codes.double() * grid.double().repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]


def mlp(t: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(intermediate activations, output) of a SwiGLU MLP from dequantized weights, in float64."""
    w = {
        p: dequant(t[f"{prefix}.{p}.weight"], t[f"{prefix}.{p}.weight_scale_inv"])
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    h = torch.nn.functional.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)
    return h, h @ w["down_proj"].T


def test_deepseek_dense_mlp_padded_for_tp_32(tmp_path: Path) -> None:
    src = deepseek_dense(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--tp", "32", "--json")  # run_cli verifies it
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)["tensor_parallel"]
    assert record["tp"] == 32 and record["multiple"] == 4096 and record["config"] == {"intermediate_size": 8192}
    (padded,) = record["mlps"]
    assert (padded["module"], padded["intermediate"], padded["padded"]) == ("model.layers.0.mlp", 4608, 8192)
    assert padded["added_bytes"] == 3 * 256 * (8192 - 4608) + (64 - 36) * 2 * 4 * 3
    assert json.loads((tmp_path / "out" / "config.json").read_text())["intermediate_size"] == 8192
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    p = "model.layers.0.mlp"
    assert o[f"{p}.gate_proj.weight"].shape == (8192, 256) and o[f"{p}.down_proj.weight"].shape == (256, 8192)
    assert raw(o[f"{p}.gate_proj.weight"][:4608]) == raw(s[f"{p}.gate_proj.weight"])
    assert not o[f"{p}.gate_proj.weight"][4608:].view(torch.uint8).any()
    assert raw(o[f"{p}.down_proj.weight"][:, :4608].contiguous()) == raw(s[f"{p}.down_proj.weight"])
    assert not o[f"{p}.down_proj.weight"][:, 4608:].view(torch.uint8).any()
    assert torch.equal(o[f"{p}.down_proj.weight_scale_inv"][:, :36], s[f"{p}.down_proj.weight_scale_inv"])
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h_src, y_src = mlp(s, p, x)
    h_out, y_out = mlp(o, p, x)
    assert not h_out[:, 4608:].any()  # the padded activations: exactly 0
    # the rest: equal up to the summation order of float64 products of other widths (BLAS kernels by shape)
    assert torch.allclose(h_out[:, :4608], h_src, rtol=1e-12, atol=0)
    assert torch.allclose(y_out, y_src, rtol=1e-12, atol=0)
    report = json.loads(run_cli("inspect", tmp_path / "out", "--tp", "32", "--json").output)["tensor_parallel"]
    assert report["sizes"]["32"]["clean"] and 32 in report["clean_sizes"]


def test_qwen3_moe_experts_padded_and_attention_refused_where_it_must_be(tmp_path: Path) -> None:
    src = qwen3_moe(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--tp", "4")
    assert result.exit_code == 0, result.output
    assert "moe_intermediate_size: 384 -> 512" in result.output and "expert parallelism" in result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["moe_intermediate_size"] == 512 and config["intermediate_size"] == 768  # no dense MLP here
    assert json.loads(run_cli("inspect", tmp_path / "out", "--tp", "4", "--json").output)["tensor_parallel"]["sizes"][
        "4"
    ]["clean"]
    refused = run_cli("convert", src, tmp_path / "tp8", "--tp", "8")  # o_proj: 512 / 8 = 64 per rank
    assert refused.exit_code == 3 and not (tmp_path / "tp8").exists()
    assert (
        "model.layers.0.self_attn.o_proj" in refused.output
        and "sizes whose attention splits whole: 1, 2, 4" in refused.output
    )


def test_shared_expert_and_experts_padded_together(tmp_path: Path) -> None:
    result = run_cli("convert", shared_expert(tmp_path / "src"), tmp_path / "out", "--tp", "8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tensor_parallel"]["config"] == {
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
    }


def test_tp_composes_with_e4m3fnuz(tmp_path: Path) -> None:
    src = deepseek_dense(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "out", "--tp", "32", "--to", "e4m3fnuz", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    down = "model.layers.0.mlp.down_proj"
    codes = s[f"{down}.weight"].view(torch.uint8)
    assert o[f"{down}.weight"].dtype == torch.float8_e4m3fnuz
    assert torch.equal(
        o[f"{down}.weight"][:, :4608].contiguous().view(torch.uint8), torch.where(codes == 0x80, 0, codes)
    )
    assert torch.equal(o[f"{down}.weight_scale_inv"][:, :36], s[f"{down}.weight_scale_inv"] * 2)


def test_verify_catches_a_nonzero_padding_and_a_size_without_padding(tmp_path: Path) -> None:
    src = deepseek_dense(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--tp", "32", "-q").exit_code == 0
    patch_bytes(out, "model.layers.0.mlp.down_proj.weight", {4608 + 7: 0x38})  # row 0, a padded column
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "down_proj.weight' rows 0" in result.output and "other than zero" in result.output
    patch_bytes(out, "model.layers.0.mlp.down_proj.weight", {4608 + 7: 0x00})
    patch_bytes(out, "model.layers.0.mlp.gate_proj.weight", {8000 * 256 + 3: 0x38})  # an appended row, late
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "gate_proj.weight' rows" in result.output and "other than zero" in result.output
    plain = tmp_path / "plain"
    assert run_cli("convert", src, plain, "-q").exit_code == 0
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "intermediate_size": 8192}))
    result = run_cli("verify", src, plain)
    assert result.exit_code == 1 and "gate_proj.weight" in result.output


def test_tp_needs_block_scales(tmp_path: Path) -> None:
    result = run_cli("convert", build(tmp_path / "src", phi3()), tmp_path / "out", "--tp", "4")
    assert result.exit_code == 3 and "no block scales" in result.output
    assert FP8 is torch.float8_e4m3fn


def test_a_fused_gate_up_mlp_is_refused_not_left_unpadded(tmp_path: Path) -> None:
    """Phi-3 stores gate_up_proj fused: fp8fix pads only MLPs stored apart, so --tp refuses rather than
    write a checkpoint whose down_proj still splits into partial blocks."""
    from tests.builders import block_fp8_checkpoint

    config = {**phi3(hidden=256, heads=2, kv_heads=1, intermediate=384).config}
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    p = "model.layers.0"
    linears = {
        f"{p}.self_attn.qkv_proj": (512, 256),
        f"{p}.self_attn.o_proj": (256, 256),
        f"{p}.mlp.gate_up_proj": (768, 256),
        f"{p}.mlp.down_proj": (256, 384),
    }
    src = block_fp8_checkpoint(tmp_path / "src", {**config, "num_hidden_layers": 1}, linears)
    result = run_cli("convert", src, tmp_path / "out", "--tp", "2")
    assert result.exit_code == 3 and "'model.layers.0.mlp.down_proj' is not whole blocks per rank" in result.output
    assert not (tmp_path / "out").exists()

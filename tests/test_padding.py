"""`convert --tp N` (issue 17): MLP intermediates zero-padded to multiples of N x 128, config.json sizes
following, every MLP output unchanged; verify checks the padding; modules split by attention heads
are refused with the sizes that work, or with `--tp-bf16` written in BF16 and listed as unquantized.
Checkpoints: tests/test_parallel.py's shrunk reported cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FP8, block_fp8_checkpoint, build, phi3, write_files
from tests.conftest import load_tensors, patch_bytes, raw, run_cli
from tests.test_parallel import deepseek_attention, deepseek_dense, narrow_heads, partial_q, qwen3_moe, shared_expert

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
    record = json.loads(result.stdout)["tensor_parallel"]
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
    assert json.loads(result.stdout)["tensor_parallel"]["config"] == {
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


ATTENTION = [f"model.layers.0.self_attn.{m}" for m in ("k_proj", "o_proj", "q_proj", "v_proj")]


def bf16_error_steps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in BF16 steps at `exact` (8 significant bits: the step is 2^(e - 8) for exact in
    [2^(e-1), 2^e)); this test's own reading of "one rounding to BF16"."""
    _, exponent = torch.frexp(exact)
    return (got.double() - exact).abs() / torch.ldexp(torch.ones_like(exact), exponent - 8)


def test_tp_bf16_writes_attention_split_into_partial_blocks_in_bf16(tmp_path: Path) -> None:
    src = narrow_heads(tmp_path / "src")
    refused = run_cli("convert", src, tmp_path / "no", "--tp", "8")
    assert refused.exit_code == 3 and "--tp-bf16 writes them in BF16 instead" in refused.output
    assert refused.output.rstrip().endswith("sizes whose attention splits whole: 1") and not (tmp_path / "no").exists()
    result = run_cli("convert", src, tmp_path / "out", "--tp", "8", "--tp-bf16", "--json")  # run_cli verifies
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    bf16 = record["tensor_parallel"]["bf16"]
    assert sorted(m["module"] for m in bf16) == ATTENTION
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    worst = 0.0
    for module in ATTENTION:
        w = o[f"{module}.weight"]
        assert w.dtype == torch.bfloat16 and w.shape == s[f"{module}.weight"].shape
        assert f"{module}.weight_scale_inv" not in o
        exact = dequant(s[f"{module}.weight"], s[f"{module}.weight_scale_inv"])
        steps = bf16_error_steps(w, exact)
        assert steps.max() <= 0.5 and torch.equal(w, exact.float().to(torch.bfloat16))
        worst = max(worst, steps.max().item())
        said = next(m for m in bf16 if m["module"] == module)
        assert said["added_bytes"] == w.numel() - s[f"{module}.weight_scale_inv"].numel() * 4
    # the report is a bound (the worst any code gets at these scales): never below what the weights got
    assert worst <= max(m["max_error_steps"] for m in bf16) <= 0.5
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert sorted(config["modules_to_not_convert"]) == ATTENTION and "ignored_layers" not in config
    assert "quantization_config.modules_to_not_convert: +4 module name(s) written in BF16" in " ".join(
        record["config_edits"]
    )
    text = run_cli("convert", src, tmp_path / "text", "--tp", "8", "--tp-bf16").output
    assert "BF16 rounding of 4 module(s)" in text and "0.50 BF16 steps" in text
    card = (tmp_path / "text" / "README.md").read_text()
    assert "--tp 8 --tp-bf16" in card and "listed as unquantized (--tp-bf16)" in card
    report = json.loads(run_cli("inspect", tmp_path / "out", "--tp", "8", "--json").output)["tensor_parallel"]
    assert report["sizes"]["8"]["clean"]
    refused = run_cli("convert", src, tmp_path / "alone", "--tp-bf16")
    assert refused.exit_code == 2 and "--tp-bf16 needs --tp" in refused.output
    import fp8fix

    with pytest.raises(fp8fix.UsageError, match=r"tp_bf16=True needs tp: "):  # the API names its keywords
        fp8fix.convert(src, tmp_path / "alone", tp_bf16=True)
    with pytest.raises(fp8fix.UnsupportedCheckpoint, match=r"^tp=8: .*tp_bf16=True writes them in BF16"):
        fp8fix.convert(src, tmp_path / "alone", tp=8)


def test_tp_bf16_lists_follow_the_format(tmp_path: Path) -> None:
    """vLLM reads ignored_layers when it is set (else modules_to_not_convert), transformers only
    modules_to_not_convert: both get the modules. compressed-tensors: `ignore`."""
    src = narrow_heads(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head"]
    (src / "config.json").write_text(json.dumps(config))
    assert run_cli("convert", src, tmp_path / "out", "--tp", "8", "--tp-bf16", "-q").exit_code == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignored_layers"] == ["lm_head", *sorted(ATTENTION)] or sorted(qc["ignored_layers"]) == sorted(
        ["lm_head", *ATTENTION]
    )
    assert sorted(qc["modules_to_not_convert"]) == ATTENTION
    ct = tmp_path / "ct"
    ct.mkdir()
    tensors = {k.replace("weight_scale_inv", "weight_scale"): v for k, v in load_tensors(src).items()}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "block",
                    "symmetric": True,
                    "dynamic": False,
                    "block_structure": [128, 128],
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 128,
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    write_files(ct, [tensors], config)
    result = run_cli("convert", ct, tmp_path / "ct-out", "--tp", "8", "--tp-bf16", "--json")
    assert result.exit_code == 0, result.output
    qc = json.loads((tmp_path / "ct-out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"][:2] == ["lm_head", "re:.*mlp.gate$"] and sorted(qc["ignore"][2:]) == ATTENTION
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in load_tensors(tmp_path / "ct-out")


def test_tp_bf16_composes_with_e4m3fnuz(tmp_path: Path) -> None:
    """The BF16 modules hold the same values whatever the encoding; the rest is fnuz at doubled scales."""
    src = narrow_heads(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "fn", "--tp", "8", "--tp-bf16", "-q").exit_code == 0
    result = run_cli("convert", src, tmp_path / "fnuz", "--tp", "8", "--tp-bf16", "--to", "e4m3fnuz", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["encoding"]["weights"] == 24  # 8 experts x 3: not the 4 BF16 modules
    fn, fnuz = load_tensors(tmp_path / "fn"), load_tensors(tmp_path / "fnuz")
    for module in ATTENTION:
        assert raw(fnuz[f"{module}.weight"]) == raw(fn[f"{module}.weight"])
    down = "model.layers.0.mlp.experts.0.down_proj"
    assert fnuz[f"{down}.weight"].dtype == torch.float8_e4m3fnuz
    kept = load_tensors(src)[f"{down}.weight_scale_inv"].shape[1]  # the padded blocks' scales: 1.0 in both
    assert torch.equal(fnuz[f"{down}.weight_scale_inv"][:, :kept], fn[f"{down}.weight_scale_inv"][:, :kept] * 2)


def test_verify_checks_bf16_modules(tmp_path: Path) -> None:
    src = narrow_heads(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--tp", "8", "--tp-bf16", "-q").exit_code == 0
    q = "model.layers.0.self_attn.q_proj.weight"
    value = load_tensors(out)[q][3, 5:6]
    nudged = (value.view(torch.int16) + 1).view(torch.uint8).tolist()  # the next BF16 value: a step off
    patch_bytes(out, q, {2 * (3 * 256 + 5): nudged[0], 2 * (3 * 256 + 5) + 1: nudged[1]})
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and f"'{q}' row 3 column 5" in result.output
    assert run_cli("convert", src, out, "--tp", "8", "--tp-bf16", "-q", "--overwrite").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].remove("model.layers.0.self_attn.o_proj")
    (out / "config.json").write_text(json.dumps(config))
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "config.json" in result.output


def test_verify_wants_the_scales_of_bf16_modules_gone(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = narrow_heads(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--tp", "8", "--tp-bf16", "-q").exit_code == 0
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    shard = sorted(out.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors[scale] = load_tensors(src)[scale]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and f"'{scale}': OUTPUT holds its weight unquantized" in result.output


def test_tp_1_fixes_shards_that_shift_the_next_ones_scales(tmp_path: Path) -> None:
    """At TP 1 (tests/test_parallel.py): `--tp 1` pads a gate that is not whole blocks, `--tp 1 --tp-bf16`
    writes q / k / v in BF16; vLLM >= 0.20's verdict on each output is then loads."""
    dense = deepseek_dense(tmp_path / "dense", intermediate=4608 + 64)
    result = run_cli("convert", dense, tmp_path / "dense-out", "--tp", "1", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["tensor_parallel"]["config"] == {"intermediate_size": 4736}
    assert record["loaders"]["vLLM >= 0.32"]["verdict"] == "loads"
    assert record["source_loaders"]["vLLM >= 0.32"]["verdict"] == "fails"
    src = partial_q(tmp_path / "src")
    refused = run_cli("convert", src, tmp_path / "no", "--tp", "1")
    assert refused.exit_code == 3 and "--tp-bf16" in refused.output
    result = run_cli("convert", src, tmp_path / "out", "--tp", "1", "--tp-bf16", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert sorted(m["module"] for m in record["tensor_parallel"]["bf16"]) == [
        f"model.layers.0.self_attn.{m}" for m in ("k_proj", "q_proj", "v_proj")
    ]
    assert record["loaders"]["vLLM >= 0.32"]["verdict"] == "loads"


def test_tp_bf16_refuses_nan_codes_naming_the_weight(tmp_path: Path) -> None:
    src = narrow_heads(tmp_path / "src")
    q = "model.layers.0.self_attn.q_proj.weight"
    patch_bytes(src, q, {300 * 256 + 7: 0x7F, 5: 0xFF})  # two NaN codes in e4m3fn, in two block rows
    result = run_cli("convert", src, tmp_path / "out", "--tp", "8", "--tp-bf16")
    assert result.exit_code != 0 and f"weight '{q}' holds 2 NaN codes (0x7F/0xFF)" in result.output
    assert not (tmp_path / "out").exists()


def test_a_bf16_mlp_of_a_block_fp8_model_is_padded_and_verified(tmp_path: Path) -> None:
    """An MLP left in BF16 (`modules_to_not_convert`) is padded with the rest (config.json's size is the
    model's): its original region byte-identical, the padding zeros, and verify checks both (issue 48's mutation
    sample: verify's check of unquantized padded bytes had no test)."""
    reference = deepseek_dense(tmp_path / "reference")
    config = json.loads((reference / "config.json").read_text())
    p = "model.layers.0"
    attention = deepseek_attention(p)
    shapes = {"gate_proj": (4608, 256), "up_proj": (4608, 256), "down_proj": (256, 4608)}
    gen = torch.Generator().manual_seed(1)
    mlp_bf16 = {
        f"{p}.mlp.{n}.weight": (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes.items()
    }
    config["quantization_config"]["modules_to_not_convert"] = [f"{p}.mlp.{n}" for n in shapes]
    src, out = block_fp8_checkpoint(tmp_path / "src", config, attention, mlp_bf16), tmp_path / "out"
    assert run_cli("convert", src, out, "--tp", "32", "-q").exit_code == 0  # run_cli verifies it
    o = load_tensors(out)
    assert torch.equal(o[f"{p}.mlp.gate_proj.weight"][:4608], mlp_bf16[f"{p}.mlp.gate_proj.weight"])
    assert not o[f"{p}.mlp.gate_proj.weight"][4608:].any()
    assert torch.equal(o[f"{p}.mlp.down_proj.weight"][:, :4608], mlp_bf16[f"{p}.mlp.down_proj.weight"])
    patch_bytes(out, f"{p}.mlp.up_proj.weight", {2: 0x11})  # one byte of the original region changed
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "the original region is not SOURCE's bytes" in result.output

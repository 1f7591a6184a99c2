"""DeepSeek-V4 (issue 49): block FP8 whose scales are `<module>.scale` (F8_E8M0 powers of two beside FP4 experts,
F32 beside FP8 ones) and routed experts packed MXFP4 (`ffn.experts.E.wK.weight` I8, an E8M0 `.scale` per 32), as
DeepSeek ships it (`tests.builders.deepseek_v4`, from DeepSeek-V4-Flash's headers and config).

fp8fix reads it (inspect describes both parts; every row is cited or not judged: no loader's DeepSeek-V4 class is
run here), writes it unquantized (`--to bf16`: FP8 codes times their power of two and E2M1 times 2^(b - 127), both
exact in BF16, checked here with torch's e4m3fn and the OCP MX E2M1 table, not fp8fix's decoders), and converts its
FP8 part with the experts passed through byte for byte. Before, it was read as DeepSeek-V3's block FP8: every FP8
weight "without a scale", and three vLLM rows and transformers judged loads-wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.builders import deepseek_v4
from tests.conftest import load_tensors, run_cli
from tests.test_fp4_modules import E2M1, half_step_of

FP8_MODULES = ("attn.wq_a", "attn.wo_a", "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
EXPERTS = tuple(f"ffn.experts.{e}.w{k}" for e in range(2) for k in (1, 2, 3))


def fp8_values(tensors: dict[str, torch.Tensor], module: str, encoding: torch.dtype) -> torch.Tensor:
    """float64: each code as torch reads `encoding`, times its 128 x 128 block's scale (E8M0: 2^(b - 127))."""
    codes = tensors[f"{module}.weight"].view(encoding).to(torch.float64)
    scale = tensors[f"{module}.scale"]
    per = 2.0 ** (scale.view(torch.uint8).double() - 127) if scale.dtype == torch.float8_e8m0fnu else scale.double()
    per = per.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return codes * per[: codes.shape[0], : codes.shape[1]]


def expert_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """float64 [out, in]: E2M1 nibbles (the lower first) times 2^(b - 127) of their 32."""
    packed = tensors[f"{module}.weight"].view(torch.uint8)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    exponents = tensors[f"{module}.scale"].view(torch.uint8).double() - 127
    return torch.tensor(E2M1, dtype=torch.float64)[nibbles] * (2.0**exponents).repeat_interleave(32, dim=1)


def test_inspect_reads_both_parts_and_judges_no_row_it_does_not_run(tmp_path: Path) -> None:
    report = json.loads(run_cli("inspect", deepseek_v4(tmp_path / "v4"), "--json").output)
    assert "DeepSeek-V4" in report["format_label"] and report["convert_supported"]
    assert len(report["fp4_modules"]) == len(EXPERTS)
    kinds = {f["code"] for f in report["findings"]}
    assert not kinds & {"missing-scale", "unknown-scale-shape", "row-loads-wrong"}
    rows = {name: row["verdict"] for name, row in report["loaders"].items()}
    assert {rows["vLLM <= 0.5.0"], rows["vLLM 0.5.1 - 0.18"]} == {"fails"}  # (no DeepseekV4 class before 0.20)
    assert {v for k, v in rows.items() if k not in ("vLLM <= 0.5.0", "vLLM 0.5.1 - 0.18")} == {"not-judged"}


def test_to_bf16_writes_every_value_exactly(tmp_path: Path) -> None:
    src, out = deepseek_v4(tmp_path / "v4"), tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16").exit_code == 0  # (run_cli verifies every conversion)
    before, after = load_tensors(src), load_tensors(out)
    for module in FP8_MODULES:
        exact = fp8_values(before, f"layers.0.{module}", torch.float8_e4m3fn)
        got = after[f"layers.0.{module}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got.double(), exact), module  # exact: no rounding
    for module in EXPERTS:
        exact = expert_values(before, f"layers.0.{module}")
        got = after[f"layers.0.{module}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got.double(), exact), module
    assert not any(name.endswith(".scale") for name in after)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config  # its experts are no longer FP4
    rows = json.loads(run_cli("inspect", out, "--json").output)["loaders"]
    assert {row["verdict"] for name, row in rows.items() if name.startswith("vLLM >=")} == {"not-judged"}


@pytest.mark.parametrize("options", [["--to", "e4m3fnuz"], ["--dequantize", "layers.0.attn.*"], []])
def test_fp8_conversions_pass_the_experts_through(tmp_path: Path, options: list[str]) -> None:
    src, out = deepseek_v4(tmp_path / "v4"), tmp_path / "out"
    assert run_cli("convert", src, out, *options).exit_code == 0
    before, after = load_tensors(src), load_tensors(out)
    for module in EXPERTS:
        for leaf in ("weight", "scale"):
            name = f"layers.0.{module}.{leaf}"
            assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
    encoding = torch.float8_e4m3fnuz if "e4m3fnuz" in options else torch.float8_e4m3fn
    for module in FP8_MODULES:
        name = f"layers.0.{module}"
        if f"{name}.scale" in after:
            assert torch.equal(fp8_values(after, name, encoding), fp8_values(before, name, torch.float8_e4m3fn))
    config = json.loads((out / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["weight_block_size"] == [128, 128]


def test_the_fp8_expert_variant_is_block_fp8_with_f32_scales(tmp_path: Path) -> None:
    """V4-Flash-Base (`expert_dtype: fp8`): every module block FP8, every `.scale` F32; no FP4 module."""
    src = deepseek_v4(tmp_path / "v4", expert_dtype="fp8")
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert not report["fp4_modules"] and not {f["code"] for f in report["findings"]} & {"missing-scale"}
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16").exit_code == 0
    before, after = load_tensors(src), load_tensors(out)
    exact = fp8_values(before, "layers.0.ffn.experts.1.w2", torch.float8_e4m3fn)
    got = after["layers.0.ffn.experts.1.w2.weight"].double()
    assert torch.all((got - exact).abs() <= half_step_of(exact))  # F32 scales: rounded once to BF16


def test_conversions_that_would_redeclare_the_experts_are_refused(tmp_path: Path) -> None:
    """`--blocks mx` writes a compressed-tensors MXFP8 config, which says nothing of the MXFP4 experts."""
    src = deepseek_v4(tmp_path / "v4")
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "mx")
    assert result.exit_code == 3 and "FP4 module 'layers.0.ffn.experts.0.w1'" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4"]


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("no-scale", "has no scale 'layers.0.ffn.experts.0.w1.scale'"),
        ("scale-shape", "MXFP4 scale 'layers.0.ffn.experts.0.w1.scale' has shape [256, 4]"),
    ],
)
def test_a_damaged_expert_is_named_and_nothing_is_written(tmp_path: Path, damage: str, said: str) -> None:
    src = deepseek_v4(tmp_path / "v4")
    tensors = load_tensors(src)
    name = "layers.0.ffn.experts.0.w1.scale"
    if damage == "no-scale":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :4].contiguous()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and said in result.output, result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4"]

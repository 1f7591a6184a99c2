"""gpt-oss's MXFP4 experts (issue 49): OpenAI's release format (`quant_method: mxfp4`), each layer's routed experts
stacked as `<proj>_blocks` U8 [experts, out, in / 32, 16] and `<proj>_scales` E8M0 bytes [experts, out, in / 32],
built by `tests.builders.gpt_oss` from transformers' and vLLM's readers of it.

fp8fix reads them (inspect lists the experts, the rows say what the real loaders do:
tests/loaders/test_fp4_dialects_loads.py), writes them unquantized (`--to bf16` / `float16`) as transformers'
GptOssExperts holds them, [experts, in, out], and refuses every other conversion, and any misshapen expert, with
the tensor named. The values OUTPUT must hold come from test_fp4_modules' decoder (the OCP MX specification's E2M1
table, E8M0 2^(b - 127)), on the experts' bytes viewed as rows, each expert then transposed here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.builders import GPT_OSS_PROJECTIONS, gpt_oss
from tests.conftest import load_tensors, run_cli
from tests.test_fp4_modules import fp4_values


def expert_values(tensors: dict[str, torch.Tensor], param: str) -> torch.Tensor:
    """float64 [experts, in, out]: each element of gpt-oss's `param` (`...experts.gate_up_proj`) exactly."""
    blocks, scales = tensors[f"{param}_blocks"], tensors[f"{param}_scales"]
    experts, out, groups, _ = blocks.shape
    rows = {"w.weight_packed": blocks.reshape(experts * out, groups * 16), "w.weight_scale": scales.reshape(-1, groups)}
    return fp4_values(rows, "w").reshape(experts, out, groups * 32).transpose(1, 2)


def params(src: Path) -> list[str]:
    return [n.removesuffix("_blocks") for n in load_tensors(src) if n.endswith("_blocks")]


def test_inspect_lists_the_experts_and_judges_the_rows(tmp_path: Path) -> None:
    src = gpt_oss(tmp_path / "src", experts=4, hidden=64, intermediate=96)
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    assert report["format_label"] == "gpt-oss MXFP4 (experts)" and report["architecture_known"]
    found = {m["module"]: m for m in report["fp4_modules"]}
    assert set(found) == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in GPT_OSS_PROJECTIONS}
    gate_up = found["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up["scheme"] == "mxfp4" and gate_up["shape"] == [4, 192, 64] and gate_up["scale_shape"] == [4, 192, 2]
    assert found["model.layers.1.mlp.experts.down_proj"]["shape"] == [4, 64, 96]
    assert report["modules"] == []  # no FP8 module
    rows = {row: v["verdict"] for row, v in report["loaders"].items()}
    assert rows.pop("transformers") == "loads" and rows.pop("vLLM <= 0.5.0") == "fails"  # (gpt-oss: vLLM 0.10.1)
    assert set(rows.values()) == {"not-judged"}
    gate = [f for f in report["findings"] if f["code"] == "row-not-judged"]
    assert gate and gate[0]["fix"] == "--to bf16"
    assert run_cli("inspect", src, "--strict", "--target", "transformers").exit_code == 0
    text = run_cli("inspect", src).output
    assert "FP4 modules:  4" in text and "MXFP4" in text and "weight scale" not in text  # no empty FP8 table


@pytest.mark.parametrize("dtype", ["bf16", "float16"])
def test_to_bf16_writes_each_expert_transposed(tmp_path: Path, dtype: str) -> None:
    src = gpt_oss(tmp_path / "src", experts=3, hidden=64, intermediate=96, seed=1)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--to", dtype, "--json")  # (run_cli verifies the output too)
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(out)
    for param in params(src):
        exact, got = expert_values(before, param), after[param]
        assert got.shape == exact.shape and got.shape[1:] in ((64, 192), (96, 64))  # [experts, in, out]
        if dtype == "bf16":
            assert got.dtype == torch.bfloat16 and torch.equal(got.double(), exact)  # E2M1 x 2^k: exact in BF16
        else:
            assert got.dtype == torch.float16 and torch.equal(got, exact.to(torch.float16))  # rounded once
    kept = {n for n in before if not n.endswith(("_blocks", "_scales"))}
    assert set(after) == kept | set(params(src))
    assert all(torch.equal(after[n], before[n]) for n in kept)  # biases, attention, router: as they were
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    plan = json.loads(result.stdout)
    assert {m["scheme"] for m in plan["dequantized"]} == {"mxfp4"}
    assert {m["weight"] for m in plan["dequantized"]} == set(params(src))
    rows = {row: v["verdict"] for row, v in plan["loaders"].items()}
    assert rows.pop("vLLM <= 0.5.0") == "fails" and rows.pop("vLLM 0.5.1 - 0.18") == "not-judged"
    assert rows.pop("SGLang 0.5.23") == "not-judged"  # (its gpt-oss class is not run here)
    assert set(rows.values()) == {"loads"}


def test_the_bf16_output_has_the_loaders_values(tmp_path: Path) -> None:
    """What transformers computes with after dequantizing the source (integrations/mxfp4.py: lut[nibble], then
    ldexp by b - 127 in BF16, then each expert transposed), written out here by hand from that code's steps."""
    src = gpt_oss(tmp_path / "src", seed=2)
    assert run_cli("convert", src, tmp_path / "out", "--to", "bf16").exit_code == 0
    before, after = load_tensors(src), load_tensors(tmp_path / "out")
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    for param in params(src):
        blocks, scales = before[f"{param}_blocks"], before[f"{param}_scales"].to(torch.int32) - 127
        experts, out, groups, _ = blocks.shape
        values = torch.empty(experts, out, groups, 32, dtype=torch.bfloat16)
        values[..., 0::2] = lut.to(torch.bfloat16)[(blocks & 0x0F).long()]
        values[..., 1::2] = lut.to(torch.bfloat16)[(blocks >> 4).long()]
        values = torch.ldexp(values, scales[..., None]).to(torch.bfloat16)
        assert torch.equal(after[param], values.reshape(experts, out, -1).transpose(1, 2))


def test_verify_refuses_an_expert_not_transposed_or_changed(tmp_path: Path) -> None:
    src = gpt_oss(tmp_path / "src", hidden=64, intermediate=64)  # down_proj square: a layout slip keeps its shape
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16").exit_code == 0
    tensors = load_tensors(out)
    param = "model.layers.1.mlp.experts.down_proj"
    for damaged in (
        tensors[param].transpose(1, 2).contiguous(),
        tensors[param].clone().index_fill_(0, torch.tensor([2]), 0.5),
    ):
        save_file({**tensors, param: damaged}, str(out / "model.safetensors"), metadata={"format": "pt"})
        result = run_cli("verify", src, out, "--json")
        assert result.exit_code == 1
        problems = json.loads(result.stdout)["problems"]
        assert any(param in p for p in problems), problems


GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def damaged(tensors: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    """The experts' tensors of a gpt-oss made wrong as `case` says."""
    if case == "blocks-of-32-bytes":
        return {**tensors, f"{DOWN}_blocks": tensors[f"{DOWN}_blocks"].reshape(4, 64, 1, 32)}
    if case == "no-scales":
        return {k: v for k, v in tensors.items() if k != f"{GATE_UP}_scales"}
    return {**tensors, f"{GATE_UP}_scales": tensors[f"{GATE_UP}_scales"][:, :, :1].contiguous()}


@pytest.mark.parametrize(
    ("case", "named"),
    [("blocks-of-32-bytes", f"{DOWN}_blocks"), ("no-scales", GATE_UP), ("scales-misshapen", f"{GATE_UP}_scales")],
)
def test_a_misshapen_expert_is_refused_by_name(tmp_path: Path, case: str, named: str) -> None:
    src = gpt_oss(tmp_path / "src")
    save_file(damaged(load_tensors(src), case), str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    for args in (("inspect", src), ("convert", src, out, "--to", "bf16")):
        result = run_cli(*args)
        assert named in result.output and "Traceback" not in result.output, result.output
    assert result.exit_code == 3 and not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("args", [[], ["--blocks", "128x128"], ["--to", "e4m3fnuz"], ["--tp", "2"]])
def test_every_other_conversion_is_refused(tmp_path: Path, args: list[str]) -> None:
    src = gpt_oss(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", *args)
    assert result.exit_code == 3 and "--to bf16" in result.output, result.output
    assert "--blocks 128x128" not in result.output.replace(" ".join(args), "")  # (no re-blocking of stacked experts)
    assert not (tmp_path / "out").exists()


def test_an_e8m0_scale_bf16_cannot_hold_is_refused(tmp_path: Path) -> None:
    src = gpt_oss(tmp_path / "src")
    tensors = load_tensors(src)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    scales = tensors[name].clone()
    scales[2, 5, 1] = 255  # E8M0's NaN
    save_file({**tensors, name: scales}, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and "down_proj_scales" in result.output and "row 133" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_name_the_output_would_hold_twice_is_refused(tmp_path: Path) -> None:
    """SOURCE holding an unquantized `gate_up_proj` beside its blocks: two tensors of one name would be written."""
    src = gpt_oss(tmp_path / "src")
    tensors = load_tensors(src)
    tensors[GATE_UP] = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and f"'{GATE_UP}' twice" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_other_blocks_tensors_are_not_experts(tmp_path: Path) -> None:
    """Only the two projections the loaders read as MXFP4 are FP4 modules; another `*_blocks` tensor is copied."""
    src = gpt_oss(tmp_path / "src")
    extra = {"lm_head_blocks": torch.ones(1, 256, 2, 16, dtype=torch.uint8), "lm_head_scales": torch.ones(1, 256, 2)}
    save_file({**load_tensors(src), **extra}, str(src / "model.safetensors"), metadata={"format": "pt"})
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    assert len(report["fp4_modules"]) == 4
    assert run_cli("convert", src, tmp_path / "out", "--to", "bf16").exit_code == 0
    after = load_tensors(tmp_path / "out")
    assert all(torch.equal(after[n], t) for n, t in extra.items())

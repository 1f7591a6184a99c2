"""ModelOpt's MXFP8 (issue 49): `quant_algo: MXFP8` in config.json's quantization_config or hf_quant_config.json,
e4m3fn `weight` and an E8M0 `weight_scale` U8 [out, in / 32] per Linear, as vLLM's ModelOptMxFp8Config reads it
(tests/builders.modelopt_mxfp8).

fp8fix reads it as MXFP8 (inspect lists the modules; the rows are what tests/loaders/test_fp4_dialects_loads.py
measured), writes it unquantized (`--to bf16`, each value exactly code x 2^(b - 127), worked out here from the OCP
MX definition: torch's e4m3fn values times a power of two), writes it as 128 x 128 block FP8 (`--blocks 128x128`:
the tensors compressed-tensors' MXFP8 of the same weights gets, under the same compressed-tensors FP8_BLOCK config,
hf_quant_config.json left behind) and refuses every other conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import llama, modelopt_mxfp8, mxfp8_compressed_tensors, phi3
from tests.conftest import load_tensors, run_cli


@pytest.mark.parametrize("side_file", [False, True], ids=["config-json", "hf-quant-config"])
def test_inspect_reads_it_and_judges_its_rows(tmp_path: Path, side_file: bool) -> None:
    src = modelopt_mxfp8(tmp_path / "src", side_file=side_file)
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    assert report["format_label"] == "NVIDIA ModelOpt MXFP8" and len(report["modules"]) == 14
    assert {m["scale"] for m in report["modules"]} == {"block"}
    rows = {row: v["verdict"] for row, v in report["loaders"].items()}
    assert rows.pop("transformers") == "loads-wrong"  # no ModelOpt quantizer: raw codes (measured)
    assert set(rows.values()) == {"not-judged"}  # vLLM and SGLang: Blackwell kernels, not run here
    assert run_cli("inspect", src, "--strict", "--target", "transformers").exit_code == 1


@pytest.mark.parametrize("side_file", [False, True], ids=["config-json", "hf-quant-config"])
def test_to_bf16_writes_every_value_exactly(tmp_path: Path, side_file: bool) -> None:
    src = modelopt_mxfp8(tmp_path / "src", phi3(), side_file=side_file)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--to", "bf16", "--json")  # (run_cli verifies the output too)
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(out)
    weights = [n for n, t in before.items() if t.dtype == torch.float8_e4m3fn]
    assert weights
    for name in weights:
        scale = before[name.removesuffix("weight") + "weight_scale"]
        powers = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
        assert torch.equal(after[name].double(), before[name].double() * powers), name
    assert not [n for n in after if n.endswith("scale")]
    assert not (out / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert {row["verdict"] for row in json.loads(result.stdout)["loaders"].values()} == {"loads"}


@pytest.mark.parametrize("args", [[], ["--to", "e4m3fnuz"]])
def test_other_conversions_are_refused(tmp_path: Path, args: list[str]) -> None:
    result = run_cli("convert", modelopt_mxfp8(tmp_path / "src"), tmp_path / "out", *args)
    assert result.exit_code == 3 and "--to bf16" in result.output and "ModelOpt MXFP8" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("side_file", [False, True], ids=["config-json", "hf-quant-config"])
@pytest.mark.parametrize("make", [llama, phi3], ids=["llama", "phi3"])
def test_blocks_128_writes_what_compressed_tensors_mxfp8_gets(tmp_path: Path, side_file: bool, make) -> None:  # type: ignore[no-untyped-def]
    """The same MXFP8 weights under ModelOpt's config and compressed-tensors' (tests/test_mx_formats.py checks
    the latter's values against an independent re-blocking) come out the same: every tensor, and config.json's
    quantization_config (FP8_BLOCK, `ignore` the Linear modules without FP8 weights); ModelOpt's side config is not
    copied (it would say MXFP8 of block-FP8 weights). run_cli verifies each."""
    modelopt = modelopt_mxfp8(tmp_path / "modelopt", make(), side_file=side_file)
    ct = mxfp8_compressed_tensors(tmp_path / "ct", make())
    outputs = {}
    for name, src in (("modelopt", modelopt), ("ct", ct)):
        result = run_cli("convert", src, tmp_path / f"{name}-out", "--blocks", "128x128", "--json")
        assert result.exit_code == 0, result.output
        outputs[name] = json.loads(result.stdout)
    a, b = load_tensors(tmp_path / "modelopt-out"), load_tensors(tmp_path / "ct-out")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    configs = [json.loads((tmp_path / f"{n}-out" / "config.json").read_text()) for n in ("modelopt", "ct")]
    qc = configs[0]["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"] == configs[1]["quantization_config"]["config_groups"]["group_0"]
    assert not (tmp_path / "modelopt-out" / "hf_quant_config.json").exists()
    assert outputs["modelopt"]["loaders"] == outputs["ct"]["loaders"]
    assert outputs["modelopt"]["reblocked"] == outputs["ct"]["reblocked"]


def test_blocks_128_refuses_an_excluded_mx_module(tmp_path: Path) -> None:
    src = modelopt_mxfp8(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "128x128")
    assert result.exit_code == 3 and "model.layers.0.mlp.down_proj" in result.output, result.output
    assert not (tmp_path / "out").exists()

"""ModelOpt's MXFP8 (issue 49): `quant_algo: MXFP8` in config.json's quantization_config or hf_quant_config.json,
e4m3fn `weight` and an E8M0 `weight_scale` U8 [out, in / 32] per Linear, as vLLM's ModelOptMxFp8Config reads it
(tests/builders.modelopt_mxfp8).

fp8fix reads it as MXFP8 (inspect lists the modules; the rows are what tests/loaders/test_fp4_dialects_loads.py
measured), writes it unquantized (`--to bf16`, each value exactly code x 2^(b - 127), worked out here from the OCP
MX definition: torch's e4m3fn values times a power of two) and refuses every other conversion, `--blocks 128x128`
included (its block-FP8 config is compressed-tensors', which a ModelOpt source does not have yet)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import modelopt_mxfp8, phi3
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


@pytest.mark.parametrize("args", [[], ["--blocks", "128x128"], ["--to", "e4m3fnuz"]])
def test_other_conversions_are_refused(tmp_path: Path, args: list[str]) -> None:
    result = run_cli("convert", modelopt_mxfp8(tmp_path / "src"), tmp_path / "out", *args)
    assert result.exit_code == 3 and "--to bf16" in result.output and "ModelOpt MXFP8" in result.output
    assert not (tmp_path / "out").exists()

"""ModelOpt's NVFP4 (issue 49): `quant_algo: NVFP4` in hf_quant_config.json (or config.json's quantization_config),
every quantized Linear packed E2M1 in its own `weight` (U8 [out, in / 2]), an e4m3 `weight_scale` per 16 and an F32
`weight_scale_2` that multiplies them, built by `tests.builders.modelopt_nvfp4` from the names vLLM's
ModelOptNvFp4Config reads.

fp8fix reads them (inspect lists the modules; the rows are what tests/loaders/test_fp4_dialects_loads.py measured
or what vLLM's and SGLang's source say of differing weight_scale_2), writes them unquantized (`--to bf16` /
`float16`) and refuses an NVFP4 config over FP8 weights. The values OUTPUT must hold are worked out here: the
nibbles (the lower first) through the OCP MX E2M1 table, times the e4m3 scale and scale_2 in float64 (exact: 4 + 2
+ 24 significant bits), rounded once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.builders import llama, modelopt_nvfp4, phi3
from tests.conftest import load_tensors, run_cli
from tests.test_fp4_modules import E2M1, assert_bf16_of


def modelopt_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """float64 [out, in]: e2m1 x weight_scale x weight_scale_2 of each element of ModelOpt NVFP4 `module`."""
    packed = tensors[f"{module}.weight"]
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    scales = tensors[f"{module}.weight_scale"].to(torch.float64).repeat_interleave(16, dim=1)
    return torch.tensor(E2M1, dtype=torch.float64)[nibbles] * scales * tensors[f"{module}.weight_scale_2"].double()


def modules(src: Path) -> list[str]:
    return [n.removesuffix(".weight") for n, t in load_tensors(src).items() if t.dtype == torch.uint8]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-scale-2", "own-scale-2"])
def test_inspect_reads_modelopt_nvfp4_and_judges_its_rows(tmp_path: Path, shared: bool) -> None:
    src = modelopt_nvfp4(tmp_path / "src", shared_global=shared)
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    assert report["format_label"] == "NVIDIA ModelOpt NVFP4" and report["modules"] == []
    found = {m["module"]: m for m in report["fp4_modules"]}
    assert set(found) == set(modules(src)) and len(found) == 14
    assert all(m["scheme"] == "nvfp4" and m["global_scale"] for m in found.values())
    assert found["model.layers.0.mlp.down_proj"]["shape"] == [64, 128]
    rows = {row: v["verdict"] for row, v in report["loaders"].items()}
    assert rows.pop("transformers") == "fails"  # no ModelOpt quantizer (measured)
    differ = "loads-wrong" if not shared else "not-judged"  # weight_scale_2 of packed modules: the largest (cited)
    assert rows.pop("SGLang 0.5.23") == differ
    assert {rows.pop(r) for r in ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32")} == {differ}
    assert set(rows.values()) == {"not-judged"}
    gate = [f for f in report["findings"] if f["fix"] == "--to bf16"]
    assert gate and run_cli("inspect", src, "--strict").exit_code == 1


@pytest.mark.parametrize("dtype", ["bf16", "float16"])
@pytest.mark.parametrize("make", [llama, phi3], ids=["llama", "phi3"])
def test_to_bf16_writes_each_value_rounded_once(tmp_path: Path, dtype: str, make) -> None:  # type: ignore[no-untyped-def]
    src = modelopt_nvfp4(tmp_path / "src", make(), shared_global=False)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--to", dtype, "--json")  # (run_cli verifies the output too)
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(out)
    for module in modules(src):
        exact, got = modelopt_values(before, module), after[f"{module}.weight"]
        if dtype == "bf16":
            assert_bf16_of(got, exact)
        else:
            assert got.dtype == torch.float16 and torch.equal(got, exact.to(torch.float16)), module
    assert not [n for n in after if "scale" in n]
    assert all(torch.equal(after[n], t) for n, t in before.items() if t.dtype == torch.bfloat16)
    assert not (out / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plan = json.loads(result.stdout)
    assert {m["scheme"] for m in plan["dequantized"]} == {"nvfp4"}
    assert {row["verdict"] for row in plan["loaders"].values()} == {"loads"}


def test_config_json_says_it_too(tmp_path: Path) -> None:
    """Newer ModelOpt exports say it in config.json (quant_method modelopt, quant_algo NVFP4), as vLLM reads too."""
    src = modelopt_nvfp4(tmp_path / "src")
    (src / "hf_quant_config.json").unlink()
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    assert json.loads(run_cli("inspect", src, "--json").stdout)["format_label"] == "NVIDIA ModelOpt NVFP4"
    assert run_cli("convert", src, tmp_path / "out", "--to", "bf16").exit_code == 0


@pytest.mark.parametrize("drop", ["weight_scale_2", "weight_scale"])
def test_a_missing_scale_is_refused_by_name(tmp_path: Path, drop: str) -> None:
    src = modelopt_nvfp4(tmp_path / "src")
    tensors = load_tensors(src)
    del tensors[f"model.layers.1.self_attn.k_proj.{drop}"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and "model.layers.1.self_attn.k_proj.weight" in result.output, result.output
    assert drop in result.output and not (tmp_path / "out").exists()


def test_other_conversions_are_refused(tmp_path: Path) -> None:
    src = modelopt_nvfp4(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz")
    assert result.exit_code == 3 and "--to bf16" in result.output and not (tmp_path / "out").exists()

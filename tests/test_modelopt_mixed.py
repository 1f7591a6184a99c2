"""ModelOpt MIXED_PRECISION (issue 49): per-tensor FP8 layers beside NVFP4 ones, each named with its recipe in
hf_quant_config.json's `quantized_layers` (vLLM 0.32 modelopt.py ModelOptMixedPrecisionConfig), built by
`tests.builders.modelopt_mixed` with ModelOpt's tensor names.

fp8fix reads it (the map checked against the tensors: a module the map names otherwise, or not at all, is refused),
judges no row it does not run, writes it unquantized (`--to bf16`: FP8 codes x scale and e2m1 x scale x scale_2,
each rounded once, worked out here from SOURCE's bytes with torch's e4m3fn and the OCP MX E2M1 table) and passes
the NVFP4 layers through FP8 conversions; a layout that would unfuse a module the map names is not chosen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import llama, modelopt_mixed, phi3
from tests.conftest import load_tensors, run_cli
from tests.test_fp4_modules import assert_bf16_of
from tests.test_modelopt_nvfp4 import modelopt_values

#: FP8 attention beside NVFP4 MLP (a Llama: nothing fused on disk)
LLAMA = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "fp8"),
    **dict.fromkeys(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), "nvfp4"),
}
#: Phi-3: FP8 qkv_proj / o_proj (fused on disk) beside NVFP4 gate_up_proj / down_proj
PHI3 = {"qkv_proj": "fp8", "o_proj": "fp8", "gate_up_proj": "nvfp4", "down_proj": "nvfp4"}


def quantization(src: Path) -> dict[str, object]:
    return json.loads((src / "hf_quant_config.json").read_text())["quantization"]


def test_inspect_reads_both_parts_and_judges_no_row(tmp_path: Path) -> None:
    src = modelopt_mixed(tmp_path / "src", LLAMA)
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    assert "MIXED_PRECISION" in report["format_label"]
    assert len(report["fp4_modules"]) == 6 and all(m["scheme"] == "nvfp4" for m in report["fp4_modules"])
    assert {row["verdict"] for row in report["loaders"].values()} == {"not-judged"}
    assert all("MIXED_PRECISION" in row["reason"] for row in report["loaders"].values())


@pytest.mark.parametrize(("make", "schemes"), [(llama, LLAMA), (phi3, PHI3)], ids=["llama", "phi3"])
def test_to_bf16_writes_each_value_rounded_once(tmp_path: Path, make, schemes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    src, out = modelopt_mixed(tmp_path / "src", schemes, make()), tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16").exit_code == 0  # (run_cli verifies it)
    before, after = load_tensors(src), load_tensors(out)
    layers = quantization(src)["quantized_layers"]
    assert isinstance(layers, dict)
    for module, recipe in layers.items():
        if recipe["quant_algo"] == "FP8":
            exact = before[f"{module}.weight"].to(torch.float64) * before[f"{module}.weight_scale"].double()
        else:
            exact = modelopt_values(before, module)
        assert_bf16_of(after[f"{module}.weight"], exact)
    assert not (out / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_fp8_conversions_pass_the_nvfp4_layers_and_the_map_through(tmp_path: Path) -> None:
    src, out = modelopt_mixed(tmp_path / "src", LLAMA), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "unfused").exit_code == 0
    before, after = load_tensors(src), load_tensors(out)
    for module in (m for m, r in quantization(src)["quantized_layers"].items() if r["quant_algo"] == "NVFP4"):
        for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            name = f"{module}.{leaf}"
            assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name
    assert quantization(out) == quantization(src)


def test_a_layout_that_would_unfuse_a_mapped_module_is_not_chosen_and_refused_when_asked(tmp_path: Path) -> None:
    """`quantized_layers` names Phi-3's fused qkv_proj: unfused, its shards would be named by nothing (vLLM then
    leaves them unquantized). The default keeps it fused; asking for unfused is refused, writing nothing."""
    src = modelopt_mixed(tmp_path / "src", PHI3, phi3())
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 0 and "layout:  fused" in result.output, result.output
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_tensors(tmp_path / "out")
    refused = run_cli("convert", src, tmp_path / "unfused", "--layout", "unfused")
    assert refused.exit_code == 3 and "quantized_layers naming it" in refused.output, refused.output
    assert not (tmp_path / "unfused").exists()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"model.layers.0.self_attn.q_proj": {"quant_algo": "NVFP4", "group_size": 16}}, "names it NVFP4"),
        ({"model.layers.0.mlp.up_proj": None}, "does not name it"),
        ({"model.layers.0.mlp.up_proj": {"quant_algo": "W4A8_AWQ"}}, "not supported yet"),
    ],
)
def test_a_map_that_does_not_match_the_weights_is_refused(
    tmp_path: Path, change: dict[str, dict[str, object] | None], said: str
) -> None:
    src = modelopt_mixed(tmp_path / "src", LLAMA)
    data = json.loads((src / "hf_quant_config.json").read_text())
    for module, recipe in change.items():
        if recipe is None:
            del data["quantization"]["quantized_layers"][module]
        else:
            data["quantization"]["quantized_layers"][module] = recipe
    (src / "hf_quant_config.json").write_text(json.dumps(data))
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and said in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_packed_nvfp4_layers_whose_scale_2_differ_load_wrong_in_vllm(tmp_path: Path) -> None:
    """gate / up NVFP4 with each its own weight_scale_2: vLLM 0.32 builds MIXED_PRECISION's NVFP4 layers with
    ModelOpt NVFP4's linear method, which multiplies the packed layer by the largest (cited); `--to bf16` fixes it."""
    src = modelopt_mixed(tmp_path / "src", LLAMA, shared_global=False)
    report = json.loads(run_cli("inspect", src, "--json").stdout)
    rows = {name: row["verdict"] for name, row in report["loaders"].items()}
    assert rows.pop("vLLM >= 0.32") == "loads-wrong"
    assert set(rows.values()) == {"not-judged"}
    wrong = [f for f in report["findings"] if f["code"] == "row-loads-wrong"]
    assert wrong and wrong[0]["fix"] == "--to bf16", wrong
    shared = json.loads(run_cli("inspect", modelopt_mixed(tmp_path / "shared", LLAMA), "--json").stdout)
    assert shared["loaders"]["vLLM >= 0.32"]["verdict"] == "not-judged"


def test_mixed_precision_without_its_map_is_refused(tmp_path: Path) -> None:
    """vLLM refuses MIXED_PRECISION without `quantized_layers`; fp8fix names what is missing (exit 3)."""
    src = modelopt_mixed(tmp_path / "src", LLAMA)
    data = json.loads((src / "hf_quant_config.json").read_text())
    del data["quantization"]["quantized_layers"]
    (src / "hf_quant_config.json").write_text(json.dumps(data))
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and "needs `quantized_layers`" in result.output, result.output
    assert not (tmp_path / "out").exists()

"""A quantization format fp8fix does not read yet (issue 49: ModelOpt's mixed precision, Quark's MX) is never
judged with the FP8 rules: here NVIDIA ModelOpt's MIXED_PRECISION over MXFP8 tensors (E8M0 scales [out, in / 32] as
U8 beside e4m3fn weights, as ModelOpt exports them), whose scales are no scale of a shape its layer does not have.
Every row is not judged, no finding calls the scales malformed, the gate, the findings and the rows say the same,
and convert refuses it (exit 3) writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

from tests.builders import Model, modelopt_mxfp8, phi3
from tests.conftest import load_tensors, run_cli


def modelopt_mixed(root: Path, model: Model | None = None) -> Path:
    """ModelOpt's MXFP8 tensors under a MIXED_PRECISION config whose `quantized_layers` say MXFP8 for each (fp8fix
    reads ModelOpt's per-layer map for FP8 and NVFP4 layers only)."""
    modelopt_mxfp8(root, model)
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "MIXED_PRECISION"
    modules = [n.removesuffix(".weight_scale") for n in load_tensors(root) if n.endswith(".weight_scale")]
    config["quantization_config"]["quantized_layers"] = {m: {"quant_algo": "MXFP8"} for m in modules}
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_an_unread_mx_checkpoint_is_not_judged_by_the_fp8_rules(tmp_path: Path) -> None:
    src = modelopt_mixed(tmp_path / "mxfp8")
    report = json.loads(run_cli("inspect", src, "--json").output)
    rows = report["loaders"]
    assert rows and {row["verdict"] for row in rows.values()} == {"not-judged"}
    assert all("does not read yet" in row["reason"] for row in rows.values())
    kinds = {f["code"] for f in report["findings"]}
    assert not kinds & {"unknown-scale-shape", "missing-scale", "row-fails"}
    assert "ModelOpt MIXED_PRECISION" in json.dumps(report["format_label"]) and not report["convert_supported"]
    # the gate: a target row not judged fails --strict, and a finding names each such row
    strict = run_cli("inspect", src, "--strict")
    assert strict.exit_code == 1
    assert "row-not-judged" in strict.output


def test_convert_refuses_it_and_writes_nothing(tmp_path: Path) -> None:
    src = modelopt_mixed(tmp_path / "mxfp8")
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3
    assert "ModelOpt MIXED_PRECISION" in result.output and "not supported yet" in result.output
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mxfp8"]


def test_an_mx_phi3_with_fused_modules_is_not_judged_either(tmp_path: Path) -> None:
    """Fused qkv_proj / gate_up_proj: MX scales are per row, no single-scale finding applies."""
    report = json.loads(run_cli("inspect", modelopt_mixed(tmp_path / "phi3", phi3()), "--json").output)
    assert {row["verdict"] for row in report["loaders"].values()} == {"not-judged"}
    assert not {f["code"] for f in report["findings"]} & {"single-scale-fused", "per-shard-scales-on-fused"}

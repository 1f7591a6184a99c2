"""inspect: each finding appears for a fixture that has it and not for one that does not; loaders; --strict."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import patch_bytes, read_raw_header, run_cli, shard_files, write_raw

DOWN = "model.layers.0.mlp.down_proj"

# (vLLM <= 0.5.0, vLLM 0.5.1 - 0.18, vLLM 0.19 and later, transformers) for these AutoFP8 (quant_method fp8)
# checkpoints, written out by hand: the vLLM columns from ../shared/reference/fp8-checkpoints.md,
# section 2a (vLLM 0.19 - 0.20, 0.21 - 0.31 and >= 0.32 also run for real in tests/loaders: per-tensor Phi-3 loading
# did not change between them); transformers as run for real in tests/loaders: 5.x reads only weight_scale_inv
# for quant_method fp8, so every layout computes with the raw codes.
#: Per loader row: vLLM <= 0.5.0, 0.5.1 - 0.18, 0.20, 0.21 - 0.31, >= 0.32, >= 0.32 on ROCm (AutoFP8 e4m3fn: as on
#: CUDA), SGLang 0.5.23, transformers.
EXPECTED_LOADS = {
    "single-scale fused": ("fails", "loads", "loads", "loads", "loads", "loads", "loads", "loads-wrong"),
    "per-shard": ("loads", "fails", "fails", "fails", "fails", "fails", "fails", "loads-wrong"),
    "unfused": ("loads", "loads", "loads", "loads", "loads", "loads", "loads", "loads-wrong"),
}


def inspect(path: Path, *args: str) -> dict:
    result = run_cli("inspect", path, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def codes(report: dict) -> set[str]:
    return {f["code"] for f in report["findings"]}


def loads(report: dict) -> tuple[str, ...]:
    verdicts = tuple(row["verdict"] for row in report["loaders"].values())
    assert all(row["loads"] == (row["verdict"] == "loads") for row in report["loaders"].values())
    return verdicts


def set_scale(src: Path, name: str, value: float) -> None:
    patch_bytes(src, name, dict(enumerate(struct.pack("<f", value))))


def test_report_describes_the_checkpoint(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors", scale="channel")
    report = inspect(src)
    assert report["schema_version"] == 2
    assert report["format"] == "compressed-tensors" and report["convert_supported"]
    assert report["architecture"] == "Phi3ForCausalLM" and report["encoding"] == "e4m3fn"
    assert [f["name"] for f in report["files"]] == sorted(set(shard_files(src).values()))
    modules = {m["module"]: m for m in report["modules"]}
    assert len(modules) == 8
    qkv = modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv["fused"] == "self_attn.qkv_proj" and qkv["shards"] == 3
    assert qkv["scale"] == "channel" and qkv["scale_dtype"] == "BF16" and qkv["scale_shape"] == [128, 1]
    assert qkv["input_scale"] == "static"
    assert len(report["kv_cache_scales"]) == 4
    text = run_cli("inspect", src).output
    assert "Phi3ForCausalLM" in text and "model.layers.{0,1}.self_attn.qkv_proj" in text


def test_single_scale_fused_finding_and_loaders(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    report = inspect(src)
    finding = next(f for f in report["findings"] if f["code"] == "single-scale-fused")
    # the fix for vLLM <= 0.5.0, the only loader with this problem: Phi-3's per-shard names (issue 27: it
    # suggested the default conversion, which keeps one scale)
    assert finding["fix"] == "--layout unfused" and len(finding["modules"]) == 4 and not finding["default_target"]
    assert loads(report) == EXPECTED_LOADS["single-scale fused"]
    assert run_cli("inspect", src, "--strict").exit_code == 1  # raw codes in transformers, which convert fixes
    # converted as suggested (convert's own choice), the checkpoint passes the CI gate
    assert run_cli("convert", src, tmp_path / "out", "-q").exit_code == 0
    fixed = inspect(tmp_path / "out")
    assert not [f for f in fixed["findings"] if f["fix"] and f["default_target"]]
    # compressed-tensors, fused
    assert loads(fixed) == ("fails", "loads", "loads", "loads", "loads", "loads", "loads", "loads")
    assert run_cli("inspect", tmp_path / "out", "--strict").exit_code == 0
    # unfused (AutoFP8 kept): what vLLM <= 0.5.0 needs too
    assert run_cli("convert", src, tmp_path / "unfused", "--layout", "unfused", "-q").exit_code == 0
    assert loads(inspect(tmp_path / "unfused")) == EXPECTED_LOADS["unfused"]


def test_per_shard_finding_and_loaders(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), scale="shard")
    report = inspect(src)
    assert "per-shard-scales-on-fused" in codes(report) and "single-scale-fused" not in codes(report)
    assert loads(report) == EXPECTED_LOADS["per-shard"]
    assert run_cli("convert", src, tmp_path / "fused", "--layout", "fused", "-q").exit_code == 0
    fused = inspect(tmp_path / "fused")
    assert "per-shard-scales-on-fused" not in codes(fused)
    assert loads(fused) == EXPECTED_LOADS["single-scale fused"]
    assert run_cli("convert", src, tmp_path / "per-shard", "--layout", "per-shard", "-q").exit_code == 0
    assert loads(inspect(tmp_path / "per-shard")) == EXPECTED_LOADS["per-shard"]


def test_nan_codes_need_the_data(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert "nan-codes" not in codes(inspect(src, "--scan-data"))
    patch_bytes(src, DOWN + ".weight", {0: 0x7F, 1: 0x80})
    assert "nan-codes" not in codes(inspect(src))  # headers only
    report = inspect(src, "--scan-data")
    finding = next(f for f in report["findings"] if f["code"] == "nan-codes")
    assert finding["modules"] == [DOWN] and finding["fix"] is None


def test_fnuz_data_under_an_fn_label_is_a_heuristic(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert run_cli("convert", src, tmp_path / "fnuz", "--to", "e4m3fnuz", "-q").exit_code == 0
    fnuz = tmp_path / "fnuz"
    assert "e4m3fnuz-for-vllm" in codes(inspect(fnuz))
    name = "model.layers.0.self_attn.o_proj.weight"
    patch_bytes(fnuz, name, {7: 0x7F})  # +240 in e4m3fnuz: an exporter's maximum
    path = fnuz / shard_files(fnuz)[name]
    header, data = read_raw_header(path)
    header[name]["dtype"] = "F8_E4M3"  # mislabelled as e4m3fn
    write_raw(path, header, data)
    report = inspect(fnuz, "--scan-data")
    finding = next(f for f in report["findings"] if f["code"] == "fnuz-data-under-fn-label")
    assert finding["heuristic"] and finding["modules"] == [name.rsplit(".", 1)[0]]
    assert "fnuz-data-under-fn-label" not in codes(inspect(src, "--scan-data"))


@pytest.mark.parametrize("value", [0.0, -0.5, float("inf"), float("nan")])
def test_bad_scale_values(tmp_path: Path, value: float) -> None:
    src = build(tmp_path / "src", phi3())
    assert "bad-scale-value" not in codes(inspect(src))
    set_scale(src, DOWN + ".weight_scale", value)
    report = inspect(src)
    finding = next(f for f in report["findings"] if f["code"] == "bad-scale-value")
    assert finding["modules"] == [DOWN]


def test_tiny_scales_warn_about_float16_requantization(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert "tiny-scale" not in codes(inspect(src))
    set_scale(src, DOWN + ".weight_scale", 1e-6)
    assert next(f for f in inspect(src)["findings"] if f["code"] == "tiny-scale")["modules"] == [DOWN]


def test_tiny_per_channel_scales_are_not_flagged(tmp_path: Path) -> None:
    """vLLM requantizes only per-tensor (and per-shard) scales through float16; per-channel scales are
    used as they are (issue 11, item 9), so a tiny one loses nothing."""
    src = build(tmp_path / "src", phi3(), fmt="quark", scale="channel")  # F32 [out] scales
    set_scale(src, DOWN + ".weight_scale", 1e-6)
    report = inspect(src)
    assert next(m for m in report["modules"] if m["module"] == DOWN)["scale"] == "channel"
    assert "tiny-scale" not in codes(report)


def test_missing_scale(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), files=1)
    path = src / "model.safetensors"
    header, data = read_raw_header(path)
    header[DOWN + ".scale_renamed"] = header.pop(DOWN + ".weight_scale")
    write_raw(path, header, data)
    report = inspect(src)
    assert next(f for f in report["findings"] if f["code"] == "missing-scale")["modules"] == [DOWN]
    # measured with vLLM 0.19, 0.20, 0.21, 0.31, 0.32 and transformers (tests/loaders/test_damaged_scales.py): all
    # compute with a wrong scale, silently; the vLLMs before 0.20 are not run
    verdicts = {row: v["verdict"] for row, v in report["loaders"].items()}
    assert verdicts == {
        "vLLM <= 0.5.0": "not-judged",
        "vLLM 0.5.1 - 0.18": "not-judged",
        "vLLM 0.19 - 0.20": "loads-wrong",
        "vLLM 0.21 - 0.31": "loads-wrong",
        "vLLM >= 0.32": "loads-wrong",
        "vLLM >= 0.32 on ROCm": "loads-wrong",
        "SGLang 0.5.23": "loads-wrong",
        "transformers": "loads-wrong",
    }


def test_unsupported_formats_are_described_not_refused(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"].update(quant_method="compressed-tensors", format="pack-quantized")
    (src / "config.json").write_text(json.dumps(config))
    report = inspect(src)
    assert report["convert_supported"] is False
    assert "pack-quantized" in report["format_label"]


def test_inspect_bad_input_names_the_folder(tmp_path: Path) -> None:
    result = run_cli("inspect", tmp_path / "nothing")  # a local path that does not exist: a usage error
    assert result.exit_code == 2 and f"SOURCE {tmp_path / 'nothing'}: no such folder" in result.output
    (tmp_path / "empty").mkdir()
    result = run_cli("inspect", tmp_path / "empty")
    assert result.exit_code == 3 and f"SOURCE {tmp_path / 'empty'}: config.json: missing" in result.output

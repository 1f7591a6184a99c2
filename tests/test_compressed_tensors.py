"""--format compressed-tensors: an AutoFP8 checkpoint described as compressed-tensors, same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import load_tensors, raw, run_cli

CT = ("--format", "compressed-tensors")


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scale,static", [("tensor", True), ("tensor", False), ("channel", True)])
def test_config_follows_the_autofp8_one(tmp_path: Path, scale: str, static: bool) -> None:
    src = build(tmp_path / "src", phi3(), scale=scale, static_input=static, ignore=["lm_head"])
    assert run_cli("convert", src, tmp_path / "out", *CT, "-q").exit_code == 0
    qc = config_of(tmp_path / "out")
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["weights"]["strategy"] == scale
    assert group["weights"]["type"] == "float" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["dynamic"] is (not static)
    assert qc["ignore"] == ["lm_head"] and "kv_cache_scheme" in qc  # the builder writes k_scale / v_scale
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    assert set(o) == set(s)
    for name, t in s.items():
        assert raw(o[name]) == raw(t), name  # every byte kept
        assert o[name].shape == (t.shape if t.numel() != 1 or t.dim() else (1,)), name


def test_legacy_names_become_todays(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="fp8-legacy")
    assert run_cli("convert", src, tmp_path / "out", *CT, "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    attn = "model.layers.0.self_attn."
    assert raw(o[attn + "k_scale"]) == raw(o[attn + "v_scale"]) == raw(s[attn + "kv_scale"])
    assert raw(o[attn + "qkv_proj.input_scale"]) == raw(s[attn + "qkv_proj.act_scale"])
    assert not [n for n in o if n.endswith((".act_scale", ".kv_scale"))]


def test_refused_where_it_cannot_be_said(tmp_path: Path) -> None:
    per_shard = build(tmp_path / "shard", phi3(), scale="shard")
    result = run_cli("convert", per_shard, tmp_path / "out", "--layout", "per-shard", *CT)
    assert result.exit_code == 3 and "compressed-tensors output needs" in result.output
    assert run_cli("convert", per_shard, tmp_path / "fused", "--layout", "fused", *CT, "-q").exit_code == 0
    ct = build(tmp_path / "ct", phi3(), fmt="compressed-tensors")
    assert run_cli("convert", ct, tmp_path / "out2", *CT).exit_code == 3
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_verify_catches_a_config_that_claims_another_strategy(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert run_cli("convert", src, tmp_path / "out", *CT, "-q").exit_code == 0
    path = tmp_path / "out" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    path.write_text(json.dumps(config))
    result = run_cli("verify", src, tmp_path / "out")
    assert result.exit_code == 1 and "config.json" in result.output

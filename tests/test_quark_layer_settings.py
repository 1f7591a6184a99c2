"""Quark's `layer_quant_config`: per-module settings keyed by module-name patterns (issue 48, config semantics).

vLLM reads a key with `*` as an fnmatch pattern and any other key as text the module name must be part of
(vllm 0.32 quantization/quark/quark.py, get_layer_quant_config_from_name). The unfused layout renames fused
modules: a key naming one would name nothing in OUTPUT, and the loader would fall back to the global settings
without a word. Before this, convert copied such a key and verify passed the output (exit 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fp8fix.registry.formats import matches
from tests.builders import build, phi3
from tests.conftest import run_cli


def quark_phi3(root: Path, layer_settings: dict[str, Any] | None) -> Path:
    """A Quark Phi-3 (fused qkv_proj / gate_up_proj) whose layer_quant_config is `layer_settings`, each key set
    to a copy of the global settings with dynamic input activations (settings that differ from the global)."""
    src = build(root, phi3(), fmt="quark", kv_scales=False)
    set_layer_settings(src, layer_settings)
    return src


def set_layer_settings(folder: Path, keys: dict[str, Any] | None) -> None:
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    dynamic = json.loads(json.dumps(qc["global_quant_config"]))
    dynamic["input_tensors"]["is_dynamic"] = True
    qc["layer_quant_config"] = {k: dynamic if v is None else v for k, v in (keys or {}).items()}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("key", ["*qkv_proj", "model.layers.1.self_attn.qkv_proj", "*mlp.gate_up*"])
def test_unfusing_a_module_a_layer_setting_names_is_refused(tmp_path: Path, key: str) -> None:
    src = quark_phi3(tmp_path / "src", {key: None})
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q")
    assert result.exit_code == 3, result.output
    assert f"quantization_config.layer_quant_config sets '{key}', which names the fused module" in result.output
    assert "--layout per-shard or --layout fused" in result.output
    assert not (tmp_path / "out").exists()


def test_a_layer_setting_of_a_module_no_rename_touches_is_kept_and_verified(tmp_path: Path) -> None:
    src = quark_phi3(tmp_path / "src", {"*o_proj": None})
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "unfused", "-q").exit_code == 0  # run_cli verifies it too
    source = json.loads((src / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["layer_quant_config"] == source


@pytest.mark.parametrize("layout", ["per-shard", "fused"])
def test_the_layouts_that_keep_fused_names_convert(tmp_path: Path, layout: str) -> None:
    src = quark_phi3(tmp_path / "src", {"*qkv_proj": None})
    assert run_cli("convert", src, tmp_path / "out", "--layout", layout, "-q").exit_code == 0


def verify_json(src: Path, out: Path) -> tuple[int, list[str]]:
    result = run_cli("verify", src, out, "--json")
    return result.exit_code, json.loads(result.output)["problems"]


def test_verify_finds_a_layer_setting_that_names_renamed_modules(tmp_path: Path) -> None:
    """An OUTPUT made by hand (or by another tool) with the fused key kept: the settings apply to nothing."""
    src, out = quark_phi3(tmp_path / "src", None), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "unfused", "-q").exit_code == 0
    for folder in (src, out):
        set_layer_settings(folder, {"*qkv_proj": None})
    code, problems = verify_json(src, out)
    assert code == 1, problems
    assert any(
        p.startswith("config.json: quantization_config.layer_quant_config: names other modules")
        and "not model.layers.0.self_attn.k_proj" in p
        for p in problems
    ), problems


def test_verify_finds_a_changed_layer_setting(tmp_path: Path) -> None:
    src, out = quark_phi3(tmp_path / "src", {"*o_proj": None}), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "unfused", "-q").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"]["*o_proj"]["input_tensors"]["is_dynamic"] = False
    (out / "config.json").write_text(json.dumps(config))
    code, problems = verify_json(src, out)
    assert code == 1
    assert "config.json: quantization_config differs from SOURCE's beyond its module name lists" in problems


def test_a_layer_settings_value_that_is_no_dict_is_refused(tmp_path: Path) -> None:
    src = quark_phi3(tmp_path / "src", None)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"] = ["*qkv_proj"]
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3, result.output
    assert "quantization_config.layer_quant_config must map module names to settings" in result.output


@pytest.mark.parametrize(
    ("key", "module", "named"),
    [
        ("*qkv_proj", "model.layers.0.self_attn.qkv_proj", True),  # fnmatch
        ("*q_proj", "model.layers.0.self_attn.qkv_proj", False),
        ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj", True),  # `name in key`
        ("model.layers.0.self_attn.o_proj_extra", "model.layers.0.self_attn.o_proj", True),
        ("o_proj", "model.layers.0.self_attn.o_proj", False),  # the key is in the name, not the name in the key
    ],
)
def test_layer_keys_match_as_vllms_quark_reader(key: str, module: str, named: bool) -> None:
    assert matches(key, module, "quark-layer") is named


def test_a_huge_key_is_refused_in_one_short_line(tmp_path: Path) -> None:
    """A hostile 200,000-character key was echoed whole in the refusal."""
    src = quark_phi3(tmp_path / "src", {"*" * 200_000: None})
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q")
    assert result.exit_code == 3 and "which names the fused module" in result.output
    assert len(result.output) < 1_000, len(result.output)

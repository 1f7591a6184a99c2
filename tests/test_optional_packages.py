"""A row whose outcome depends on a package users may install says both outcomes (issue 47).

transformers' Quark quantizer needs amd-quark, which transformers does not install: without it the row fails
(ImportError, measured); with amd-quark 0.13 installed transformers loads Quark checkpoints, except where its
QParamsLinear layers cannot hold what is on disk. Both outcomes were measured with the real loaders
(tests/loaders/test_real_loaders.py, `transformers-amd-quark`); the verdicts below are those measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, llama, phi3
from tests.conftest import run_cli

#: (model, scale style, config keys removed) -> transformers with amd-quark 0.13, as measured.
MEASURED = {
    ("phi3", "tensor", ()): "loads",
    ("phi3", "channel", ()): "loads",
    ("llama", "tensor", ()): "loads",
    ("phi3", "shard", ()): "fails",  # RuntimeError: size mismatch (a per-shard scale vector)
    ("llama", "tensor", ("layer_quant_config", "layer_type_quant_config")): "fails",  # KeyError in amd-quark
}


def _quark(root: Path, model: str, scale: str, without: tuple[str, ...]) -> Path:
    src = build(root, {"phi3": phi3, "llama": llama}[model](), fmt="quark", scale=scale)
    config = json.loads((src / "config.json").read_text())
    for key in without:
        del config["quantization_config"][key]
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize(("model", "scale", "without"), list(MEASURED))
def test_a_quark_checkpoint_says_what_transformers_does_with_and_without_amd_quark(
    tmp_path: Path, model: str, scale: str, without: tuple[str, ...]
) -> None:
    src = _quark(tmp_path / "src", model, scale, without)
    row = json.loads(run_cli("inspect", src, "--json").stdout)["loaders"]["transformers"]
    assert row["verdict"] == "fails" and "amd-quark" in row["reason"]
    installed = row["with_package"]
    assert installed["package"] == "amd-quark 0.13" and installed["row"] == "transformers + amd-quark 0.13"
    assert installed["verdict"] == MEASURED[(model, scale, without)]
    assert installed["loads"] == (installed["verdict"] == "loads") and installed["measured"] is True
    text = run_cli("inspect", src).output.replace("\n      ", " ").replace("\n                     ", " ")
    assert f"with amd-quark 0.13 installed: {installed['verdict']}: " in text


def test_the_other_rows_and_formats_have_no_second_outcome(tmp_path: Path) -> None:
    quark = _quark(tmp_path / "quark", "phi3", "tensor", ())
    rows = json.loads(run_cli("inspect", quark, "--json").stdout)["loaders"]
    assert [name for name, row in rows.items() if row["with_package"]] == ["transformers"]
    for fmt in ("fp8", "compressed-tensors", "modelopt"):
        src = build(tmp_path / fmt, phi3(), fmt=fmt)
        rows = json.loads(run_cli("inspect", src, "--json").stdout)["loaders"]
        assert all(row["with_package"] is None for row in rows.values()), fmt


def test_convert_says_both_outcomes_of_a_quark_output(tmp_path: Path) -> None:
    """`--layout fused` keeps a Quark source Quark: what OUTPUT does in transformers with amd-quark is said too;
    the default conversion (compressed-tensors) needs no optional package."""
    src = _quark(tmp_path / "src", "phi3", "shard", ())
    fused = json.loads(run_cli("convert", src, tmp_path / "fused", "--layout", "fused", "--json").stdout)
    assert fused["loaders"]["transformers"]["with_package"]["verdict"] == "loads"  # one max scale per module
    assert fused["source_loaders"]["transformers"]["with_package"]["verdict"] == "fails"
    default = json.loads(run_cli("convert", src, tmp_path / "default", "--json").stdout)
    assert default["loaders"]["transformers"]["verdict"] == "loads"
    assert default["loaders"]["transformers"]["with_package"] is None

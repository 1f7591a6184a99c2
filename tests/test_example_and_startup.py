"""The shipped example, and the promise that byte-moving conversions never import torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.make_example import make_example
from tests.conftest import load_tensors, raw, run_cli

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "phi3-tiny-fp8"


def test_example_is_what_the_script_generates(tmp_path: Path) -> None:
    shipped, fresh = load_tensors(EXAMPLE), load_tensors(make_example(tmp_path / "fresh"))
    assert set(shipped) == set(fresh)
    for name, t in shipped.items():
        assert t.dtype == fresh[name].dtype and raw(t) == raw(fresh[name]), name
    assert sum(p.stat().st_size for p in EXAMPLE.iterdir()) < 2_000_000


def test_example_converts(tmp_path: Path) -> None:
    """The Quickstart: the AutoFP8 example loads with raw codes in transformers; written as
    compressed-tensors (same bytes, per-tensor scales shaped [1]) it loads in vLLM and transformers."""
    result = run_cli("convert", EXAMPLE, tmp_path / "out", "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["output_format"] == "compressed-tensors" and report["layout"] == "fused"
    assert report["loaders"]["transformers"]["verdict"] == "loads"
    assert report["source_loaders"]["transformers"]["verdict"] == "loads-wrong"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    source, tensors = load_tensors(EXAMPLE), load_tensors(tmp_path / "out")
    assert set(tensors) == set(source)
    for name, t in source.items():
        assert raw(tensors[name]) == raw(t), name
        assert tensors[name].shape == (t.shape if t.dim() else (1,)), name
    kept = run_cli("convert", EXAMPLE, tmp_path / "kept", "--format", "keep", "-q")
    assert kept.exit_code == 0, kept.output
    assert "model.layers.1.self_attn.v_proj.weight_scale" in load_tensors(tmp_path / "kept")


@pytest.mark.parametrize("layout", ["unfused", "per-shard", "fused"])
def test_byte_moving_layouts_do_not_import_torch(tmp_path: Path, layout: str) -> None:
    code = (
        "import sys\n"
        "from fp8fix.cli import main\n"
        f"sys.argv = ['fp8fix', 'convert', {str(EXAMPLE)!r}, {str(tmp_path / 'out')!r}, '--layout', {layout!r}, '-q']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("command", ["convert", "inspect", "verify", "push"])
def test_help_shows_examples_and_exit_codes(command: str) -> None:
    text = run_cli(command, "--help").output
    assert "Examples:\n    fp8fix " + command in text
    assert "Exit codes:" in text and "\\b" not in text

"""`inspect --scan-data` counts what `rounded` costs (issue 47): how many e4m3fnuz codes a loader holding e4m3fn
parameters rounds, and by how much; a checkpoint with none of them loads exactly.

The expectations come from torch here (each e4m3fnuz weight cast into e4m3fn, as vLLM's, SGLang's and
transformers' parameters hold them: tests/loaders/test_real_loaders.py measures that they do), not from fp8fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tests.builders import build, llama
from tests.conftest import patch_bytes, run_cli

ROUNDED_ROWS = ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32", "vLLM >= 0.32 on ROCm", "SGLang 0.5.23")


def _fnuz_output(tmp_path: Path, patches: dict[int, int] | None = None) -> Path:
    src = build(tmp_path / "src", llama(), fmt="fp8")
    if patches:
        patch_bytes(src, "model.layers.0.mlp.down_proj.weight", patches)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "e4m3fnuz", "-q").exit_code == 0
    return out


def _rounded_by_torch(folder: Path) -> tuple[dict[str, list[int]], float]:
    """Per e4m3fnuz weight, the flat indices whose value e4m3fn does not hold; the largest error in value."""
    found: dict[str, list[int]] = {}
    worst = 0.0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if w.dtype != torch.float8_e4m3fnuz:
                    continue
                exact = w.float()
                held = exact.to(torch.float8_e4m3fn).float()
                wrong = (held != exact).flatten().nonzero().flatten().tolist()
                if wrong:
                    found[name] = wrong
                    scale = f.get_tensor(name.removesuffix("weight") + "weight_scale").float().max().item()
                    worst = max(worst, ((held - exact).abs().max() * scale).item())
    return found, worst


def _inspect(folder: Path, *args: str) -> tuple[int, dict]:
    result = run_cli("inspect", folder, "--json", "--strict", *args)
    return result.exit_code, json.loads(result.stdout)


def test_the_scan_counts_the_codes_e4m3fn_rounds_and_the_worst_error(tmp_path: Path) -> None:
    out = _fnuz_output(tmp_path, {0: 0x01, 7: 0x0B, 9: 0x8D})  # odd codes below 2^-6 in e4m3fnuz
    found, worst = _rounded_by_torch(out)
    count = sum(len(v) for v in found.values())
    assert count >= 3
    _, unscanned = _inspect(out)
    assert unscanned["fnuz_rounding"] is None and unscanned["loaders"]["vLLM >= 0.32"]["verdict"] == "rounded"
    code, report = _inspect(out, "--scan-data")
    rounding = report["fnuz_rounding"]
    assert rounding["rounded_codes"] == count
    assert rounding["fnuz_weights"] == sum(w.numel() for w in _fnuz_weights(out))
    assert worst <= rounding["max_abs_error"] <= worst * 1.01 + 1e-12  # the largest scale's half step
    for row in ROUNDED_ROWS:
        assert report["loaders"][row]["verdict"] == "rounded"
        assert f"scanned: {count:,} of {rounding['fnuz_weights']:,} weights round" in report["loaders"][row]["reason"]
    assert code == 1


def test_a_fnuz_checkpoint_without_such_codes_loads_exactly_once_scanned(tmp_path: Path) -> None:
    out = _fnuz_output(tmp_path)
    found, _ = _rounded_by_torch(out)
    for name, indices in found.items():  # each such code made its even neighbour's smaller sibling: 0
        patch_bytes(out, name, dict.fromkeys(indices, 0x00))
    assert _rounded_by_torch(out)[0] == {}
    code, report = _inspect(out)
    assert code == 1 and report["loaders"]["vLLM >= 0.32"]["verdict"] == "rounded"  # unscanned: it may round
    code, report = _inspect(out, "--scan-data")
    assert report["fnuz_rounding"]["rounded_codes"] == 0 and report["fnuz_rounding"]["max_abs_error"] is None
    for row in (*ROUNDED_ROWS, "transformers"):
        assert report["loaders"][row]["verdict"] == "loads", row
        assert "scanned: none of its" in report["loaders"][row]["reason"]
    assert [f["code"] for f in report["findings"] if f["loaders"]] == []
    assert code == 0


def test_an_e4m3fn_checkpoint_has_nothing_to_count(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="fp8")
    _, report = _inspect(src, "--scan-data")
    assert report["fnuz_rounding"] is None


def _fnuz_weights(folder: Path) -> list[torch.Tensor]:
    weights = []
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            weights += [f.get_tensor(n) for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3FNUZ"]
    return weights

"""What each loader row's call does with a checkpoint's kv-cache scales (issue 29, part 4): `kv_cache_scales`
per row in `--json`, a line in the text output, and inspect's findings with the fix.

Expectations from vLLM 0.32's and transformers 5.24's behaviour as measured by
tests/loaders/test_kv_cache_scales.py (which reads the scales back after real loads), not from fp8fix:
vLLM's default call keeps an FP8 cache at the checkpoint's scales only where the quantization config
declares one (compressed-tensors `kv_cache_scheme`, ModelOpt `kv_cache_quant_algo`); under AutoFP8's
`quant_method: fp8` it keeps a BF16 cache; transformers drops the scales in every format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, llama, phi3
from tests.conftest import run_cli

CUDA, ROCM, TRANSFORMERS = "vLLM >= 0.32", "vLLM >= 0.32 on ROCm", "transformers"
OLD = ("vLLM <= 0.5.0", "vLLM 0.5.1 - 0.18")
#: format -> vLLM's default call uses the kv-cache scales
VLLM_USES = {"fp8": False, "fp8-amd-kv": False, "compressed-tensors": True, "modelopt": True}


def report(folder: Path, *args: str) -> dict:
    result = run_cli("inspect", folder, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def kv(folder: Path) -> dict[str, str | None]:
    return {
        row: (v["kv_cache_scales"] or {}).get("verdict") if v["kv_cache_scales"] else None
        for row, v in report(folder)["loaders"].items()
    }


@pytest.mark.parametrize("fmt", list(VLLM_USES))
def test_each_row_says_whether_its_call_uses_the_kv_cache_scales(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", llama(), fmt=fmt, scale="tensor", kv_scales=True)
    said = kv(src)
    vllm = "used" if VLLM_USES[fmt] else "ignored"
    assert (said[CUDA], said[ROCM], said[TRANSFORMERS]) == (vllm, vllm, "ignored")
    assert all(said[row] == "not-judged" for row in OLD)  # not run
    if fmt == "compressed-tensors":  # measured: vLLM doubles ModelOpt's kv scales for e4m3fnuz, not these
        reason = report(src)["loaders"][ROCM]["kv_cache_scales"]["reason"]
        assert "not doubled" in reason and "240 x scale" in reason
    codes = {f["code"]: f for f in report(src)["findings"]}
    assert ("kv-cache-scales-unused" in codes) == (not VLLM_USES[fmt])
    assert codes["kv-cache-scales-dropped"]["fix"] is None  # no conversion makes transformers keep them
    if not VLLM_USES[fmt]:  # the fix: compressed-tensors declares kv_cache_scheme (and renames AMD's names)
        fix = codes["kv-cache-scales-unused"]["fix"]
        assert fix and "--format compressed-tensors" in fix
        result = run_cli("convert", src, tmp_path / "fixed", *fix.split(), "--json")
        assert result.exit_code == 0, result.output
        assert {row: v["kv_cache_scales"]["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}[
            CUDA
        ] == "used"
        assert (kv(tmp_path / "fixed")[CUDA], kv(tmp_path / "fixed")[ROCM]) == ("used", "used")
        assert "kv-cache-scales-unused" not in {f["code"] for f in report(tmp_path / "fixed")["findings"]}


def test_no_kv_cache_scales_no_kv_verdict(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), kv_scales=False)
    assert set(kv(src).values()) == {None}
    assert not {f["code"] for f in report(src)["findings"]} & {"kv-cache-scales-unused", "kv-cache-scales-dropped"}
    assert "kv-cache scales:" not in run_cli("inspect", src).output.split("loaders:")[1]


def test_a_checkpoint_that_does_not_load_has_no_kv_verdict(tmp_path: Path) -> None:
    """The legacy AutoFP8 names (act_scale, kv_scale) make vLLM fail: what it does with kv scales is moot."""
    src = build(tmp_path / "src", llama(), fmt="fp8-legacy", kv_scales=True)
    rows = report(src)["loaders"]
    assert rows[CUDA]["verdict"] == "fails" and rows[CUDA]["kv_cache_scales"]["verdict"] == "not-judged"


def test_the_text_output_says_it_and_convert_shows_the_change(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="fp8", kv_scales=True)
    line = next(x for x in run_cli("inspect", src).output.splitlines() if x.startswith("  kv-cache scales: "))
    vllm = "vLLM 0.19 - 0.20, vLLM 0.21 - 0.31, vLLM >= 0.32, vLLM >= 0.32 on ROCm"
    assert line.startswith(f"  kv-cache scales: ignored: {vllm}, transformers")
    out = run_cli("convert", src, tmp_path / "out", "--format", "compressed-tensors", "--dry-run").output
    flat = out.replace("\n      ", " ")
    assert f"kv-cache scales: used: {vllm}; ignored: transformers" in flat
    assert f"(SOURCE: ignored: {vllm}, transformers" in flat

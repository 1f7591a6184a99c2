"""The `vLLM >= 0.32 on ROCm` row (issue 29, part 3): what vLLM's ROCm weight loading does, as measured by
tests/loaders/test_real_loaders.py with FP8FIX_VLLM_ROCM=1, judged here from the checkpoints' construction.

Expectations come from vLLM 0.32's source, not from fp8fix: every FP8 weight parameter is created as
float8_e4m3fn (quantization/utils/fp8_utils.py create_fp8_weight_parameter), so e4m3fnuz codes are cast into
it by value and their odd subnormal codes round, on ROCm as on CUDA; ModelOpt's per-tensor layers
(modelopt.py KFp8StaticTensor.process) skip the e4m3fn -> e4m3fnuz normalization the other formats do on
ROCm, and requantize packed q / k / v (gate / up) whose scales differ through the platform's e4m3fnuz
(largest 240), clipping every larger code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, llama, phi3
from tests.conftest import run_cli

CUDA, ROCM = "vLLM >= 0.32", "vLLM >= 0.32 on ROCm"
#: (format, scale) the builders write in e4m3fn, each a format vLLM reads.
E4M3FN_SOURCES = [
    ("fp8", "tensor"),
    ("fp8", "shard"),
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("block-fp8", "block"),
    ("quark", "tensor"),
    ("modelopt", "tensor"),
]


def verdicts(folder: Path) -> dict[str, str]:
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.output
    return {row: v["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}


def converted(src: Path, out: Path, *args: str) -> dict[str, str]:
    """convert's verdicts on OUTPUT, checked equal to inspect's on what it wrote."""
    result = run_cli("convert", src, out, *args, "--json")
    assert result.exit_code == 0, result.output
    said = {row: v["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}
    assert said == verdicts(out)
    return said


@pytest.mark.parametrize("fmt,scale", E4M3FN_SOURCES)
@pytest.mark.parametrize("layout", ["as-exported", "fused"])
def test_e4m3fnuz_outputs_are_rounded_in_both_vllm_rows(tmp_path: Path, fmt: str, scale: str, layout: str) -> None:
    """Before: "not-judged" for vLLM >= 0.20 and no ROCm row; then `loads-wrong` (issue 47: a half-step rounding
    of odd subnormal codes is `rounded`, graded apart from wrong weights). Never `loads` in vLLM."""
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale)
    args = ("--to", "e4m3fnuz") + (("--layout", "fused") if layout == "fused" else ())
    said = converted(src, tmp_path / "fnuz", *args)
    for row in (CUDA, ROCM):
        assert said[row] in ("rounded", "fails"), (row, said[row])
    if said[CUDA] == "rounded":  # the rounding, not a failure that comes first
        report = json.loads(run_cli("inspect", tmp_path / "fnuz", "--json").output)
        assert "rounding each odd subnormal code" in report["loaders"][ROCM]["reason"]
        finding = next(f for f in report["findings"] if f["code"] == "e4m3fnuz-for-vllm")
        assert finding["fix"] == "--to e4m3fn"
        back = converted(tmp_path / "fnuz", tmp_path / "back", "--to", "e4m3fn")
        assert back[ROCM] == back[CUDA]  # what vLLM normalizes itself (Phi-3: nothing packed, ModelOpt too)


@pytest.mark.parametrize(
    "fmt,scale,shape",
    [
        (f, s, shape)
        for f, s in E4M3FN_SOURCES
        if f != "modelopt"
        for shape in ("phi3", "llama")
        if (shape, s) != ("llama", "shard")
    ],
)
def test_e4m3fn_sources_load_on_rocm_as_on_cuda(tmp_path: Path, fmt: str, scale: str, shape: str) -> None:
    """vLLM normalizes e4m3fn checkpoints on ROCm itself (codes, doubled scales, then the shard
    requantization): every format but ModelOpt loads there as it does on CUDA (Llama fuses nothing on disk:
    no shard scales)."""
    src = build(tmp_path / "src", phi3() if shape == "phi3" else llama(), fmt=fmt, scale=scale)
    said = verdicts(src)
    assert said[ROCM] == said[CUDA]


def test_modelopt_packed_shards_with_different_scales_are_clipped_on_rocm(tmp_path: Path) -> None:
    """Llama's q / k / v and gate / up are apart on disk, each quantized with its own scale (the builder's
    per-tensor absmax): vLLM packs them and ModelOpt requantizes them unnormalized on ROCm."""
    src = build(tmp_path / "src", llama(), fmt="modelopt", scale="tensor")
    said = verdicts(src)
    assert (said[CUDA], said[ROCM]) == ("rounded", "loads-wrong")  # CUDA: requantized, within half a step
    # the channel layout keeps every row's scale: nothing requantized on either platform
    channel = converted(src, tmp_path / "channel", "--layout", "channel")
    assert (channel[CUDA], channel[ROCM]) == ("loads", "loads")


def test_modelopt_split_of_one_scale_is_not_requantized_on_rocm(tmp_path: Path) -> None:
    """Phi-3's fused modules with one scale, split: q / k / v carry the same scale, so vLLM's ModelOpt layer
    does not requantize (its `(weight_scale == weight_scale[0]).all()` check): it loads, and convert knows it
    before writing (the scales' values from the source bytes the plan copies)."""
    src = build(tmp_path / "src", phi3(), fmt="modelopt", scale="tensor")
    unfused = converted(src, tmp_path / "unfused", "--layout", "unfused")
    assert unfused[ROCM] == unfused[CUDA] == "loads"
    # per-shard scales that differ, split: q / k / v now apart with different scales
    shard = build(tmp_path / "shard", phi3(), fmt="modelopt", scale="shard")
    split = converted(shard, tmp_path / "split", "--layout", "unfused")
    assert (split[CUDA], split[ROCM]) == ("rounded", "loads-wrong")

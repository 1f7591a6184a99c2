"""`--scales ue8m0` through vLLM 0.32 with its load-time UE8M0 requantization forced on (issue 28).

Where vLLM runs DeepGEMM (Hopper, Blackwell) it requantizes float32 block scales to powers of two at
load (`requant_weight_ue8m0_inplace`); the harness runs that code of vLLM's on CPU (FP8FIX_VLLM_UE8M0=1,
tests/loaders/vllm_load.py). Shown for block FP8 (F32 and BF16 scales) on the Llama, GLM and Phi-3 shapes:
- fp8fix's output goes through it unchanged: every weight vLLM computes with is OUTPUT's codes times
  OUTPUT's scale (no second rounding);
- SOURCE goes through it with the error fp8fix reported for vLLM's requantization (per module: the
  largest error and the RMS, in source fp8 steps).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.builders import FORMATS, build, glm, llama, loadable, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, run_loader
from tests.loaders.test_real_loaders import as_loaded
from tests.test_unquantized import tensors_of

pytestmark = pytest.mark.loaders

SHAPES = {"llama": llama, "glm": glm, "phi3": phi3}
#: compressed-tensors block is not here: vLLM 0.32's CPU build has no kernel for it ("Failed to find a kernel
#: that can implement the ScaledMM linear layer"), whatever the scales (tests/test_ue8m0.py covers its output)
CASES = [f"{shape}.{fmt}" for shape in SHAPES for fmt in ("block-fp8", "block-fp8-bf16")]


def block_values(folder: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Each FP8 weight's codes times its block scale (float64), by module."""
    tensors = tensors_of(folder)
    out = {}
    for name, w in tensors.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        stem = name.removesuffix(".weight")
        scale = next(tensors[n] for n in (f"{stem}.weight_scale_inv", f"{stem}.weight_scale") if n in tensors)
        rows, cols = w.shape
        grid = scale.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[stem] = w.double() * grid
    return out


def source_steps(values: torch.Tensor, scale_grid: torch.Tensor) -> torch.Tensor:
    """The source fp8 step at each value: the step at its code, times its block's scale."""
    codes = (values / scale_grid).abs()
    _, exponent = torch.frexp(codes.clamp(min=2.0**-9))
    return torch.exp2((exponent - 1).clamp(min=-6).double() - 3) * scale_grid


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict, Loaded, Loaded]]:
    root = tmp_path_factory.mktemp("ue8m0")
    folders = {}
    for case in CASES:
        shape, fmt = case.split(".")
        model = loadable(SHAPES[shape]())
        src = build(root / "src" / case, model, fmt=fmt, scale="block")
        out = root / "out" / case
        result = run_cli("convert", src, out, "--scales", "ue8m0", "--json")
        assert result.exit_code == 0, result.output
        folders[case] = (src, out, json.loads(result.stdout))
    order = [folders[c][i] for c in CASES for i in (0, 1)]
    ran = run_loader("vllm", order, root / "vllm", env={"FP8FIX_VLLM_UE8M0": "1"})
    return {c: (*folders[c], ran[2 * i], ran[2 * i + 1]) for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_vllm_keeps_fp8fix_ue8m0_weights(loaded: dict, case: str) -> None:
    _, out, _, _, result = loaded[case]
    assert result.loaded, result.error
    block = FORMATS[case.split(".")[1]].block
    written = {m: v.float() for m, v in block_values(out, block).items()}
    expected = as_loaded(written, result.weights)
    assert expected.keys() & result.weights.keys()
    for layer, values in expected.items():
        if layer in result.weights and layer != "lm_head":
            assert torch.equal(result.weights[layer], values), layer  # no second rounding


@pytest.mark.parametrize("case", CASES)
def test_vllm_requantizes_source_with_the_error_fp8fix_reported(loaded: dict, case: str) -> None:
    src, _, report, result, _ = loaded[case]
    assert result.loaded, result.error
    block = FORMATS[case.split(".")[1]].block
    tensors = tensors_of(src)
    exact = block_values(src, block)
    figures = {m["module"]: m for m in report["ue8m0"]["modules"]}
    for layer, values in as_loaded(exact, result.weights).items():
        if layer not in result.weights or layer == "lm_head":
            continue
        parts = [layer] if layer in figures else _packed(layer)
        grids = []
        for m in parts:
            scale = next(tensors[n] for n in (f"{m}.weight_scale_inv", f"{m}.weight_scale") if n in tensors).double()
            rows, cols = exact[m].shape
            grids.append(scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols])
        steps = (result.weights[layer].double() - values).abs() / source_steps(values, torch.cat(grids))
        said_max = max(figures[m]["vllm_max_steps"] for m in parts)
        said_sq = sum(figures[m]["vllm_rms_steps"] ** 2 * exact[m].numel() for m in parts)
        assert math.isclose(float(steps.max()), said_max, rel_tol=1e-6, abs_tol=1e-9), (layer, float(steps.max()))
        assert math.isclose(float((steps**2).sum()), said_sq, rel_tol=1e-6, abs_tol=1e-6), layer


def _packed(layer: str) -> list[str]:
    """The modules vLLM packs into `layer` (q / k / v into qkv_proj, gate / up into gate_up_proj)."""
    parent, _, leaf = layer.rpartition(".")
    shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf, ())
    return [f"{parent}.{s}" for s in shards]

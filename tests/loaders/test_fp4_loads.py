"""What the real loaders do with FP4 modules (issue 49), which fp8fix reads and judges (fp8fix/registry/loaders.py
FP4_RULES): compressed-tensors NVFP4 and MXFP4 as llm-compressor writes them (tests/builders.fp4_compressed_tensors),
alone and beside FP8_DYNAMIC modules, of a Llama (q / k / v and gate / up packed by vLLM and SGLang) and a Phi-3
(fused on disk), NVFP4 with the packed projections' global scales shared (llm-compressor) or each its own (other
exporters), and what `convert --to bf16` and (MXFP4) `--blocks 128x128` write of them.

Measured here (OUTCOMES): every vLLM release stops on CPU (0.19.0 and 0.20.2's MXFP4 at the FP4 scheme's platform
query, the rest finding no NVFP4 / MXFP4 kernel), so a GPU's outcome is not seen: not judged, except where vLLM's
source says what it does whatever the kernel (global scales that differ: divided by the largest, a warning only;
cited, `loads-wrong`). SGLang has no MXFP4 scheme (fails), refuses differing NVFP4 global scales in its weight-only
scheme (fails) and runs NVFP4 with CUDA kernels only (not judged). transformers decompresses every FP4 layer on the
first forward pass to the format's values, asserted here against the checkpoint's own bytes (the same values
`--to bf16` writes). The BF16 outputs load in every loader with exactly fp8fix's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import fp4_compressed_tensors, glm, llama, loadable, modelopt_nvfp4, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_mx_formats import WHOLE_BLOCKS, assert_judged_as_loaded
from tests.loaders.test_real_loaders import VERDICT_ROWS, as_loaded
from tests.test_fp4_modules import fp4_values, half_step_of

pytestmark = pytest.mark.loaders

NO_KERNEL = "Failed to find a kernel that can implement the"
NO_PLATFORM = "num_compute_units is not implemented for the current platform"
NO_CUDA = "Torch not compiled with CUDA enabled"
NO_SCHEME = "No compressed-tensors compatible scheme was found"
UNSHARED = "requires all fused projections to share one weight_global_scale"
#: The CPU's answers that say nothing of what a GPU computes.
GPU_ONLY = (NO_KERNEL, NO_PLATFORM, NO_CUDA)

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.qkv_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj")
#: case -> (model, schemes by suffix, NVFP4 global scales shared by packed projections)
CASES = {
    "llama-nvfp4": (llama, {"proj": "nvfp4"}, True),
    "llama-nvfp4-own-global": (llama, {"proj": "nvfp4"}, False),
    "phi3-nvfp4": (phi3, {"proj": "nvfp4"}, True),
    "llama-mxfp4": (llama, {"proj": "mxfp4"}, True),
    "llama-fp8-nvfp4": (llama, {**dict.fromkeys(ATTENTION, "fp8"), **dict.fromkeys(MLP, "nvfp4")}, True),
    "llama-mxfp4-nvfp4": (llama, {**dict.fromkeys(ATTENTION, "mxfp4"), **dict.fromkeys(MLP, "nvfp4")}, True),
}
_VLLM = ("vllm-0.20.2", "vllm-0.21.0", "vllm-0.31.0", "vllm", "vllm-rocm")


def outcomes(case: str) -> dict[str, str | None]:
    """What each loader did with `case` here (an error's text; None: loaded the format's values)."""
    mx = "mxfp4" in case
    found: dict[str, str | None] = {"vllm-0.19.0": NO_PLATFORM, "transformers": None}
    found |= {r: NO_KERNEL for r in _VLLM}
    if case == "llama-mxfp4":  # (0.20 and 0.21 reach the platform query before the MXFP4 kernel search)
        found |= {"vllm-0.20.2": NO_PLATFORM, "vllm-0.21.0": NO_PLATFORM}
    found["sglang"] = NO_SCHEME if mx else UNSHARED if case.endswith("own-global") else NO_CUDA
    return found


#: The rows fp8fix cites from source rather than measures: vLLM's NVFP4 scheme divides packed projections by the
#: largest of their global scales, whatever its kernel (compressed_tensors_w4a4_nvfp4.py).
CITED = {
    ("llama-nvfp4-own-global", row): "loads-wrong" for row in ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32")
}


def row_of(case: str, row: str) -> str:
    """The verdict a row must give from what its releases did here (`outcomes`), or what it cites (`CITED`)."""
    if (case, row) in CITED:
        return CITED[(case, row)]
    releases = [outcomes(case)[loader] for loader, r in VERDICT_ROWS.items() if r == row]
    if all(r is None for r in releases):
        return "loads"
    if any(r in GPU_ONLY for r in releases):
        return "not-judged"
    return "fails"


def test_fp4_rows_are_what_the_loaders_do(tmp_path: Path) -> None:
    sources = {
        case: fp4_compressed_tensors(tmp_path / case, schemes, loadable(make()), shared_global=shared)
        for case, (make, schemes, shared) in CASES.items()
    }
    outputs = {}
    for case, src in sources.items():
        assert run_cli("convert", src, tmp_path / f"{case}-bf16", "--to", "bf16").exit_code == 0
        outputs[case] = tmp_path / f"{case}-bf16"
    assert set(outcomes("llama-nvfp4")) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], tmp_path / "loaded")
    for i, (case, src) in enumerate(sources.items()):
        report = json.loads(run_cli("inspect", src, "--json").output)
        assert report["fp4_modules"], case
        rows, plain = report["loaders"], json.loads(run_cli("inspect", outputs[case], "--json").output)["loaders"]
        for loader, results in ran.items():
            row, loaded = VERDICT_ROWS[loader], results[i]
            said, expected = rows[row]["verdict"], outcomes(case)[loader]
            assert said == row_of(case, row), (case, row, said, rows[row]["reason"])
            if (case, row) in CITED:
                assert "vllm 0.32 model_executor" in rows[row]["evidence"], rows[row]["evidence"]
            measured = said != "not-judged" and (case, row) not in CITED  # (a cited row is not what the CPU shows)
            record(loader, f"{case}-ct", said, "loads" if loaded.loaded else "fails", not measured, loaded.error)
            if expected is None:
                assert loaded.loaded, f"{case} {loader}: {loaded.error}"
                assert_fp4_values(src, loaded.weights, loaded.unreadable)
            else:
                assert not loaded.loaded and expected in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"
            # the BF16 output: every loader builds a plain model with exactly the values fp8fix wrote
            bf16 = results[len(sources) + i]
            assert plain[row]["verdict"] == "loads" and bf16.loaded, f"{case}-bf16 {loader}: {bf16.error}"
            record(loader, f"{case}-ct-to-bf16", "loads", "loads")
            written = load_file(outputs[case] / "model.safetensors")
            truth = {n.removesuffix(".weight"): t.float() for n, t in written.items() if n.endswith("proj.weight")}
            for layer, value in as_loaded(truth, bf16.weights).items():
                if layer in bf16.weights:
                    assert torch.equal(bf16.weights[layer].float(), value), (case, loader, layer)


def assert_fp4_values(src: Path, weights: dict[str, torch.Tensor], unreadable: list[str]) -> None:
    """Every FP4 layer computes with its format's values, worked out from the checkpoint's bytes: MXFP4's exactly,
    NVFP4's within half a BF16 step (compressed-tensors rounds e2m1 x (scale / global) to BF16)."""
    tensors = load_file(src / "model.safetensors")
    modules = [n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")]
    assert modules and not unreadable, unreadable
    for module in modules:
        exact = fp4_values(tensors, module)
        got = weights[module].double()
        assert got.shape == exact.shape, module
        assert bool(((got - exact).abs() <= half_step_of(exact)).all()), module


def test_mxfp4_as_128_blocks_is_judged_as_the_loaders_load_it(tmp_path: Path) -> None:
    """`convert --blocks 128x128` of MXFP4 writes block FP8 (compressed-tensors FP8_BLOCK): each row inspect gives
    OUTPUT is what the loader does with it, against OUTPUT's own values (code x its block's power of two)."""
    outputs = {}
    for name, make in WHOLE_BLOCKS.items():
        src = fp4_compressed_tensors(tmp_path / name, {"proj": "mxfp4"}, loadable(make()), seed=3)
        assert run_cli("convert", src, tmp_path / f"{name}-128", "--blocks", "128x128").exit_code == 0
        outputs[name] = tmp_path / f"{name}-128"
    assert_judged_as_loaded(outputs, "ct-mxfp4-to-block128", tmp_path)


#: Sources of NVFP4 whose packed projections' global scales differ, by name: (builder, model).
SHARED_CASES = {
    "llama-ct": (fp4_compressed_tensors, llama),
    "glm-ct": (fp4_compressed_tensors, glm),  # gate_up fused on disk: q / k / v only are packed layers of modules
    "llama-modelopt": (modelopt_nvfp4, llama),  # weight_scale_2 multiplies
}


def _nvfp4(builder, root: Path, make, shared: bool) -> Path:  # type: ignore[no-untyped-def]
    if builder is modelopt_nvfp4:
        return modelopt_nvfp4(root, loadable(make()), shared_global=shared)
    return fp4_compressed_tensors(root, {"proj": "nvfp4"}, loadable(make()), shared_global=shared)


@pytest.mark.parametrize("case", SHARED_CASES)
def test_shared_global_scales_are_judged_as_the_loaders_load_them(tmp_path: Path, case: str) -> None:
    """The default conversion of NVFP4 whose packed projections' global scales differ gives each packed layer one
    (the largest multiplier: `plan/fp4_shared.py`). Expected independently of fp8fix: OUTPUT does in every real
    loader what the same model exported with shared global scales does (measured side by side: SGLang stops where
    shared NVFP4 stops, at its CUDA kernels, instead of refusing; vLLM's CPU builds where they stop for any NVFP4);
    inspect's rows of OUTPUT are that export's; where a loader computes, each value is within the reported error of
    SOURCE's."""
    builder, make = SHARED_CASES[case]
    src = _nvfp4(builder, tmp_path / "src", make, shared=False)
    twin = _nvfp4(builder, tmp_path / "twin", make, shared=True)
    out = tmp_path / "shared"
    result = run_cli("convert", src, out, "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["shared_fp4"], case
    worst = max(m["max_error"] for m in plan["shared_fp4"])
    rows = json.loads(run_cli("inspect", out, "--json").output)["loaders"]
    twin_rows = json.loads(run_cli("inspect", twin, "--json").output)["loaders"]
    assert {r: v["verdict"] for r, v in rows.items()} == {r: v["verdict"] for r, v in twin_rows.items()}
    ran = run_loaders(VERDICT_ROWS, [out, twin], tmp_path / "loaded")
    packed = "weight" if builder is modelopt_nvfp4 else "weight_packed"
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for loader, (loaded, expected) in ((k, (v[0], v[1])) for k, v in ran.items()):
        said = rows[VERDICT_ROWS[loader]]["verdict"]
        real = "loads" if loaded.loaded else "fails"
        record(loader, f"{case}-nvfp4-shared-global", said, real, said == "not-judged", loaded.error)
        assert loaded.loaded == expected.loaded, f"{case} {loader}: {loaded.error or 'loaded'} / {expected.error}"
        if not loaded.loaded:
            assert loaded.error.split(":")[0] == expected.error.split(":")[0], (loaded.error, expected.error)
            continue
        assert said == "loads", (case, loader, said)
        modules = [n.removesuffix(f".{packed}") for n, t in before.items() if n.endswith(f".{packed}")]
        modules = [m for m in modules if before[f"{m}.{packed}"].dtype == torch.uint8]
        assert modules and not loaded.unreadable, loaded.unreadable
        for module in modules:
            got = loaded.weights[module].double()
            source, written = _values(before, module, packed), _values(after, module, packed)
            assert bool(((got - written).abs() <= half_step_of(written)).all()), (case, loader, module)
            bound = worst + half_step_of(source) + half_step_of(written)
            assert bool(((got - source).abs() <= bound).all()), (case, loader, module)


def _values(tensors: dict[str, torch.Tensor], module: str, packed: str) -> torch.Tensor:
    """float64 [out, in]: SOURCE's or OUTPUT's value of each element (compressed-tensors' or ModelOpt's NVFP4)."""
    if packed == "weight_packed":
        return fp4_values(tensors, module)
    from tests.test_modelopt_nvfp4 import modelopt_values

    return modelopt_values(tensors, module)

"""What the real loaders do with compressed-tensors MXFP8 (issue 49), which fp8fix reads and judges
(fp8fix/registry/loaders.py MX_RULES): checkpoints as llm-compressor writes them
(tests/builders.mxfp8_compressed_tensors), of a Llama and of a Phi-3 (fused modules), what `convert --to bf16`
and `--blocks 128x128` write of them, and the MXFP8 `convert --blocks mx` writes of block FP8.

Measured: vLLM 0.19.0 and SGLang 0.5.23 have no compressed-tensors scheme for it (NotImplementedError); vLLM
0.20.2 - 0.32 have one and select an MXFP8 kernel, of which their CPU builds have none (ValueError; a GPU
selects one, so what they compute on a GPU is not seen here: their rows are not judged); transformers 5.24 loads it
through compressed-tensors, which decompresses each layer on the first forward pass to exactly code x 2^(b - 127)
(the OCP MX value, asserted here against the checkpoint's own bytes). Each row must be what its releases did:
`fails` where every one failed so, `loads` where every one loaded those values, `not-judged` where a release's
outcome is not seen here. The BF16 outputs load in every loader with exactly those values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import build, llama, loadable, mxfp8_compressed_tensors, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_real_loaders import VERDICT_ROWS, as_loaded, outcome, true_weights

pytestmark = pytest.mark.loaders

NO_SCHEME = "No compressed-tensors compatible scheme was found"
NO_CPU_KERNEL = "Failed to find a kernel that can implement the MXFP8 linear layer"
#: What each loader does with it, as measured (see the module docstring); None: it loads.
OUTCOMES = {
    "vllm-0.19.0": NO_SCHEME,
    "vllm-0.20.2": NO_CPU_KERNEL,
    "vllm-0.21.0": NO_CPU_KERNEL,
    "vllm-0.31.0": NO_CPU_KERNEL,
    "vllm": NO_CPU_KERNEL,
    "vllm-rocm": NO_CPU_KERNEL,
    "sglang": NO_SCHEME,
    "transformers": None,
}


#: The checkpoints: a Llama (every projection its own tensor) and a Phi-3 (qkv_proj and gate_up_proj fused on
#: disk, one E8M0 byte per 32 elements of each row across the shards).
MODELS = {"llama": llama, "phi3": phi3}


def row_of(releases: list[str | None]) -> str:
    """The verdict a row must give from what its releases did here (None: loaded the MX values; NO_SCHEME:
    failed; NO_CPU_KERNEL: its GPU kernels are not run here)."""
    if any(outcome == NO_CPU_KERNEL for outcome in releases):
        return "not-judged"
    if all(outcome is None for outcome in releases):
        return "loads"
    return "fails" if all(outcome == NO_SCHEME for outcome in releases) else "not-judged"


def test_mxfp8_rows_are_what_the_loaders_do(tmp_path: Path) -> None:
    sources = {name: mxfp8_compressed_tensors(tmp_path / name, loadable(make())) for name, make in MODELS.items()}
    outputs = {}
    for name, src in sources.items():
        assert run_cli("convert", src, tmp_path / f"{name}-bf16", "--to", "bf16").exit_code == 0
        outputs[name] = tmp_path / f"{name}-bf16"
    assert set(OUTCOMES) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], tmp_path / "loaded")
    for i, (name, src) in enumerate(sources.items()):
        rows = json.loads(run_cli("inspect", src, "--json").output)["loaders"]
        plain = json.loads(run_cli("inspect", outputs[name], "--json").output)["loaders"]
        for loader, results in ran.items():
            row = VERDICT_ROWS[loader]
            check_mxfp8_outcome(f"{name}-ct-mxfp8", src, loader, rows[row]["verdict"], results[i])
            # the BF16 output: every loader builds a plain model with exactly the MX values
            bf16 = results[len(sources) + i]
            assert plain[row]["verdict"] == "loads" and bf16.loaded, f"{name}-bf16 {loader}: {bf16.error}"
            record(loader, f"{name}-ct-mxfp8-to-bf16", "loads", "loads")
            assert_mx_values(src, bf16.weights, bf16.unreadable)


def check_mxfp8_outcome(case: str, src: Path, loader: str, said: str, loaded) -> None:
    """An MXFP8 checkpoint's row (`said`) is what its releases did here (`row_of`), and `loaded` is what this
    release was measured to do (OUTCOMES): the error it fails with, or exactly `src`'s MX values; recorded."""
    row = VERDICT_ROWS[loader]
    expected_row = row_of([OUTCOMES[other] for other, r in VERDICT_ROWS.items() if r == row])
    assert said == expected_row, (case, row, said)
    real = "loads" if loaded.loaded else "fails"
    record(loader, case, said, real, not_judged=said == "not-judged", why=loaded.error[:200])
    expected = OUTCOMES[loader]
    if expected is None:
        assert loaded.loaded, f"{case} {loader}: {loaded.error}"
        assert_mx_values(src, loaded.weights, loaded.unreadable)
    else:
        assert not loaded.loaded and expected in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"


def assert_mx_values(src: Path, weights: dict[str, torch.Tensor], unreadable: list[str]) -> None:
    """Every MXFP8 layer computes with exactly its e4m3 codes times 2^(b - 127), b its block's E8M0 byte (under
    the loader's layer names: vLLM and SGLang pack q / k / v and gate / up into one layer)."""
    tensors = load_file(src / "model.safetensors")
    layers = [name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale")]
    assert layers and not unreadable
    truth = {}
    for layer in layers:
        codes, exponents = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
        assert exponents.dtype == torch.uint8
        truth[layer] = codes.float() * torch.exp2(exponents.float() - 127).repeat_interleave(32, dim=1)
    expected = as_loaded(truth, weights)
    for layer, value in expected.items():
        assert layer in weights and torch.equal(weights[layer].float(), value), layer


#: Shapes whose every projection is whole 128 x 128 blocks (head_dim 128), as real models' are.
WHOLE_BLOCKS = {
    "llama": lambda: llama(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=1),
    "phi3": lambda: phi3(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=1),
}


def test_blocks_128_outputs_are_judged_as_the_loaders_load_them(tmp_path: Path) -> None:
    """`convert --blocks 128x128` writes block FP8 (compressed-tensors FP8_BLOCK): each row inspect gives OUTPUT
    is what the loader does with it, against OUTPUT's own values (code x its block's power of two)."""
    outputs = {}
    for name, make in WHOLE_BLOCKS.items():
        src = mxfp8_compressed_tensors(tmp_path / name, loadable(make()), seed=5)
        assert run_cli("convert", src, tmp_path / f"{name}-128", "--blocks", "128x128").exit_code == 0
        outputs[name] = tmp_path / f"{name}-128"
    assert_judged_as_loaded(outputs, "ct-mxfp8-to-block128", tmp_path)


def assert_judged_as_loaded(outputs: dict[str, Path], case: str, tmp_path: Path) -> None:
    """Each output (of a WHOLE_BLOCKS model, by name) loaded by every real loader: each row inspect gives it is what
    the loader does (or not judged), against the output's own values; recorded as `<name>-<case>`."""
    ran = run_loaders(VERDICT_ROWS, list(outputs.values()), tmp_path / "loaded")
    disagree = []
    for i, (name, out) in enumerate(outputs.items()):
        rows = json.loads(run_cli("inspect", out, "--json").output)["loaders"]
        truth = true_weights(out, loadable(WHOLE_BLOCKS[name]()))
        for loader, results in ran.items():
            said = rows[VERDICT_ROWS[loader]]["verdict"]
            real, why = outcome(results[i], truth, out)
            record(loader, f"{name}-{case}", said, real, not_judged=said == "not-judged", why=why)
            if said not in (real, "not-judged"):
                disagree.append((name, loader, said, real, why[:200]))
    assert not disagree, disagree


def test_blocks_mx_outputs_load_as_mxfp8_does(tmp_path: Path) -> None:
    """`convert --blocks mx` writes compressed-tensors MXFP8 from block FP8 (F32 scales, requantized per the
    ue8m0 rule, and E8M0 scales, kept): each loader does with it what it does with llm-compressor's MXFP8, and
    transformers computes with OUTPUT's own MX values; inspect's rows of OUTPUT say so."""
    outputs = {}
    for name, make in MODELS.items():
        for fmt in ("block-fp8", "block-fp8-e8m0"):
            src = build(tmp_path / f"{name}-{fmt}", loadable(make()), fmt=fmt, kv_scales=False, files=1)
            out = tmp_path / f"{name}-{fmt}-mx"
            assert run_cli("convert", src, out, "--blocks", "mx").exit_code == 0
            outputs[f"{name}-{fmt}"] = out
    ran = run_loaders(VERDICT_ROWS, list(outputs.values()), tmp_path / "loaded")
    for i, (name, out) in enumerate(outputs.items()):
        rows = json.loads(run_cli("inspect", out, "--json").output)["loaders"]
        for loader, results in ran.items():
            check_mxfp8_outcome(f"{name}-to-mxfp8", out, loader, rows[VERDICT_ROWS[loader]]["verdict"], results[i])

"""What the real loaders do with a format fp8fix does not read yet (issue 49), where fp8fix's rows say `not
judged` (fp8fix/registry/loaders.py UNREAD_FORMAT_RULES): a compressed-tensors MXFP8 checkpoint as
llm-compressor writes it (tests/builders.mxfp8_compressed_tensors), of a Llama and of a Phi-3 (fused modules).

Measured: vLLM 0.19.0 and SGLang 0.5.23 have no compressed-tensors scheme for it (NotImplementedError); vLLM
0.20.2 - 0.32 have one and select an MXFP8 kernel, of which their CPU builds have none (ValueError; a GPU
selects one, so what they load on a GPU is not seen here); transformers 5.24 loads it through compressed-tensors,
which decompresses each layer on the first forward pass to exactly code x 2^(b - 127) (the OCP MX value, asserted
here against the checkpoint's own bytes). No row claims more than this: each is `not-judged`, and
every outcome here is recorded as not judged in the matrix. If a loader's outcome changes, this test says so,
and the rows are to be measured anew.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import llama, loadable, mxfp8_compressed_tensors, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_real_loaders import VERDICT_ROWS

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


def test_mxfp8_rows_are_not_judged_and_the_loaders_do_what_the_rules_say(tmp_path: Path) -> None:
    sources = {name: mxfp8_compressed_tensors(tmp_path / name, loadable(make())) for name, make in MODELS.items()}
    assert set(OUTCOMES) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, list(sources.values()), tmp_path / "loaded")
    for i, (name, src) in enumerate(sources.items()):
        rows = json.loads(run_cli("inspect", src, "--json").output)["loaders"]
        for loader, results in ran.items():
            loaded, row = results[i], VERDICT_ROWS[loader]
            assert rows[row]["verdict"] == "not-judged", (name, row)
            real = "loads" if loaded.loaded else "fails"
            record(loader, f"{name}-ct-mxfp8", "not-judged", real, not_judged=True, why=loaded.error[:200])
            expected = OUTCOMES[loader]
            if expected is None:
                assert loaded.loaded, f"{name} {loader}: {loaded.error}"
                assert_mx_values(src, loaded.weights, loaded.unreadable)
            else:
                assert not loaded.loaded and expected in loaded.error, f"{name} {loader}: {loaded.error or 'loaded'}"


def assert_mx_values(src: Path, weights: dict[str, torch.Tensor], unreadable: list[str]) -> None:
    """Every MXFP8 layer computes with exactly its e4m3 codes times 2^(b - 127), b its block's E8M0 byte."""
    tensors = load_file(src / "model.safetensors")
    layers = [name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale")]
    assert layers and not unreadable
    for layer in layers:
        codes, exponents = tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"]
        assert exponents.dtype == torch.uint8
        value = codes.float() * torch.exp2(exponents.float() - 127).repeat_interleave(32, dim=1)
        assert torch.equal(weights[layer], value), layer

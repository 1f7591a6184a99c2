"""What the real loaders do with ModelOpt NVFP4 (issue 49; fp8fix/registry/loaders.py MODELOPT_NVFP4_RULES) and with
what `convert --to bf16` writes of it, on a Llama (weight_scale_2 shared by q / k / v and gate / up, as ModelOpt's
export unifies them, or each module's own) and a Phi-3 (fused on disk), built by tests/builders.modelopt_nvfp4.

Measured here (OUTCOMES): every vLLM release stops on CPU (0.19.0 at the platform query, the rest finding no NVFP4
kernel), SGLang's native NVFP4 GEMMs want SM100+ (the stubbed platform is not), so a GPU's outcome is not seen: not
judged, except where vLLM's and SGLang's source say what they do whatever the kernel (packed projections whose
weight_scale_2 differ: all multiplied by the largest; cited, `loads-wrong`). transformers has no ModelOpt quantizer
and refuses the packed weights: fails. The BF16 outputs load in every loader with exactly fp8fix's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import llama, loadable, modelopt_nvfp4, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_fp4_loads import NO_KERNEL, NO_PLATFORM
from tests.loaders.test_real_loaders import VERDICT_ROWS, as_loaded

pytestmark = pytest.mark.loaders

SM100 = "ModelOpt NVFP4 native dense GEMM backends require SM100+"
NO_QUANTIZER = "ignore_mismatched_sizes"
#: case -> (model, weight_scale_2 shared by packed projections)
CASES = {"llama": (llama, True), "llama-own-scale-2": (llama, False), "phi3": (phi3, True)}
#: loader -> what it said of every case here (an error's text)
OUTCOMES = {
    **{loader: NO_KERNEL for loader in VERDICT_ROWS if loader.startswith("vllm")},
    "vllm-0.19.0": NO_PLATFORM,
    "sglang": SM100,
    "transformers": NO_QUANTIZER,
}
#: the rows cited from source: packed projections' weight_scale_2 that differ are all taken as the largest
CITED_ROWS = ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32", "SGLang 0.5.23")


def row_of(case: str, row: str) -> str:
    """The verdict a row must give: cited where weight_scale_2 differ; transformers' refusal; else not judged (the
    CPU shows no GPU's kernels)."""
    if case.endswith("own-scale-2") and row in CITED_ROWS:
        return "loads-wrong"
    return "fails" if row == "transformers" else "not-judged"


def test_modelopt_nvfp4_rows_are_what_the_loaders_do(tmp_path: Path) -> None:
    sources = {
        case: modelopt_nvfp4(tmp_path / case, loadable(make()), shared_global=shared)
        for case, (make, shared) in CASES.items()
    }
    outputs = {case: tmp_path / f"{case}-bf16" for case in sources}
    for case, src in sources.items():
        assert run_cli("convert", src, outputs[case], "--to", "bf16").exit_code == 0
    assert set(OUTCOMES) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], tmp_path / "loaded")
    for i, case in enumerate(sources):
        rows = json.loads(run_cli("inspect", sources[case], "--json").stdout)["loaders"]
        plain = json.loads(run_cli("inspect", outputs[case], "--json").stdout)["loaders"]
        written = load_file(outputs[case] / "model.safetensors")
        truth = {n.removesuffix(".weight"): t.float() for n, t in written.items() if n.endswith("proj.weight")}
        for loader, results in ran.items():
            row, loaded, bf16 = VERDICT_ROWS[loader], results[i], results[len(sources) + i]
            said = rows[row]["verdict"]
            assert said == row_of(case, row), (case, row, said, rows[row]["reason"])
            cited = said == "loads-wrong"
            record(
                loader, f"modelopt-{case}", said, "loads" if loaded.loaded else "fails", said != "fails", loaded.error
            )
            assert not loaded.loaded and OUTCOMES[loader] in loaded.error, (
                f"{case} {loader}: {loaded.error or 'loaded'}"
            )
            if cited:
                assert "weight_scale_2.max()" in rows[row]["evidence"], rows[row]["evidence"]
            # the BF16 output: every loader builds a plain model with exactly the values fp8fix wrote
            assert plain[row]["verdict"] == "loads" and bf16.loaded, f"{case}-bf16 {loader}: {bf16.error}"
            record(loader, f"modelopt-{case}-to-bf16", "loads", "loads")
            compared = as_loaded(truth, bf16.weights)
            assert compared, (case, loader)
            for layer, value in compared.items():
                if layer in bf16.weights:
                    assert torch.equal(bf16.weights[layer].float(), value), (case, loader, layer)

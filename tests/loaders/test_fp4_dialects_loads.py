"""What the real loaders do with the dialects beyond compressed-tensors (issue 49; fp8fix/registry/loaders.py
GPT_OSS_RULES, MODELOPT_NVFP4_RULES, MODELOPT_MXFP8_RULES) and with what `convert --to bf16` writes of them. Every
loader runs once over all their checkpoints (`loads`): a loader's start-up, not its folders, is what this file costs.

gpt-oss's MXFP4 experts (tests/builders.gpt_oss, two sizes: the down projection square, and not): vLLM 0.31 and 0.32
find no MXFP4 MoE kernel on CPU; 0.19 - 0.21 load the experts packed for a CPU kernel, whose values are not readable
and say nothing of a GPU's kernels: not judged. SGLang registers its mxfp4 method on real platforms only, not the
stubbed one here: not judged. transformers, without triton kernels, dequantizes each expert on load: asserted equal
to the values worked out from the checkpoint's bytes (tests/test_gpt_oss.expert_values). The BF16 output loads in
every loader, and vLLM's and transformers' experts hold exactly fp8fix's values (vLLM: each expert transposed back
to [out, in], as its loader does); SGLang's gpt-oss class is not read here, so that row stays not judged.

ModelOpt NVFP4 (tests/builders.modelopt_nvfp4: a Llama with weight_scale_2 shared by q / k / v and gate / up, as
ModelOpt's export unifies them, or each module's own, and a Phi-3): every vLLM release stops on CPU (0.19.0 at the
platform query, the rest finding no NVFP4 kernel), SGLang's native NVFP4 GEMMs want SM100+, so a GPU's outcome is not
seen: not judged, except where vLLM's and SGLang's source say what they do whatever the kernel (packed projections
whose weight_scale_2 differ: all multiplied by the largest; cited, `loads-wrong`). transformers has no ModelOpt
quantizer and refuses the packed weights: fails.

ModelOpt MXFP8 (tests/builders.modelopt_mxfp8, a Llama and a Phi-3): vLLM 0.20 - 0.32 find no MXFP8 kernel on CPU
and 0.19 refuses the platform's compute capability, as SGLang does (MXFP8 wants 100 and up): not judged. transformers
has no ModelOpt quantizer: it loads the e4m3fn codes into plain Linear layers, the scales unexpected keys, and
computes with the raw codes (asserted: loads-wrong).

Every BF16 output loads in every loader with exactly fp8fix's values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import gpt_oss, llama, loadable, modelopt_mxfp8, modelopt_nvfp4, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, record, run_loaders
from tests.loaders.test_fp4_loads import NO_KERNEL, NO_PLATFORM
from tests.loaders.test_mx_formats import NO_CPU_KERNEL
from tests.loaders.test_real_loaders import VERDICT_ROWS, as_loaded
from tests.test_gpt_oss import expert_values

pytestmark = pytest.mark.loaders


def _sources(root: Path) -> dict[str, Path]:
    """Every checkpoint of the three dialects, by case."""
    return {
        "gpt-oss-square": gpt_oss(root / "gpt-oss-square", seed=0, hidden=64, intermediate=64),
        "gpt-oss-wide": gpt_oss(root / "gpt-oss-wide", seed=1, hidden=64, intermediate=96),
        "modelopt-nvfp4-llama": modelopt_nvfp4(root / "nvfp4-llama", loadable(llama())),
        "modelopt-nvfp4-llama-own-scale-2": modelopt_nvfp4(root / "nvfp4-own", loadable(llama()), shared_global=False),
        "modelopt-nvfp4-phi3": modelopt_nvfp4(root / "nvfp4-phi3", loadable(phi3())),
        "modelopt-mxfp8-llama": modelopt_mxfp8(root / "mxfp8-llama", loadable(llama())),
        "modelopt-mxfp8-phi3": modelopt_mxfp8(root / "mxfp8-phi3", loadable(phi3())),
    }


@dataclass
class Loads:
    """Each case's SOURCE and BF16 OUTPUT, and what every loader did with each: (SOURCE's, OUTPUT's) by loader."""

    sources: dict[str, Path]
    outputs: dict[str, Path]
    loaded: dict[str, dict[str, tuple[Loaded, Loaded]]]

    def cases(self, prefix: str) -> list[str]:
        return [case for case in self.sources if case.startswith(prefix)]

    def rows(self, case: str) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """inspect's rows of SOURCE and of its BF16 OUTPUT."""
        src = json.loads(run_cli("inspect", self.sources[case], "--json").stdout)["loaders"]
        return src, json.loads(run_cli("inspect", self.outputs[case], "--json").stdout)["loaders"]

    def written(self, case: str) -> dict[str, torch.Tensor]:
        """OUTPUT's projections as fp8fix wrote them, float32, by module."""
        tensors = load_file(self.outputs[case] / "model.safetensors")
        return {n.removesuffix(".weight"): t.float() for n, t in tensors.items() if n.endswith("proj.weight")}


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> Loads:
    root = tmp_path_factory.mktemp("dialects")
    sources = _sources(root)
    outputs = {case: root / f"{case}-bf16" for case in sources}
    for case, src in sources.items():
        assert run_cli("convert", src, outputs[case], "--to", "bf16").exit_code == 0
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], root / "loaded")
    n = len(sources)
    loaded = {case: {loader: (r[i], r[n + i]) for loader, r in ran.items()} for i, case in enumerate(sources)}
    return Loads(sources, outputs, loaded)


def _assert_bf16_loaded(loads: Loads, case: str, plain: dict[str, dict[str, str]]) -> None:
    """Every loader builds the BF16 OUTPUT as a plain model with exactly the values fp8fix wrote."""
    truth = loads.written(case)
    for loader, (_, bf16) in loads.loaded[case].items():
        row = VERDICT_ROWS[loader]
        assert plain[row]["verdict"] == "loads" and bf16.loaded, f"{case}-bf16 {loader}: {bf16.error}"
        record(loader, f"{case}-to-bf16", "loads", "loads")
        compared = as_loaded(truth, bf16.weights)
        assert compared, (case, loader)
        for layer, value in compared.items():
            if layer in bf16.weights:
                assert torch.equal(bf16.weights[layer].float(), value), (case, loader, layer)


#: gpt-oss: loader -> what it did with the MXFP4 source here: an error's text, "packed" (loaded, experts not
#: readable: a CPU kernel's layout), or None (loaded the format's values)
GPT_OSS_OUTCOMES: dict[str, str | None] = {
    "vllm-0.19.0": "packed",
    "vllm-0.20.2": "packed",
    "vllm-0.21.0": "packed",
    "vllm-0.31.0": "No MXFP4 MoE backend supports the deployment configuration",
    "vllm": "No MXFP4 MoE backend supports the deployment configuration",
    "vllm-rocm": "No MXFP4 MoE backend supports the deployment configuration",
    "sglang": "Unknown quantization method: mxfp4",
    "transformers": None,
}
#: what each row must say of the source: only transformers' values are seen; the rest ran CPU kernels or none
GPT_OSS_SOURCE_ROWS = {row: "loads" if row == "transformers" else "not-judged" for row in VERDICT_ROWS.values()}
#: ... and of the BF16 output: each loader read back with fp8fix's values, but SGLang's experts, not read here
GPT_OSS_OUTPUT_ROWS = {row: "not-judged" if row == "SGLang 0.5.23" else "loads" for row in VERDICT_ROWS.values()}


def test_gpt_oss_rows_are_what_the_loaders_do(loads: Loads) -> None:
    assert set(GPT_OSS_OUTCOMES) == set(VERDICT_ROWS)
    for case in loads.cases("gpt-oss"):
        rows, plain = loads.rows(case)
        tensors = load_file(loads.sources[case] / "model.safetensors")
        params = [p.removesuffix("_blocks") for p in tensors if p.endswith("_blocks")]
        values = {param: expert_values(tensors, param) for param in params}  # [experts, in, out], float64
        for loader, (loaded, bf16) in loads.loaded[case].items():
            row, outcome = VERDICT_ROWS[loader], GPT_OSS_OUTCOMES[loader]
            said = rows[row]["verdict"]
            assert said == GPT_OSS_SOURCE_ROWS[row], (case, row, said, rows[row]["reason"])
            record(loader, case, said, "loads" if loaded.loaded else "fails", said == "not-judged")
            if outcome is None:
                assert loaded.loaded, f"{case} {loader}: {loaded.error}"
                for param, value in values.items():
                    assert torch.equal(loaded.weights[param].double(), value), (case, loader, param)
            elif outcome == "packed":
                assert loaded.loaded and not any(p in loaded.weights for p in values), (case, loader)
            else:
                assert not loaded.loaded and outcome in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"
            # the BF16 output: a plain gpt-oss, each loader's experts exactly the format's values
            said = GPT_OSS_OUTPUT_ROWS[row]
            assert plain[row]["verdict"] == said and bf16.loaded, (case, row, plain[row], bf16.error)
            record(loader, f"{case}-to-bf16", said, "loads", said == "not-judged")
            if row == "SGLang 0.5.23":
                continue
            for param, value in values.items():
                got = _loaded_expert(bf16.weights, param)
                assert got is not None and torch.equal(got.double(), value), (case, loader, param)


def _loaded_expert(weights: dict[str, torch.Tensor], param: str) -> torch.Tensor | None:
    """A loader's copy of gpt-oss expert parameter `param` as [experts, in, out]: transformers' under its name,
    vLLM's FusedMoE `w13_weight` / `w2_weight` ([experts, out, in]; 0.31 and later under `routed_experts`)."""
    if param in weights:
        return weights[param]
    layer, _, proj = param.rpartition(".")
    moe = "w13_weight" if proj == "gate_up_proj" else "w2_weight"
    found = weights.get(f"{layer}.{moe}", weights.get(f"{layer}.routed_experts.{moe}"))
    return found.transpose(1, 2) if found is not None else None


#: ModelOpt NVFP4: loader -> what it said of every case here (an error's text)
NVFP4_OUTCOMES = {
    **{loader: NO_KERNEL for loader in VERDICT_ROWS if loader.startswith("vllm")},
    "vllm-0.19.0": NO_PLATFORM,
    "sglang": "ModelOpt NVFP4 native dense GEMM backends require SM100+",
    "transformers": "ignore_mismatched_sizes",
}
#: the rows cited from source: packed projections' weight_scale_2 that differ are all taken as the largest
NVFP4_CITED_ROWS = ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32", "SGLang 0.5.23")


def nvfp4_row(case: str, row: str) -> str:
    """The verdict a row must give: cited where weight_scale_2 differ; transformers' refusal; else not judged (the
    CPU shows no GPU's kernels)."""
    if case.endswith("own-scale-2") and row in NVFP4_CITED_ROWS:
        return "loads-wrong"
    return "fails" if row == "transformers" else "not-judged"


def test_modelopt_nvfp4_rows_are_what_the_loaders_do(loads: Loads) -> None:
    assert set(NVFP4_OUTCOMES) == set(VERDICT_ROWS)
    for case in loads.cases("modelopt-nvfp4"):
        rows, plain = loads.rows(case)
        for loader, (loaded, _) in loads.loaded[case].items():
            row = VERDICT_ROWS[loader]
            said = rows[row]["verdict"]
            assert said == nvfp4_row(case, row), (case, row, said, rows[row]["reason"])
            record(loader, case, said, "loads" if loaded.loaded else "fails", said != "fails", loaded.error)
            error = NVFP4_OUTCOMES[loader]
            assert not loaded.loaded and error in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"
            if said == "loads-wrong":
                assert "weight_scale_2.max()" in rows[row]["evidence"], rows[row]["evidence"]
        _assert_bf16_loaded(loads, case, plain)


#: ModelOpt MXFP8: what each loader does with it, as measured; None: it loads (the raw codes)
MXFP8_OUTCOMES = {
    **{loader: NO_CPU_KERNEL for loader in VERDICT_ROWS if loader.startswith("vllm")},
    "vllm-0.19.0": "is not supported for the current GPU. Minimum capability: 100",
    "sglang": "is not supported for the current GPU. Minimum capability: 100",
    "transformers": None,
}


def test_modelopt_mxfp8_rows_are_what_the_loaders_do(loads: Loads) -> None:
    assert set(MXFP8_OUTCOMES) == set(VERDICT_ROWS)
    for case in loads.cases("modelopt-mxfp8"):
        rows, plain = loads.rows(case)
        tensors = load_file(loads.sources[case] / "model.safetensors")
        codes = {n.removesuffix(".weight"): t.float() for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
        truth = loads.written(case)
        for loader, (loaded, _) in loads.loaded[case].items():
            row, outcome = VERDICT_ROWS[loader], MXFP8_OUTCOMES[loader]
            said = rows[row]["verdict"]
            real = "loads-wrong" if outcome is None else "fails"
            record(loader, case, said, real, said == "not-judged", loaded.error)
            if outcome is None:  # transformers: every layer's raw codes, not code x 2^(b - 127)
                assert said == "loads-wrong" and loaded.loaded, (case, loader, said, loaded.error)
                for layer, value in as_loaded(codes, loaded.weights).items():
                    assert torch.equal(loaded.weights[layer], value), (case, loader, layer)
                    assert not torch.equal(loaded.weights[layer], as_loaded(truth, loaded.weights)[layer])
            else:
                assert said == "not-judged", (case, row, said)
                assert not loaded.loaded and outcome in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"
        _assert_bf16_loaded(loads, case, plain)


def test_modelopt_mxfp8_as_128_blocks_is_judged_as_the_loaders_load_it(tmp_path: Path) -> None:
    """`convert --blocks 128x128` of ModelOpt MXFP8 writes compressed-tensors block FP8 (FP8_BLOCK, ModelOpt's side
    config left behind): each row inspect gives OUTPUT is what the loader does with it, against OUTPUT's own values
    (a Llama and a Phi-3 of whole 128-blocks; the config in config.json, and in hf_quant_config.json)."""
    from tests.loaders.test_mx_formats import WHOLE_BLOCKS, assert_judged_as_loaded

    outputs = {}
    for name, make in WHOLE_BLOCKS.items():
        src = modelopt_mxfp8(tmp_path / name, loadable(make()), side_file=name == "phi3")
        assert run_cli("convert", src, tmp_path / f"{name}-128", "--blocks", "128x128").exit_code == 0
        assert not (tmp_path / f"{name}-128" / "hf_quant_config.json").exists()
        outputs[name] = tmp_path / f"{name}-128"
    assert_judged_as_loaded(outputs, "modelopt-mxfp8-to-block128", tmp_path)

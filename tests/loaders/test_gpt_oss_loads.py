"""What the real loaders do with gpt-oss's MXFP4 experts (issue 49; fp8fix/registry/loaders.py GPT_OSS_RULES) and
with what `convert --to bf16` writes of them, on a tiny gpt-oss as OpenAI publishes it (tests/builders.gpt_oss),
in two sizes (the down projection square, and not).

Measured here (OUTCOMES): vLLM 0.31 and 0.32 find no MXFP4 MoE kernel on CPU; 0.19 - 0.21 load the experts packed
for a CPU kernel, whose values are not readable and say nothing of a GPU's kernels: not judged. SGLang registers its
mxfp4 method on real platforms only, not the stubbed one here: not judged. transformers, without triton kernels,
dequantizes each expert on load: asserted equal to the values worked out from the checkpoint's bytes
(tests/test_gpt_oss.expert_values). The BF16 output loads in every loader, and vLLM's and transformers' experts
hold exactly fp8fix's values (vLLM: each expert transposed back to [out, in], as its loader does); SGLang's gpt-oss
class is not read here, so that row stays not judged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import gpt_oss
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_real_loaders import VERDICT_ROWS
from tests.test_gpt_oss import expert_values

pytestmark = pytest.mark.loaders

NO_MOE_KERNEL = "No MXFP4 MoE backend supports the deployment configuration"
NO_METHOD = "Unknown quantization method: mxfp4"
#: loader -> what it did with the MXFP4 source here: an error's text, "packed" (loaded, experts not readable:
#: a CPU kernel's layout), or None (loaded the format's values)
OUTCOMES: dict[str, str | None] = {
    "vllm-0.19.0": "packed",
    "vllm-0.20.2": "packed",
    "vllm-0.21.0": "packed",
    "vllm-0.31.0": NO_MOE_KERNEL,
    "vllm": NO_MOE_KERNEL,
    "vllm-rocm": NO_MOE_KERNEL,
    "sglang": NO_METHOD,
    "transformers": None,
}
#: what each row must say of the source: only transformers' values are seen; the rest ran CPU kernels or none
SOURCE_ROWS = {row: "loads" if row == "transformers" else "not-judged" for row in VERDICT_ROWS.values()}
#: ... and of the BF16 output: each loader read back with fp8fix's values, but SGLang's experts, not read here
OUTPUT_ROWS = {row: "not-judged" if row == "SGLang 0.5.23" else "loads" for row in VERDICT_ROWS.values()}


def test_gpt_oss_rows_are_what_the_loaders_do(tmp_path: Path) -> None:
    sizes = {"square": {"hidden": 64, "intermediate": 64}, "wide": {"hidden": 64, "intermediate": 96}}
    sources = {case: gpt_oss(tmp_path / case, seed=i, **size) for i, (case, size) in enumerate(sizes.items())}
    outputs = {case: tmp_path / f"{case}-bf16" for case in sources}
    for case, src in sources.items():
        assert run_cli("convert", src, outputs[case], "--to", "bf16").exit_code == 0
    assert set(OUTCOMES) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], tmp_path / "loaded")
    for i, (case, src) in enumerate(sources.items()):
        rows = json.loads(run_cli("inspect", src, "--json").stdout)["loaders"]
        plain = json.loads(run_cli("inspect", outputs[case], "--json").stdout)["loaders"]
        tensors = load_file(src / "model.safetensors")
        exact = {p.removesuffix("_blocks"): None for p in tensors if p.endswith("_blocks")}
        values = {param: expert_values(tensors, param) for param in exact}  # [experts, in, out], float64
        for loader, results in ran.items():
            row, loaded, bf16 = VERDICT_ROWS[loader], results[i], results[len(sources) + i]
            said = rows[row]["verdict"]
            assert said == SOURCE_ROWS[row], (case, row, said, rows[row]["reason"])
            outcome = OUTCOMES[loader]
            record(loader, f"gpt-oss-{case}", said, "loads" if loaded.loaded else "fails", said == "not-judged")
            if outcome is None:
                assert loaded.loaded, f"{case} {loader}: {loaded.error}"
                for param, value in values.items():
                    assert torch.equal(loaded.weights[param].double(), value), (case, loader, param)
            elif outcome == "packed":
                assert loaded.loaded and not any(p in loaded.weights for p in values), (case, loader)
            else:
                assert not loaded.loaded and outcome in loaded.error, f"{case} {loader}: {loaded.error or 'loaded'}"
            # the BF16 output: a plain gpt-oss, each loader's experts exactly the format's values
            assert plain[row]["verdict"] == OUTPUT_ROWS[row], (case, row, plain[row])
            assert bf16.loaded, f"{case}-bf16 {loader}: {bf16.error}"
            record(loader, f"gpt-oss-{case}-to-bf16", OUTPUT_ROWS[row], "loads", OUTPUT_ROWS[row] == "not-judged")
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

"""What the real loaders do with ModelOpt MXFP8 (issue 49; fp8fix/registry/loaders.py MODELOPT_MXFP8_RULES) and with
what `convert --to bf16` writes of it, on a Llama and a Phi-3 (tests/builders.modelopt_mxfp8).

Measured here (OUTCOMES): vLLM 0.20 - 0.32 find no MXFP8 kernel on CPU and 0.19 refuses the platform's compute
capability, as SGLang does (MXFP8 wants 100 and up): a Blackwell's outcome is not seen, not judged. transformers has
no ModelOpt quantizer: it loads the e4m3fn codes into plain Linear layers, the scales unexpected keys, and computes
with the raw codes (asserted: loads-wrong). The BF16 outputs load in every loader with exactly fp8fix's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import llama, loadable, modelopt_mxfp8, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_mx_formats import NO_CPU_KERNEL
from tests.loaders.test_real_loaders import VERDICT_ROWS, as_loaded

pytestmark = pytest.mark.loaders

CAPABILITY = "is not supported for the current GPU. Minimum capability: 100"
#: What each loader does with it, as measured (see the module docstring); None: it loads (the raw codes).
OUTCOMES = {
    **{loader: NO_CPU_KERNEL for loader in VERDICT_ROWS if loader.startswith("vllm")},
    "vllm-0.19.0": CAPABILITY,
    "sglang": CAPABILITY,
    "transformers": None,
}


def test_modelopt_mxfp8_rows_are_what_the_loaders_do(tmp_path: Path) -> None:
    sources = {
        name: modelopt_mxfp8(tmp_path / name, loadable(make())) for name, make in (("llama", llama), ("phi3", phi3))
    }
    outputs = {name: tmp_path / f"{name}-bf16" for name in sources}
    for name, src in sources.items():
        assert run_cli("convert", src, outputs[name], "--to", "bf16").exit_code == 0
    assert set(OUTCOMES) == set(VERDICT_ROWS)
    ran = run_loaders(VERDICT_ROWS, [*sources.values(), *outputs.values()], tmp_path / "loaded")
    for i, (name, src) in enumerate(sources.items()):
        rows = json.loads(run_cli("inspect", src, "--json").stdout)["loaders"]
        plain = json.loads(run_cli("inspect", outputs[name], "--json").stdout)["loaders"]
        tensors = load_file(src / "model.safetensors")
        codes = {n.removesuffix(".weight"): t.float() for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
        written = load_file(outputs[name] / "model.safetensors")
        truth = {m: written[f"{m}.weight"].float() for m in codes}
        for loader, results in ran.items():
            row, loaded, bf16 = VERDICT_ROWS[loader], results[i], results[len(sources) + i]
            said, outcome = rows[row]["verdict"], OUTCOMES[loader]
            real = "loads-wrong" if outcome is None else "fails"
            record(loader, f"modelopt-mxfp8-{name}", said, real, said == "not-judged", loaded.error)
            if outcome is None:  # transformers: every layer's raw codes, not code x 2^(b - 127)
                assert said == "loads-wrong" and loaded.loaded, (name, loader, said, loaded.error)
                for layer, value in as_loaded(codes, loaded.weights).items():
                    assert torch.equal(loaded.weights[layer], value), (name, loader, layer)
                    assert not torch.equal(loaded.weights[layer], as_loaded(truth, loaded.weights)[layer])
            else:
                assert said == "not-judged", (name, row, said)
                assert not loaded.loaded and outcome in loaded.error, f"{name} {loader}: {loaded.error or 'loaded'}"
            assert plain[row]["verdict"] == "loads" and bf16.loaded, f"{name}-bf16 {loader}: {bf16.error}"
            record(loader, f"modelopt-mxfp8-{name}-to-bf16", "loads", "loads")
            for layer, value in as_loaded(truth, bf16.weights).items():
                if layer in bf16.weights:
                    assert torch.equal(bf16.weights[layer].float(), value), (name, loader, layer)

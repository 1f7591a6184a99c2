"""The `SGLang 0.5.23` row (issue 29, part 5): what SGLang's own weight loading does, as measured by
tests/loaders (sglang_load.py runs its model classes, weight loaders and process_weights_after_loading on CPU),
judged here from the checkpoints' construction.

Expectations from SGLang 0.5.23's source and the real loads, not from fp8fix: its Llama-family loader
(`LlamaForCausalLM._legacy_load_weights`, Phi-3 included) renames `weight_scale_inv` to `weight_scale`, which
its block-FP8 layers do not have, so block scales are never loaded; it serves GLM through its Transformers
backend, which refuses GLM's tensor-parallel plan; it has no `fbgemm_fp8`; it packs Llama's q / k / v and
builds the packed layer FP8 even where compressed-tensors lists them unquantized; the other outcomes are
vLLM's (it shares their origin, and the suite measured each again). Architectures whose SGLang model class the
suite does not run are not judged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, glm, llama, phi3
from tests.conftest import run_cli
from tests.test_registry import MODELS

SGLANG, VLLM = "SGLang 0.5.23", "vLLM >= 0.32"


def verdict(folder: Path) -> dict[str, str]:
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.output
    return {row: v["verdict"] for row, v in json.loads(result.stdout)["loaders"].items()}


@pytest.mark.parametrize("shape", ["llama", "phi3"])
def test_block_fp8_loads_wrong_in_sglangs_llama_loader(tmp_path: Path, shape: str) -> None:
    said = verdict(build(tmp_path / "src", llama() if shape == "llama" else phi3(), fmt="block-fp8", scale="block"))
    assert (said[VLLM], said[SGLANG]) == ("loads", "loads-wrong")


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors", "block-fp8"])
def test_glm_fails_in_sglang_fp8_or_not(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", glm(), fmt=fmt, scale="block" if fmt == "block-fp8" else "tensor")
    assert verdict(src)[SGLANG] == "fails"
    assert run_cli("convert", src, tmp_path / "bf16", "--to", "bf16", "-q").exit_code == 0
    assert verdict(tmp_path / "bf16")[SGLANG] == "fails"  # the plain model too


def test_fbgemm_is_unknown_to_sglang(tmp_path: Path) -> None:
    assert verdict(build(tmp_path / "src", llama(), fmt="fbgemm", scale="channel"))[SGLANG] == "fails"


@pytest.mark.parametrize("fmt", ["compressed-tensors", "quark"])
def test_unquantized_q_k_v_of_a_llama_load_wrong_in_sglang(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", llama(), fmt=fmt, scale="tensor", complete=True)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--dequantize", "*.layers.0.self_attn.*", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loaders"][SGLANG]["verdict"] == verdict(out)[SGLANG] == "loads-wrong"
    assert verdict(out)[VLLM] == "loads"


def test_what_sglang_shares_with_vllm_and_what_it_does_not_run(tmp_path: Path) -> None:
    for fmt, scale in [("fp8", "tensor"), ("fp8", "shard"), ("compressed-tensors", "channel")]:
        said = verdict(build(tmp_path / f"{fmt}-{scale}", phi3(), fmt=fmt, scale=scale))
        assert said[SGLANG] == said[VLLM], (fmt, scale)
    model, _ = MODELS["dbrx"]  # an architecture whose SGLang model class the suite does not run
    assert verdict(build(tmp_path / "dbrx", model))[SGLANG] == "not-judged"

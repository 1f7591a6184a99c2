"""Whether vLLM 0.32 uses a checkpoint's kv-cache scales, read back from its attention layers (issue 29,
part 4: measurements; the verdicts that say it are still to come).

Each format writes its k / v scales as its exporter does (tests/builders.py: 0.0625, not the 1.0 vLLM falls
back to), and the harness reports each attention layer's kv cache dtype and the `_k_scale` / `_v_scale` it
ended with. Expected, from vLLM 0.32's source: the default call (`kv_cache_dtype="auto"`) keeps a BF16 cache
unless the checkpoint's quantization config declares an FP8 kv cache, which compressed-tensors does with
`kv_cache_scheme` (model_executor/layers/attention/attention.py `Attention.__init__`: "auto" becomes "fp8")
and ModelOpt with `kv_cache_quant_algo` (quantization/modelopt.py: its kv cache method); an AutoFP8
`quant_method: fp8` config has no such key vLLM reads (AMD's `kv_cache_scheme: "static"` under it is not
read), so its scales are left at 1.0: unused. With `--kv-cache-dtype fp8` every one of them is used.
fp8fix's `--format compressed-tensors` output of an AutoFP8 source declares `kv_cache_scheme`: its scales
are used by the default call.
"""

from __future__ import annotations

import pytest

from tests.builders import build, llama
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, run_loader

pytestmark = pytest.mark.loaders

#: format -> the kv-cache scales used by the default call (else: left at 1.0, a BF16 cache); "fp8 -> ct":
#: fp8fix's `--format compressed-tensors` output of the AutoFP8 source, which declares `kv_cache_scheme`
USED_BY_DEFAULT = {"fp8": False, "fp8-amd-kv": False, "compressed-tensors": True, "modelopt": True, "fp8 -> ct": True}
SCALE = 0.0625  # what tests/builders.py writes for k and v


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Loaded]]:
    root = tmp_path_factory.mktemp("kv")
    formats = [fmt for fmt in USED_BY_DEFAULT if " -> " not in fmt]
    folders = [build(root / fmt, llama(), fmt=fmt, scale="tensor", kv_scales=True) for fmt in formats]
    converted = run_cli("convert", root / "fp8", root / "fp8-ct", "--format", "compressed-tensors", "-q")
    assert converted.exit_code == 0, converted.output
    folders.append(root / "fp8-ct")
    calls = {"default": {}, "fp8": {"FP8FIX_VLLM_KV_CACHE_DTYPE": "fp8"}}
    results = {call: run_loader("vllm", folders, root / f"out-{call}", env=env) for call, env in calls.items()}
    return {call: dict(zip(USED_BY_DEFAULT, r, strict=True)) for call, r in results.items()}


@pytest.mark.parametrize("call", ["default", "fp8"])
@pytest.mark.parametrize("fmt", list(USED_BY_DEFAULT))
def test_vllm_uses_kv_cache_scales_where_its_source_says(
    loads: dict[str, dict[str, Loaded]], fmt: str, call: str
) -> None:
    result = loads[call][fmt]
    assert result.loaded, result.error
    layers = result.kv_cache or {}
    assert len(layers) == llama().layers, layers
    used = call == "fp8" or USED_BY_DEFAULT[fmt]
    for name, layer in layers.items():
        scales = (*layer["k_scale"], *layer["v_scale"])
        if used:
            assert layer["dtype"].startswith("fp8") and set(scales) == {SCALE}, (name, layer)
        else:
            assert layer["dtype"] == "auto" and set(scales) == {1.0}, (name, layer)

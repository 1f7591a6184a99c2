"""Whether each loader row's call uses a checkpoint's kv-cache scales, read back after a real load, against the
`kv_cache_scales` verdict fp8fix prints for that row (issue 29, part 4). Each format writes its k / v scales as its
exporter does (tests/builders.py: 0.0625, not the 1.0 vLLM falls back to). vLLM: the harness reports each attention
layer's kv cache dtype and the `_k_scale` / `_v_scale` it ended with. Expected, from vLLM 0.32's source: the
default call (`kv_cache_dtype="auto"`) keeps a BF16 cache unless the checkpoint's quantization config declares an
FP8 kv cache, which compressed-tensors does with `kv_cache_scheme` (model_executor/layers/attention/attention.py
`Attention.__init__`: "auto" becomes "fp8") and ModelOpt with `kv_cache_quant_algo` (utils/torch_utils.py
resolve_kv_cache_dtype_string); an AutoFP8 `quant_method: fp8` config has no such key vLLM reads (AMD's
`kv_cache_scheme: "static"` under it is not read), so its scales are left at 1.0: unused. With `--kv-cache-dtype
fp8` every one of them is used. The ROCm row (FP8FIX_VLLM_ROCM=1) takes the same path, and doubles ModelOpt's
scales for its e4m3fnuz cache (quantization/kv_cache.py) but keeps compressed-tensors' as written (measured;
fp8fix's ROCm verdict says so). fp8fix's `--format compressed-tensors` output of an AutoFP8 source (AMD's
`k_proj.output_scale` renamed `self_attn.k_scale`) declares `kv_cache_scheme`: its scales are used by the default
call. transformers 5.24: its attention layers have no kv-cache scale parameter, so the loading report lists every k
/ v scale as an unexpected key (dropped) in every format. The vLLM era releases (0.19.0, 0.20.2, 0.21.0, 0.31.0)
are held to the same expectations (measured: they do the same).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from tests.builders import FORMATS, build, llama
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, in_parallel, run_loader
from tests.loaders.test_real_loaders import VERDICT_ROWS

pytestmark = pytest.mark.loaders

#: checkpoint -> the kv-cache scales vLLM's default call uses (else: left at 1.0, a BF16 cache); "X -> ct":
#: fp8fix's `--format compressed-tensors` output of source X, which declares `kv_cache_scheme`
USED_BY_DEFAULT = {
    "fp8": False,
    "fp8-amd-kv": False,
    "compressed-tensors": True,
    "modelopt": True,
    "fp8 -> ct": True,
    "fp8-amd-kv -> ct": True,
}
SCALE = 0.0625  # what tests/builders.py writes for k and v
#: what vLLM keeps on ROCm (an e4m3fnuz cache): ModelOpt's scales doubled (quantization/kv_cache.py
#: BaseKVCacheMethod.process_weights_after_loading, is_fp8_fnuz), compressed-tensors' as written (measured)
ROCM_DOUBLED = {"modelopt"}
#: The rows measured here: every vLLM row and transformers (SGLang's kv verdicts: not judged).
ROWS = {loader: row for loader, row in VERDICT_ROWS.items() if loader != "sglang"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name in USED_BY_DEFAULT:
        source, _, _ = name.partition(" -> ")
        if source not in out:
            out[source] = build(root / source, llama(), fmt=source, scale="tensor", kv_scales=True)
        if name != source:
            folder = root / f"{source}-ct"
            converted = run_cli("convert", out[source], folder, "--format", "compressed-tensors", "-q")
            assert converted.exit_code == 0, converted.output
            out[name] = folder
    return out


@pytest.fixture(scope="module")
def loads(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Loaded]]:
    """(loader, call) -> checkpoint -> what the real loader did: every row's default call, and vLLM's with
    `--kv-cache-dtype fp8`."""
    root = tmp_path_factory.mktemp("kv-out")
    names = list(USED_BY_DEFAULT)
    runs = {
        **{f"{loader}/default": (loader, {}) for loader in ROWS},
        "vllm/fp8": ("vllm", {"FP8FIX_VLLM_KV_CACHE_DTYPE": "fp8"}),
    }
    checkpoints = [folders[n] for n in names]
    ran = in_parallel(
        {
            run: partial(run_loader, loader, checkpoints, root / run.replace("/", "-"), env)
            for run, (loader, env) in runs.items()
        }
    )
    return {run: dict(zip(names, results, strict=True)) for run, results in ran.items()}


def kv_verdict(folder: Path, row: str) -> str:
    report = json.loads(run_cli("inspect", folder, "--json").output)
    return str(report["loaders"][row]["kv_cache_scales"]["verdict"])


def kv_scale_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for index in folder.glob("*.index.json"):
        names |= set(json.loads(index.read_text())["weight_map"])
    kv = FORMATS["compressed-tensors"].kv + FORMATS["fp8-amd-kv"].kv
    return {n for n in names if n.endswith(kv)}


@pytest.mark.parametrize("run", [*(f"{r}/default" for r in ROWS if r.startswith("vllm")), "vllm/fp8"])
@pytest.mark.parametrize("name", list(USED_BY_DEFAULT))
def test_vllm_uses_kv_cache_scales_where_its_source_says(
    loads: dict[str, dict[str, Loaded]], folders: dict[str, Path], name: str, run: str
) -> None:
    result = loads[run][name]
    assert result.loaded, result.error
    layers = result.kv_cache or {}
    assert len(layers) == llama().layers, layers
    used = run == "vllm/fp8" or USED_BY_DEFAULT[name]
    scale = 2 * SCALE if run.startswith("vllm-rocm") and name in ROCM_DOUBLED else SCALE
    for layer_name, layer in layers.items():
        scales = (*layer["k_scale"], *layer["v_scale"])
        if used:
            assert layer["dtype"].startswith("fp8") and set(scales) == {scale}, (layer_name, layer)
        else:
            assert layer["dtype"] == "auto" and set(scales) == {1.0}, (layer_name, layer)
    if run.endswith("/default"):  # what fp8fix says of the default call is what happened
        row = ROWS[run.partition("/")[0]]
        assert kv_verdict(folders[name], row) == ("used" if used else "ignored")


@pytest.mark.parametrize("name", list(USED_BY_DEFAULT))
def test_transformers_drops_every_kv_cache_scale(
    loads: dict[str, dict[str, Loaded]], folders: dict[str, Path], name: str
) -> None:
    result = loads["transformers/default"][name]
    assert result.loaded, result.error
    expected = kv_scale_names(folders[name])
    assert expected and expected <= set(result.unexpected), sorted(expected - set(result.unexpected))
    assert kv_verdict(folders[name], ROWS["transformers"]) == "ignored"

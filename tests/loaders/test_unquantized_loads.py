"""`convert --to bf16` / `--to float16` and `--dequantize` outputs through the real loaders (issue 28).

`--to bf16` of every source of the real-loader suite (tests/loaders/test_real_loaders.py SOURCES: each
format x scale style x the Llama, GLM and Phi-3 shapes), of block FP8 with E8M0 and BF16 scales, and
`--to float16` of five of them: vLLM 0.32 and transformers 5.24 load each as a plain model (no
quantization method chosen), every linear layer's weight equal to OUTPUT's tensor (the loader computes
with what fp8fix wrote), which is SOURCE's code times its scale rounded once (tests/test_unquantized.py's
independent torch computation); inspect's verdict on OUTPUT is what each loader did.

`--dequantize '*.layers.0.self_attn.*'`: the loaders build those layers unquantized, with fp8fix's BF16
values, and load every other layer as the source's FP8 (what each loader does with the source's format, as
the rest of the suite measures it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FORMATS, build, glm, llama, loadable, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, record, run_loaders
from tests.loaders.test_real_loaders import (
    BUILD_OPTIONS,
    SOURCES,
    VERDICT_ROWS,
    WITHOUT_KEYS,
    as_loaded,
    loader_model,
    outcome,
    true_weights,
)
from tests.test_unquantized import exact_values, round_once, tensors_of

pytestmark = pytest.mark.loaders

#: The suite's sources, and block FP8 with each scale dtype published checkpoints use.
BF16_SOURCES = {**SOURCES, "block-fp8-e8m0": ("block-fp8-e8m0", "block"), "block-fp8-bf16": ("block-fp8-bf16", "block")}
#: `--dequantize`: formats whose lists of modules left unquantized fp8fix extends, on the three shapes.
DEQUANTIZE = {
    f"{shape}.{fmt}": (shape, fmt, scale)
    for shape in ("llama", "glm", "phi3")
    for fmt, scale in (
        ("fp8", "tensor"),
        ("compressed-tensors", "channel"),
        ("block-fp8", "block"),
        ("quark", "tensor"),
    )
}
SHAPES = {"llama": llama, "glm": glm, "phi3": phi3}


def modules_of(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """OUTPUT's 2-D weights by module, in float32 (BF16 and F16 values are exact in float32); with `dtype`,
    as a loader building the model in that dtype holds them (a BF16 lm_head of a `--to float16` output
    cast to F16: torch's one rounding, which a loader does to any BF16 tensor of a float16 model)."""
    return {
        n.removesuffix(".weight"): (t if dtype is None else t.to(dtype)).float()
        for n, t in tensors_of(folder).items()
        if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n and "norm" not in n
    }


def said(folder: Path, loader: str) -> str:
    return str(json.loads(run_cli("inspect", folder, "--json").output)["loaders"][VERDICT_ROWS[loader]]["verdict"])


def load_outputs(folders: dict[str, tuple[Path, Path]], root: Path) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    """Each (SOURCE, OUTPUT) with what every real loader made of OUTPUT (one process per loader)."""
    names = list(folders)
    results = run_loaders(VERDICT_ROWS, [folders[n][1] for n in names], root)
    return {n: (*folders[n], {loader: results[loader][i] for loader in VERDICT_ROWS}) for i, n in enumerate(names)}


#: `--to float16` too, on a source of each scale style.
F16_SOURCES = ("fp8-tensor", "fp8-shard", "ct-channel", "block-fp8", "llama-fp8")
PLAIN_CASES = [f"{name}/bf16" for name in BF16_SOURCES] + [f"{name}/float16" for name in F16_SOURCES]
DTYPES = {"bf16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    root = tmp_path_factory.mktemp("plain")
    folders = {}
    for case in PLAIN_CASES:
        name, to = case.split("/")
        fmt, scale = BF16_SOURCES[name]
        src = root / "src" / name
        if not src.exists():
            options = {**BUILD_OPTIONS.get(name, {}), "complete": True}
            build(src, loader_model(name), fmt=fmt, scale=scale, **options)  # type: ignore[arg-type]
        if name in WITHOUT_KEYS:
            config = json.loads((src / "config.json").read_text())
            for key in WITHOUT_KEYS[name]:
                config["quantization_config"].pop(key, None)
            (src / "config.json").write_text(json.dumps(config))
        out = root / to / name
        result = run_cli("convert", src, out, "--to", to, "--json")
        assert result.exit_code == 0, result.output
        folders[case] = (src, out)
    return load_outputs(folders, root)


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_outputs_load_as_plain_models(
    plain: dict[str, tuple[Path, Path, dict[str, Loaded]]], case: str, loader: str
) -> None:
    src, out, results = plain[case]
    name, to = case.split("/")
    result = results[loader]
    verdict = said(out, loader)
    real = "loads"
    if not result.loaded:
        real = "fails"
    else:
        written = modules_of(out)
        fmt = BF16_SOURCES[name][0]
        # the loaders build the model in config.json's dtype (the default call): what they hold is OUTPUT in it
        held = modules_of(out, DTYPES[to])
        exact = exact_values(src, loader_model(name), FORMATS[fmt].block)
        for layer, expected in as_loaded(held, result.weights).items():
            got = result.weights.get(layer)
            if got is None or not torch.equal(got, expected):
                real = "loads-wrong"
        # and what fp8fix wrote is SOURCE's code x scale rounded once (the loader's weights are OUTPUT's)
        for weight, values in exact.items():
            module = weight.removesuffix(".weight")
            assert torch.equal(written[module].double(), round_once(values, DTYPES[to])), module
    record(loader, case, verdict, real)
    if loader == "sglang" and name.startswith("glm"):  # SGLang's Transformers backend refuses GLM, plain or not
        assert (real, verdict) == ("fails", "fails") and "Unsupported TP style" in result.error, result.error
        return
    assert result.loaded, result.error
    assert result.quantization is None, f"{loader} chose {result.quantization} for a plain model"
    assert not result.missing, result.missing
    assert real == "loads" and verdict == "loads", (real, verdict)


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    root = tmp_path_factory.mktemp("dequantize")
    folders = {}
    for name, (shape, fmt, scale) in DEQUANTIZE.items():
        model = loadable(SHAPES[shape]())
        src = build(root / name, model, fmt=fmt, scale=scale, complete=True)
        out = root / "dequantized" / name
        result = run_cli("convert", src, out, "--dequantize", "*.layers.0.self_attn.*", "--layout", "fused", "--json")
        assert result.exit_code == 0, result.output
        folders[name] = (src, out)
    return load_outputs(folders, root)


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("case", list(DEQUANTIZE))
def test_dequantized_modules_load_unquantized(
    partial: dict[str, tuple[Path, Path, dict[str, Loaded]]], case: str, loader: str
) -> None:
    """The BF16 layers hold fp8fix's values; the verdict on the whole output is what the loader did (its
    FP8 layers as the loader treats the source's format: loads-wrong where it ignores weight_scale)."""
    src, out, results = partial[case]
    shape = DEQUANTIZE[case][0]
    result = results[loader]
    model = SHAPES[shape]()
    truth = true_weights(src, model)
    written = modules_of(out)
    bf16 = {m: w for m, w in written.items() if ".layers.0.self_attn." in m}
    truth.update(bf16)  # the dequantized modules' truth is what fp8fix wrote (checked against SOURCE in the unit tests)
    real, why = outcome(result, truth, out)
    verdict = said(out, loader)
    record(loader, f"{case}/dequantize", verdict, real)
    # SGLang builds Llama's packed qkv_proj FP8 although compressed-tensors / Quark list q / k / v unquantized
    packed_anyway = loader == "sglang" and shape == "llama" and DEQUANTIZE[case][1] in ("compressed-tensors", "quark")
    if result.loaded and not packed_anyway:
        for layer, expected in as_loaded(bf16, result.weights).items():
            assert torch.equal(result.weights[layer], expected), (layer, why)
    assert verdict == real, why

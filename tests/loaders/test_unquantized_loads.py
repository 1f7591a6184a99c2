"""`convert --to bf16` and `--dequantize` outputs through the real loaders (issue 28).

`--to bf16` of every source of the real-loader suite (tests/loaders/test_real_loaders.py SOURCES: each
format x scale style x the Llama, GLM and Phi-3 shapes) and of block FP8 with F32 and E8M0 scales: vLLM 0.32
and transformers 5.24 load it as a plain model (no quantization method chosen), every linear layer's
weight equal to OUTPUT's BF16 tensor (the loader computes with what fp8fix wrote) and to SOURCE's code
times its scale rounded once to BF16 (tests/test_unquantized.py's independent torch computation), and
inspect's verdict on OUTPUT is what each loader did.

`--dequantize '*.layers.0.self_attn.*'`: the loaders build those layers unquantized, with fp8fix's BF16
values, and load every other layer as the source's FP8 (what each loader does with the source's format, as
the rest of the suite measures it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FORMATS, build, glm, llama, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, record, run_loader
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


def modules_of(folder: Path) -> dict[str, torch.Tensor]:
    """OUTPUT's 2-D weights by module, in float32 (BF16 values are exact in float32)."""
    return {
        n.removesuffix(".weight"): t.float()
        for n, t in tensors_of(folder).items()
        if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n and "norm" not in n
    }


def said(folder: Path, loader: str) -> str:
    return str(json.loads(run_cli("inspect", folder, "--json").output)["loaders"][VERDICT_ROWS[loader]]["verdict"])


def load_outputs(folders: dict[str, tuple[Path, Path]], root: Path) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    """Each (SOURCE, OUTPUT) with what every real loader made of OUTPUT (one process per loader)."""
    names = list(folders)
    results = {loader: run_loader(loader, [folders[n][1] for n in names], root / loader) for loader in VERDICT_ROWS}
    return {n: (*folders[n], {loader: results[loader][i] for loader in VERDICT_ROWS}) for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    root = tmp_path_factory.mktemp("bf16")
    folders = {}
    for name, (fmt, scale) in BF16_SOURCES.items():
        options = {**BUILD_OPTIONS.get(name, {}), "complete": True}
        src = build(root / name, loader_model(name), fmt=fmt, scale=scale, **options)  # type: ignore[arg-type]
        if name in WITHOUT_KEYS:
            config = json.loads((src / "config.json").read_text())
            for key in WITHOUT_KEYS[name]:
                del config["quantization_config"][key]
            (src / "config.json").write_text(json.dumps(config))
        out = root / "bf16" / name  # apart from the sources: "block-fp8" + "-bf16" is a source's name
        result = run_cli("convert", src, out, "--to", "bf16", "--json")
        assert result.exit_code == 0, result.output
        folders[name] = (src, out)
    return load_outputs(folders, root)


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("source", list(BF16_SOURCES))
def test_bf16_outputs_load_as_plain_models(
    plain: dict[str, tuple[Path, Path, dict[str, Loaded]]], source: str, loader: str
) -> None:
    src, out, results = plain[source]
    result = results[loader]
    verdict = said(out, loader)
    real = "loads"
    if not result.loaded:
        real = "fails"
    else:
        written = modules_of(out)
        fmt = BF16_SOURCES[source][0]
        exact = {
            n.removesuffix(".weight"): v for n, v in exact_values(src, loader_model(source), FORMATS[fmt].block).items()
        }
        for layer, expected in as_loaded(written, result.weights).items():
            got = result.weights.get(layer)
            if got is None or not torch.equal(got, expected):
                real = "loads-wrong"
        # and what fp8fix wrote is SOURCE's code x scale rounded once (the loader's weights are OUTPUT's)
        for module, values in exact.items():
            assert torch.equal(written[module].double(), round_once(values, torch.bfloat16)), module
    record(loader, f"{source}/bf16", verdict, real)
    assert result.loaded, result.error
    assert result.quantization is None, f"{loader} chose {result.quantization} for a plain model"
    assert not result.missing, result.missing
    assert real == "loads" and verdict == "loads", (real, verdict)


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, Loaded]]]:
    root = tmp_path_factory.mktemp("dequantize")
    folders = {}
    for name, (shape, fmt, scale) in DEQUANTIZE.items():
        model = SHAPES[shape]()
        model.config.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)
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
    if result.loaded:
        for layer, expected in as_loaded(bf16, result.weights).items():
            assert torch.equal(result.weights[layer], expected), (layer, why)
    assert verdict == real, why

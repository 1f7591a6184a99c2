"""`--target auto` judged by layer class (issue 30), against the real loaders: checkpoints of 16 layers, where
the candidates are judged on one layer of each class, loaded as exported and as `convert SOURCE OUTPUT` writes
them. What fp8fix says about each (inspect's verdict on SOURCE, convert's on OUTPUT) must be what the loader does,
and OUTPUT must load correctly wherever SOURCE does.

Shapes, formats and scale styles beyond the ones the classes were built on: Phi-3 (both fused), GLM (gate_up
fused), Llama (q / k / v apart, which vLLM packs); AutoFP8, legacy AutoFP8, compressed-tensors, Quark, ModelOpt;
per-tensor and per-shard scales; every layer alike, or one layer whose scales differ (the one that decides
whether anything is requantized).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fp8fix.plan.layer_classes import representatives
from tests.builders import build
from tests.conftest import patch_bytes, run_cli
from tests.loaders.conftest import interpreter, record, run_loaders
from tests.loaders.test_real_loaders import (
    VERDICT_ROWS,
    inspect_verdict,
    loader_model,
    not_judged,
    outcome,
    true_weights,
)
from tests.test_layer_classes import LAYERS, describe, layers_alike, one_layer_differs

pytestmark = pytest.mark.loaders

#: name -> (format, scale, variant); the shape from the name's start (`loader_shape`).
SOURCES = {
    "phi3.ct.shard.one-differs": ("compressed-tensors", "shard", one_layer_differs),  # channel: the one exact
    "phi3.fp8.tensor.alike": ("fp8", "tensor", layers_alike),
    "phi3.fp8-legacy.shard.alike": ("fp8-legacy", "shard", layers_alike),
    "phi3.quark.tensor.one-differs": ("quark", "tensor", one_layer_differs),
    "phi3.modelopt.tensor.alike": ("modelopt", "tensor", layers_alike),
    "glm.fp8.tensor.alike": ("fp8", "tensor", layers_alike),
    "llama.fp8.tensor.one-differs": ("fp8", "tensor", one_layer_differs),  # q / k / v differ in layer 5 only
}
CASES = [(source, case) for source in SOURCES for case in ("as-exported", "auto")]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, dict, dict[str, str]]]:
    """Each case: its folder, the true weights (from SOURCE's files) and what convert said of it ({} for SOURCE)."""
    for loader in VERDICT_ROWS:
        interpreter(loader)
    root = tmp_path_factory.mktemp("layer-classes")
    out = {}
    for name, (fmt, scale, variant) in SOURCES.items():
        model = loader_model(name)
        model = replace(model, layers=LAYERS, config={**model.config, "num_hidden_layers": LAYERS})
        src = build(root / name, model, fmt=fmt, scale=scale)
        variant(src)
        patch_bytes(src, "model.layers.0.mlp.down_proj.weight", {0: 0x01})
        assert representatives(describe(src)) is not None, "the candidates must be judged by class here"
        truth = true_weights(src, model)
        out[(name, "as-exported")] = (src, truth, {})
        result = run_cli("convert", src, root / f"{name}-auto", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        if name == "phi3.ct.shard.one-differs":  # only layer 5's shards differ: only channel keeps every weight
            assert report["layout"] == "channel"
        said = {row: v["verdict"] for row, v in report["loaders"].items()}
        out[(name, "auto")] = (root / f"{name}-auto", truth, said)
    return out


@pytest.fixture(scope="module")
def loaded(built, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("layer-classes-loaded")
    ran = run_loaders(VERDICT_ROWS, [built[k][0] for k in CASES], root)
    return {loader: dict(zip(CASES, results, strict=True)) for loader, results in ran.items()}


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("source,case", CASES)
def test_fp8fix_says_what_the_loader_does_when_judged_by_class(
    built, loaded, source: str, case: str, loader: str
) -> None:  # type: ignore[no-untyped-def]
    folder, truth, convert_said = built[(source, case)]
    real, why = outcome(loaded[loader][(source, case)], truth, folder)
    said = inspect_verdict(folder, loader)
    if convert_said:
        assert convert_said[VERDICT_ROWS[loader]] == said
    expected_not_judged = not_judged(source, case, loader, folder)
    if expected_not_judged == "activation-scales" and real == "fails":
        expected_not_judged = None
    record(loader, f"{source}/{case}", said, real, expected_not_judged is not None, why)
    if expected_not_judged is not None:
        assert said == "not-judged", f"fp8fix says {said} where nothing measured it ({expected_not_judged})"
        return
    assert said == real, f"fp8fix says {said}, the real {loader} {real}: {why[:300]}"


@pytest.mark.parametrize("source", list(SOURCES))
def test_auto_judged_by_class_never_loads_in_fewer_loaders(built, loaded, source: str) -> None:  # type: ignore[no-untyped-def]
    def correct(case: str) -> set[str]:
        folder, truth, _ = built[(source, case)]
        outcomes = {loader: outcome(loaded[loader][(source, case)], truth, folder)[0] for loader in VERDICT_ROWS}
        return {loader for loader, real in outcomes.items() if real == "loads"}

    assert correct("auto") >= correct("as-exported")

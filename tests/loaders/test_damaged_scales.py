"""A weight scale missing, or of a shape no convention fits, in every format x architecture shape: what the
real loaders do with it, against fp8fix's verdicts (issue 27: fp8fix said `fails` for every loader; vLLM 0.32
and transformers load a missing scale silently wrong).

The truth is the undamaged source's dequantized weights (`true_weights`, computed by the test); the outcome
(`loads` / `loads-wrong` / `fails`) is `test_real_loaders.outcome`, the same judgement as the main matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.builders import build
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_real_loaders import VERDICT_ROWS, loader_model, outcome, true_weights

pytestmark = pytest.mark.loaders

#: (format, scale style) as exporters write them: per tensor, per row, per block, the legacy AutoFP8 names.
FORMATS = [
    ("fp8", "tensor"),
    ("fp8", "channel"),
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("block-fp8", "block"),
    ("fp8-legacy", "tensor"),
]
SHAPES = ("phi3", "llama", "glm")  # both fused; nothing fused; gate_up fused, served by vLLM's Transformers backend
DAMAGES = ("missing", "odd")
CASES = [(fmt, scale, shape, damage) for fmt, scale in FORMATS for shape in SHAPES for damage in DAMAGES]
#: The damaged tensor: a plain (never fused) module's scale, in whichever shard holds it.
MODULE = "model.layers.0.mlp.down_proj"


def damage(folder: Path, name: str, how: str) -> None:
    """Remove the tensor `name` (and its index entry), or give it shape [3], which fits no convention."""
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        if name not in tensors:
            continue
        if how == "missing":
            del tensors[name]
            index_path = folder / "model.safetensors.index.json"
            index = json.loads(index_path.read_text())
            del index["weight_map"][name]
            index_path.write_text(json.dumps(index))
        else:
            tensors[name] = torch.ones(3, dtype=tensors[name].dtype)
        save_file(tensors, path, metadata={"format": "pt"})
        return
    raise AssertionError(f"{name} is in no shard")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str, str], tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("damaged-scales")
    out = {}
    for fmt, scale, shape, how in CASES:
        model = loader_model(shape)
        folder = build(root / f"{shape}-{fmt}-{scale}-{how}", model, fmt=fmt, scale=scale)
        truth = true_weights(folder, model)  # before the damage: what a correct load computes with
        suffix = "_inv" if fmt == "block-fp8" else ""
        damage(folder, f"{MODULE}.weight_scale{suffix}", how)
        out[(fmt, scale, shape, how)] = (folder, truth)
    return out


@pytest.fixture(scope="module")
def loaded(damaged: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("damaged-loads")
    keys = list(damaged)
    ran = run_loaders(VERDICT_ROWS, [damaged[k][0] for k in keys], root)
    return {loader: dict(zip(keys, results, strict=True)) for loader, results in ran.items()}


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("fmt,scale,shape,how", CASES)
def test_fp8fix_says_what_the_loader_does_with_a_damaged_scale(
    damaged: dict, loaded: dict, loader: str, fmt: str, scale: str, shape: str, how: str
) -> None:
    folder, truth = damaged[(fmt, scale, shape, how)]
    real, why = outcome(loaded[loader][(fmt, scale, shape, how)], truth, folder)
    report = json.loads(run_cli("inspect", folder, "--json").output)
    said = report["loaders"][VERDICT_ROWS[loader]]["verdict"]
    record(loader, f"damaged/{shape}-{fmt}-{scale}-{how}", said, real)
    assert said == real, f"fp8fix inspect says {said}, the real {loader} {real}: {why[:300]}"

"""Checkpoints a runtime refuses for what config.json says, before any weight (issue 47), through every
measured loader row:

- an architecture name no runtime knows (a one-letter typo in `architectures`): vLLM resolves the name to a
  model class, else a transformers class, else `auto_map`, else a suffix swap, and refuses the rest at
  start-up; transformers' AutoModelForCausalLM reads `model_type` and never looks at the name;
- a Phi-3 config whose LongRoPE factor lists do not fit its rotary dimension (Phi-3-mini-128k's 48-value
  lists beside a smaller head size, as a shrunk published config has them): transformers' Phi3Config refuses
  it as it is read, and every runtime here builds its config with that class.

Each real loader must do what fp8fix inspect's row says (`fails` with the loader's own message, or loads as
the correct config does); the correct name and a fitting rope config are the controls. Where the row says
`not-judged` (SGLang's unmeasured model classes), nothing is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import Model, build, llama, loadable, phi3
from tests.conftest import run_cli
from tests.loaders.conftest import record, run_loaders
from tests.loaders.test_real_loaders import VERDICT_ROWS

pytestmark = pytest.mark.loaders


def longrope(model: Model, length: int | None = None) -> dict[str, object]:
    """Phi-3-mini-128k's rope_scaling, with factor lists of `length` (default: what the head size needs)."""
    half = model.config["hidden_size"] // model.config["num_attention_heads"] // 2
    n = half if length is None else length
    return {
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * n, "long_factor": [1.5] * n},
    }


#: name -> (model, format, config.json keys written over the model's, the message a refusing loader raises)
SOURCES: dict[str, tuple[Model, str, dict[str, object], str]] = {
    "phi3-typo": (phi3(), "compressed-tensors", {"architectures": ["Phi3ForCasualLM"]}, "are not supported for now"),
    "llama-typo": (llama(), "fp8", {"architectures": ["LlamaForCausalLm"]}, "are not supported for now"),
    "llama-made-up": (
        llama(),
        "compressed-tensors",
        {"architectures": ["NoSuchModelForCausalLM"]},
        "are not supported for now",
    ),
    "phi3-128k-shrunk": (phi3(), "compressed-tensors", longrope(phi3(), 48), "short_factor field must have length"),
    "phi3-128k-fitting": (phi3(), "compressed-tensors", longrope(phi3()), ""),
    "phi3-control": (phi3(), "compressed-tensors", {}, ""),
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, object]]]:
    root = tmp_path_factory.mktemp("config-refusals")
    folders = []
    for case, (model, fmt, keys, _) in SOURCES.items():
        folder = build(root / case, loadable(model), fmt=fmt, complete=True)
        config = {**json.loads((folder / "config.json").read_text()), **keys}
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    results = run_loaders(VERDICT_ROWS, folders, root / "loaded")
    return {case: (folders[i], {loader: results[loader][i] for loader in results}) for i, case in enumerate(SOURCES)}


@pytest.mark.parametrize("loader", list(VERDICT_ROWS))
@pytest.mark.parametrize("case", list(SOURCES))
def test_each_loader_does_what_the_row_says(loaded: dict, case: str, loader: str) -> None:
    folder, results = loaded[case]
    report = json.loads(run_cli("inspect", folder, "--json").stdout)
    said = report["loaders"][VERDICT_ROWS[loader]]["verdict"]
    result = results[loader]
    real = "loads" if result.loaded else "fails"
    judged = said != "not-judged"
    # loads-wrong: the llama-typo source's AutoFP8 scales in transformers (raw codes): the main matrix measures it
    record(loader, f"config/{case}", "loads" if said == "loads-wrong" else said, real, not judged, result.error)
    if not judged:
        return
    message = SOURCES[case][3]
    if said == "fails":
        assert not result.loaded and message in result.error, (case, loader, result.error)
    else:
        assert result.loaded, (case, loader, result.error)
    # what the case is built to show, stated independently of fp8fix's rows
    refused = bool(message) and not (case.endswith(("-typo", "-made-up")) and loader == "transformers")
    assert (said == "fails") == refused, (case, loader, said)

"""Running the real loaders: each in its own venv (vLLM's CPU build pins its own transformers and
compressed-tensors), as a subprocess over a batch of checkpoints, once per test session.

`FP8FIX_VLLM_PYTHON` and `FP8FIX_TRANSFORMERS_PYTHON` name the two interpreters
(`scripts/setup_loader_venvs.sh` makes them and prints the exports). Without them the
`loaders` tests skip, unless `FP8FIX_REQUIRE_LOADERS=1` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
LOADERS = {
    "vllm": ("FP8FIX_VLLM_PYTHON", HERE / "vllm_load.py"),
    "transformers": ("FP8FIX_TRANSFORMERS_PYTHON", HERE / "transformers_load.py"),
}


@dataclass
class Loaded:
    """What one real loader did with one checkpoint."""

    loaded: bool
    error: str
    model_class: str
    missing: list[str]
    unexpected: list[str]
    weights: dict[str, torch.Tensor]  # layer -> float32 [out, in] as the loader computes with it


def interpreter(loader: str) -> str:
    variable, _ = LOADERS[loader]
    python = os.environ.get(variable)
    if not python:
        if os.environ.get("FP8FIX_REQUIRE_LOADERS") == "1":
            pytest.fail(f"{variable} is not set; run scripts/setup_loader_venvs.sh")
        pytest.skip(f"{variable} not set (scripts/setup_loader_venvs.sh makes the real-loader venvs)")
    return python


def run_loader(loader: str, folders: list[Path], out: Path) -> list[Loaded]:
    """Load every folder with the real `loader` in one process."""
    _, script = LOADERS[loader]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [interpreter(loader), str(script), str(out), *map(str, folders)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{loader} harness crashed:\n{proc.stderr[-4000:]}"
    results = []
    for i in range(len(folders)):
        r = json.loads((out / str(i) / "result.json").read_text())
        weights = load_file(out / str(i) / "weights.safetensors") if r["loaded"] else {}
        results.append(
            Loaded(
                r["loaded"],
                r.get("error", ""),
                r.get("model_class", ""),
                r.get("missing_keys", []),
                r.get("unexpected_keys", []),
                weights,
            )
        )
    return results

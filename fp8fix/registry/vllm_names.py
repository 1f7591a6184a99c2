"""Which `architectures[0]` names vLLM starts a model for, as data read off vLLM itself
(runtimes/vllm-architectures.json, written by scripts/runtime_architectures.py from the vLLM 0.32 loader venv).

vLLM resolves the name in this order (model_executor/models/registry.py _ModelRegistry.inspect_model_cls):
a name it registers; with the default model_impl auto, a model class of that name in transformers (its
Transformers backend) or an `auto_map` AutoModel entry (the repository's own code); a name whose suffix
(ForSequenceClassification, Model, ...) swaps to a registered one. Anything else it refuses at start-up
("Model architectures [...] are not supported for now"); a removed name it refuses with the release that
last had it (`verdicts.VLLM_REMOVED` says that one). transformers reads `model_type`, not this name.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "runtimes" / "vllm-architectures.json"


@cache
def _names() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA.read_text())
    return data


def vllm_resolves(architecture: str, config: dict[str, Any]) -> bool:
    """vLLM (0.32, model_impl auto) finds a model class for `architecture`, or refuses it as removed."""
    data = _names()
    registered = set(data["registered"])
    if architecture in registered or architecture in data["removed"] or architecture in data["transformers_classes"]:
        return True
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and any(isinstance(k, str) and k.startswith("AutoModel") for k in auto_map):
        return True
    for suffix in data["suffixes"]:  # _normalize_arch: the first suffix the name ends with, swapped for each
        if architecture.endswith(suffix):
            stem = architecture.removesuffix(suffix)
            return any(stem + other in registered for other in data["suffixes"])
    return False


def nearest_vllm_name(architecture: str) -> str | None:
    """The registered name closest to `architecture` (a hint for a typo), or None."""
    found = difflib.get_close_matches(architecture, _names()["registered"], n=1, cutoff=0.8)
    return found[0] if found else None


def vllm_release() -> str:
    """The vLLM release the names were read from."""
    return str(_names()["vllm"])

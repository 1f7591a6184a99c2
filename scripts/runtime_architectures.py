"""Write fp8fix/registry/runtimes/vllm-architectures.json: the architecture names vLLM resolves, read from
the installed vLLM (run it with the vLLM loader venv's python: scripts/setup_loader_venvs.sh).

vLLM resolves config.json's `architectures[0]` (vllm/model_executor/models/registry.py
_ModelRegistry.inspect_model_cls): its own registered names; else, with the default model_impl auto, a
class of that name in transformers (its Transformers backend) or an `auto_map` AutoModel entry (remote
code); else a name whose suffix (ForSequenceClassification, ...) swaps to a registered one
(_normalize_arch); else it raises "Model architectures [...] are not supported for now". The file keeps
vLLM's names, the model classes of the transformers release vLLM pins (every auto mapping's names), the
suffixes it swaps, and the names it lists as removed. Run: .loader-venvs/vllm/bin/python
scripts/runtime_architectures.py; tests/loaders/test_config_refusals.py checks it against the real
loader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "fp8fix" / "registry" / "runtimes" / "vllm-architectures.json"


def main() -> None:
    import transformers
    import vllm
    from transformers.models.auto import modeling_auto
    from vllm.config.model import iter_architecture_defaults
    from vllm.model_executor.models.registry import _PREVIOUSLY_SUPPORTED_MODELS, ModelRegistry

    classes: set[str] = set()
    for name in dir(modeling_auto):
        if name.endswith("_MAPPING_NAMES"):
            for value in getattr(modeling_auto, name).values():
                classes.update([value] if isinstance(value, str) else [v for v in value if isinstance(v, str)])
    registered = sorted(ModelRegistry.get_supported_archs())
    data = {
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "evidence": "vllm model_executor/models/registry.py _ModelRegistry.inspect_model_cls, _raise_for_unsupported",
        "registered": registered,
        "transformers_classes": sorted(c for c in classes if hasattr(transformers, c) and c not in registered),
        "suffixes": [suffix for suffix, _ in iter_architecture_defaults()],
        "removed": dict(sorted(_PREVIOUSLY_SUPPORTED_MODELS.items())),
    }
    OUT.write_text(json.dumps(data, indent=0) + "\n")
    print(f"wrote {OUT}: {len(registered)} vLLM names, {len(data['transformers_classes'])} transformers classes")


if __name__ == "__main__":
    sys.exit(main())

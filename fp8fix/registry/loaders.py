"""Which runtimes load which layout of a fused module, from the team's reference notes.

Kept as data so `convert`, the model card and `inspect` give the same answer.
Sources: ../shared/reference/fp8-checkpoints.md section 2a (vLLM 0.5.x shape assert,
vLLM 0.32 `PerTensorScaleParameter._load_into_shard_id`, transformers' fused names).
"""

from __future__ import annotations

from fp8fix.vocab import Layout

LOADERS = ("vLLM <= 0.5.0", "vLLM 0.5.1 - 0.19", "vLLM >= 0.20", "transformers")

#: layout -> loader -> (loads?, why)
COMPATIBILITY: dict[Layout, dict[str, tuple[bool, str]]] = {
    "unfused": {
        "vLLM <= 0.5.0": (True, "Llama-style q/k/v and gate/up names, one scalar scale each"),
        "vLLM 0.5.1 - 0.19": (True, "Llama-style names map onto the fused parameter's shards"),
        "vLLM >= 0.20": (True, "Llama-style names map onto the fused parameter's shards"),
        "transformers": (False, "expects the fused module names it defines"),
    },
    "per-shard": {
        "vLLM <= 0.5.0": (True, "expects one scale per shard on fused modules"),
        "vLLM 0.5.1 - 0.19": (False, "asserts a fused-on-disk module carries one scale"),
        "vLLM >= 0.20": (False, "asserts loaded.shape[0] == 1 for a fused-on-disk scale"),
        "transformers": (False, "expects one scale per fused module"),
    },
    "fused": {
        "vLLM <= 0.5.0": (False, "shape mismatch: torch.Size([n]) vs torch.Size([])"),
        "vLLM 0.5.1 - 0.19": (True, "single scale detected, requantization skipped"),
        "vLLM >= 0.20": (True, "single scale copied into every shard slot"),
        "transformers": (True, "one scale per module, fused names"),
    },
}

#!/usr/bin/env python3
"""Regenerate examples/phi3-tiny-fp8: a tiny Phi-3-shaped AutoFP8 checkpoint with the fused-scale problem.

Two shards, single-scale fused qkv_proj / gate_up_proj, static input scales and
kv-cache scales, written the way AutoFP8 writes them (see tests/builders.py); complete, so that
transformers and vLLM load it as it is (tests/loaders/test_example_loads.py): token ids within its
256-token vocabulary, and every norm a Phi-3 layer has.

    python scripts/make_example.py [OUTPUT]     # default: examples/phi3-tiny-fp8
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.builders import build, phi3  # noqa: E402

CARD = """\
---
license: mit
tags:
- fp8
---

# phi3-tiny-fp8

A 2-layer Phi-3-shaped FP8 checkpoint (hidden size 64, random weights) made by
`scripts/make_example.py` for fp8fix's Quickstart and tests. Like real per-tensor
FP8 exports of Phi-3, its fused `qkv_proj` and `gate_up_proj` carry one scale each.
"""


#: Token ids within the vocabulary (Phi3Config's defaults, 32000, are not: transformers refuses them).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def make_example(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    model = phi3(layers=2)
    model.config.update(TOKEN_IDS)
    build(out, model, fmt="fp8", scale="tensor", static_input=True, kv_scales=True, files=2, seed=2026)
    _add_post_attention_norms(out, model.layers)
    (out / "README.md").write_text(CARD)
    return out


def _add_post_attention_norms(folder: Path, layers: int) -> None:
    """Each layer's post_attention_layernorm (ones, as initialised), in the shard holding its input_layernorm."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        for i in range(layers):
            norm = tensors.get(f"model.layers.{i}.input_layernorm.weight")
            if norm is not None:
                name = f"model.layers.{i}.post_attention_layernorm.weight"
                tensors[name] = torch.ones_like(norm)
                index["weight_map"][name] = path.name
        save_file(tensors, path, metadata={"format": "pt"})
    index["metadata"]["total_size"] = sum(
        t.numel() * t.element_size() for p in folder.glob("*.safetensors") for t in load_file(p).values()
    )
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", nargs="?", type=Path, default=REPO / "examples" / "phi3-tiny-fp8")
    print(make_example(parser.parse_args().output))

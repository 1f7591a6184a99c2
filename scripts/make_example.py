#!/usr/bin/env python3
"""Regenerate examples/phi3-tiny-fp8: a tiny Phi-3-shaped AutoFP8 checkpoint with the fused-scale problem.

Two shards, single-scale fused qkv_proj / gate_up_proj, static input scales and
kv-cache scales, written the way AutoFP8 writes them (see tests/builders.py).

    python scripts/make_example.py [OUTPUT]     # default: examples/phi3-tiny-fp8
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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


def make_example(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    build(out, phi3(layers=2), fmt="fp8", scale="tensor", static_input=True, kv_scales=True, files=2, seed=2026)
    (out / "README.md").write_text(CARD)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "examples" / "phi3-tiny-fp8"
    print(make_example(target))

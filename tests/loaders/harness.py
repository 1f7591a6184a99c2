"""What both loader harnesses share: the command line, the result files, and scale expansion.

Imported by `vllm_load.py`, `sglang_load.py` and `transformers_load.py`, each run as a script with its
own venv's Python (this folder is then first on sys.path); needs only torch and
safetensors, which both venvs have.
"""

from __future__ import annotations

import gc
import json
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

Load = Callable[[Path], tuple[dict[str, object], dict[str, torch.Tensor]]]


def local_address() -> str:
    """A free TCP port on 127.0.0.1 for the one-rank process group a harness starts (several harnesses run at
    once: a fixed port would collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def scaled(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 codes [rows, cols] times their scale: one value, one per row, or a block grid (of `block`, where
    the loader says; else the block the grid's shape implies, which a partial last block makes wrong)."""
    rows, cols = codes.shape
    scale = scale.float()
    if scale.numel() == 1:
        return codes.float() * scale.reshape(())
    if scale.numel() == rows:
        return codes.float() * scale.reshape(rows, 1)
    if scale.dim() == 2:
        block = block or (-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
        grid = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        return codes.float() * grid
    raise ValueError(f"scale {tuple(scale.shape)} of unknown layout for a [{rows}, {cols}] weight")


def scale_of(layer: torch.nn.Module) -> torch.Tensor:
    """An FP8 linear layer's weight scale: `weight_scale_inv` (block FP8) or `weight_scale`."""
    scale = getattr(layer, "weight_scale_inv", None)
    return layer.weight_scale if scale is None else scale


def dequantized_layer(layer: torch.nn.Module, rows: int, cols: int, block: Any) -> torch.Tensor:
    """The layer's FP8 weight times its scale, [rows, cols] float32: vLLM's and SGLang's kernels keep a
    transposed view of the loaded [out, in] weight, read back as it was loaded."""
    w = layer.weight
    if tuple(w.shape) == (cols, rows) and w.stride() == (1, cols):
        w = w.t()
    if tuple(w.shape) != (rows, cols):
        raise ValueError(f"weight {tuple(w.shape)} is not [{rows}, {cols}]")
    return scaled(w, scale_of(layer), tuple(block) if block else None)


def run(load: Load) -> None:
    """`python HARNESS OUT_DIR CHECKPOINT...`: OUT_DIR/<n>/result.json (and weights.safetensors when
    it loaded) for the n-th checkpoint. What the loader raises is the result, not a crash."""
    out, folders = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    # The loader's import leaves a few million objects that live as long as the process; vLLM's loader calls
    # gc.collect() twice a load (model_loader/base_loader.py), which walked them all: 0.6 s a call, two thirds
    # of a tiny checkpoint's load. Frozen, a collection walks only what the loads create (what it frees).
    gc.freeze()
    for i, folder in enumerate(folders):
        target = out / str(i)
        target.mkdir(parents=True, exist_ok=True)
        try:
            result, weights = load(folder)
            save_file(weights, str(target / "weights.safetensors"))
        except Exception as e:
            last = traceback.extract_tb(e.__traceback__)[-1]
            error = f"{type(e).__name__}: {e}"[:2000]
            result = {"loaded": False, "error": error, "where": f"{last.filename}:{last.lineno}"}
        result["checkpoint"] = str(folder)
        (target / "result.json").write_text(json.dumps(result))

"""Load a checkpoint with the real vLLM (CPU build) as one rank of a tensor-parallel group and dump the
rank's weights, for every rank in turn: `python vllm_tp_load.py OUT_DIR TP CHECKPOINT`.

One process for all ranks, one model per rank: the process group has one member, and the
tensor-parallel group's size and this process's rank in it are set to TP and the rank before each
model is built (`GroupCoordinator.world_size` /
`rank_in_group`, which `get_tensor_model_parallel_world_size()` / `_rank()` return), so every layer
allocates and loads exactly the slice rank RANK of TP holds, through vLLM's own weight loaders and
block-shape validation. No forward pass runs (that would need the other ranks). The patches of
vllm_load.py (CPU-build gaps outside weight loading) apply, and two more: the CPU build has no FP8
fused-MoE kernel, so `Fp8MoEMethod.process_weights_after_loading` (which only picks and builds that
kernel) is skipped, and so is `UnquantizedLinearMethod`'s (the CPU GEMM prepack, which drops `weight`);
the experts' weights and scales are the ones vLLM's loaders wrote, and the block
shape it resolved (`weight_scale_refine`: None, or the refinement factor) is recorded per MoE layer.

OUT_DIR/<rank>/result.json says whether it loaded (or vLLM's error); weights.safetensors beside it holds, for
every dense FP8 linear layer, its codes (`::codes`) and block scales (`::scale`) as loaded and, where
vLLM did not allow a block-shape mismatch, its dequantized [out, in] slice in float32; for every layer
left unquantized its [out, in] slice; for every fused-MoE layer its dequantized w13 [E, 2 x I/TP,
hidden] and w2 [E, hidden, I/TP] slices.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import vllm_load  # this folder: the model build, the CPU-build patches, `dequantized`
from harness import scaled
from safetensors.torch import save_file
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

Fp8MoEMethod.process_weights_after_loading = lambda self, layer: None
# The CPU build prepacks unquantized weights for its GEMM and drops `weight` (dispatch_cpu_unquantized_gemm):
# kernel choice, after loading; skipped so the loaded slice can be read.
UnquantizedLinearMethod.process_weights_after_loading = lambda self, layer: None


def experts(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A fused-MoE layer's w13 and w2, dequantized expert by expert (float32)."""
    out = {}
    for param in ("w13", "w2"):
        w = getattr(module, f"{param}_weight")
        s = getattr(module, f"{param}_weight_scale_inv", None)
        if s is None:
            s = getattr(module, f"{param}_weight_scale")
        out[param] = torch.stack([scaled(w[e], s[e]) for e in range(w.shape[0])])
    return out


def load_rank(folder: Path, tp: int, rank: int, out: Path) -> None:
    """Build the model as rank `rank` of `tp` and dump what it loaded (or the error) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        model = vllm_load.build_model(folder, tp, rank)
        weights = {}
        refined = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, Fp8MoEMethod):
                refined[name] = method.weight_scale_refine
            if hasattr(module, "w13_weight"):
                for param, value in experts(module).items():
                    weights[f"{name}.{param}"] = value.contiguous()
            elif getattr(module, "weight", None) is not None and (
                hasattr(module, "weight_scale_inv") or hasattr(module, "weight_scale")
            ):
                weights[f"{name}::codes"] = module.weight.float().contiguous()
                weights[f"{name}::scale"] = vllm_load.scale_of(module).float().contiguous()
                if not getattr(module, "allow_fp8_block_shape_mismatch", False):  # else no uniform block grid
                    weights[name] = vllm_load.dequantized(module).contiguous()
            elif isinstance(method, UnquantizedLinearMethod):  # left unquantized (`--tp-bf16`)
                weights[name] = module.weight.float().contiguous()
        save_file(weights, str(out / "weights.safetensors"))
        result = {"loaded": True, "model_class": type(model).__name__, "moe_refined": refined}
    except Exception as e:  # what vLLM raises is the result
        last = traceback.extract_tb(e.__traceback__)[-1]
        result = {
            "loaded": False,
            "error": f"{type(e).__name__}: {e}"[:2000],
            "where": f"{last.filename}:{last.lineno}",
        }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":  # OUT_DIR TP CHECKPOINT: every rank, into OUT_DIR/<rank>
    target, size, checkpoint = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    for r in range(size):
        load_rank(checkpoint, size, r, target / str(r))

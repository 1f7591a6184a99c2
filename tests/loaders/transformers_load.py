"""Load checkpoints with the real transformers (CPU) and dump what it ends up with.

Run with the transformers venv's Python (see docs/real-loaders.md):
`python transformers_load.py OUT_DIR CHECKPOINT...`. For each checkpoint:
`AutoModelForCausalLM.from_pretrained(path, device_map="cpu")` as a user calls it, with no
other argument (the default dtype, "auto": config.json's; compressed-tensors checkpoints with
the default `run_compressed`: issue 24 found `run_compressed=False` hid failures the default
call has),
then, for every linear layer (lm_head included: a format that
quantizes it by mistake computes with garbage there), the float32 weight [out, in] the
model computes with (FP8 weights times their scale, as its FP8 layers do; decompressed
weights as they are; amd-quark's layers: the weight their own forward dequantizes; MX layers, whose scales are
E8M0 bytes, and FP4 layers, packed: the weight compressed-tensors decompresses them to on the model's first forward,
which is run), and every stacked expert parameter held unquantized (gpt-oss's `experts.gate_up_proj` [experts, in,
out], dequantized while loading), into
OUT_DIR/<n>/weights.safetensors,
and OUT_DIR/<n>/result.json with the model class, the loading report's missing and
unexpected keys, or the error transformers raised. Nothing is patched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from harness import run, scaled  # this folder, first on sys.path when run as a script
from transformers import AutoModelForCausalLM

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer computes with, [out, in] float32."""
    w = module.weight
    if w.dtype not in FP8:
        return w.float()
    if hasattr(module, "_get_qweight"):  # amd-quark's QParamsLinear: the weight its forward dequantizes
        return module._get_qweight(w).float()
    scale = getattr(module, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(module, "weight_scale", None)
    if scale is None:
        return w.float()  # no scale attribute: the layer computes with the raw codes
    return scaled(w, scale)


def mx_scaled(module: torch.nn.Module) -> bool:
    """An FP8 layer whose scale is E8M0 bytes (uint8: MX blocks), which `scaled` would read as numbers."""
    scale, weight = getattr(module, "weight_scale", None), getattr(module, "weight", None)
    fp8 = isinstance(weight, torch.Tensor) and weight.dtype in FP8  # (an FP4 layer has no weight until decompressed)
    return isinstance(scale, torch.Tensor) and scale.dtype == torch.uint8 and fp8


def packed(module: torch.nn.Module) -> bool:
    """A layer compressed-tensors keeps packed (FP4: `weight_packed`, two E2M1 elements a byte) and no weight."""
    return isinstance(getattr(module, "weight_packed", None), torch.Tensor)


def unquantized_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Stacked experts held unquantized (3-D `experts.gate_up_proj` / `experts.down_proj` parameters, as
    GptOssExperts declares them: [experts, in, out]), float32 under their parameter names."""
    return {
        name: p.float().contiguous()
        for name, p in model.named_parameters()
        if p.dim() == 3 and p.dtype in (torch.bfloat16, torch.float16) and name.endswith("_proj")
    }


def load(folder: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", output_loading_info=True)
    if any(mx_scaled(m) or packed(m) for m in model.modules()):
        # compressed-tensors keeps MX layers compressed and decompresses them on the first forward pass (the
        # quantizer's docstring): one forward, and the layers hold the weight they compute with
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long))
    weights: dict[str, torch.Tensor] = {}
    unreadable = []
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if packed(module) and not isinstance(w, torch.Tensor):  # still packed after a forward: not read here
            unreadable.append(name)
            continue
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or name.endswith("embed_tokens"):
            continue
        if mx_scaled(module):  # still compressed after a forward: what it computes with is not read here
            unreadable.append(name)
            continue
        weights[name] = dequantized(module).contiguous()
    weights.update(unquantized_experts(model))
    report = {k: sorted(v) for k, v in info.items() if isinstance(v, (list, set)) and k != "error_msgs"}
    quantizer = getattr(model, "hf_quantizer", None)  # the quantizer transformers chose (None: a plain model)
    quantization = type(quantizer).__name__ if quantizer is not None else None
    result = {"loaded": True, "model_class": type(model).__name__, "quantization": quantization, **report}
    return {**result, "unreadable": unreadable}, weights


if __name__ == "__main__":
    run(load)

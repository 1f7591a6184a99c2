#!/usr/bin/env python3
"""Run converted checkpoints through real FP8 matmuls and compare with the source's own.

Builds Phi-3- and Llama-4-shaped FP8 checkpoints at real layer sizes (tests/builders.py:
torch-quantized, saved with safetensors), converts them with the fp8fix CLI (each with
`--verify`), loads the outputs the way runtimes do, and multiplies with
`torch._scaled_mm`, which on Hopper runs cuBLASLt's FP8 tensor-core kernels:

- split scales (unfused, per-shard): each shard's output must equal the matching columns
  of the source's fused output, computed from the same FP8 activations;
- per-channel scales (rowwise `_scaled_mm`): the same, through the rowwise kernel;
- requantized fused modules: error against a float64 reference, beside the source's own;
- block FP8 (128x128): unfused shards through the blockwise kernel where torch has it,
  else through dequantized bf16 (reported which);
- e4m3fn -> e4m3fnuz: codes times scales, dequantized on the device, equal the source's;
- stacked MoE experts: per-expert matmuls with the split [E, 2] scales equal the source's.

Prints one line per check and writes a JSON summary; exits 1 if a check fails.
Runs on the CPU too (torch has a CPU `_scaled_mm`), far slower:

    python scripts/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.builders import FORMATS, FP8_MAX, build, phi3, quantize  # noqa: E402

FORMATS["block-fp8-128"] = replace(FORMATS["block-fp8"], block=(128, 128))
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
# Phi-3-medium-like attention (kv heads < heads, so q, k and v differ in size), Phi-3-mini MLP
HIDDEN, HEADS, KV_HEADS, INTER, TOKENS = 3072, 24, 8, 8192, 256
RESULTS: list[dict[str, Any]] = []


def convert(src: Path, out: Path, *args: str) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), "--verify", "-q", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    return time.perf_counter() - start


def load(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).to(DEV)
    return tensors


def record(check: str, ok: bool, **facts: Any) -> None:
    RESULTS.append({"check": check, "ok": ok, **facts})
    shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in facts.items())
    print(f"{'ok  ' if ok else 'FAIL'} {check}: {shown}", flush=True)


def activations(k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 activations quantized per tensor, as vLLM's dynamic activation scheme does."""
    x = torch.randn(TOKENS, k, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.bfloat16)
    scale = (x.float().abs().max() / FP8_MAX).reshape(())
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T on the FP8 tensor cores; w is [out, in] FP8; sw a scalar or [out] (rowwise)."""
    sw, w = sw.float().to(DEV).clone(), w.contiguous()  # cuBLASLt: aligned scale, column-major second operand
    if sw.numel() == 1:
        return torch._scaled_mm(xq, w.t(), scale_a=sx.float(), scale_b=sw.reshape(()), out_dtype=torch.bfloat16)
    sa = sx.float().reshape(1, 1).expand(xq.shape[0], 1).contiguous()
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16)


def shard_rows() -> dict[str, list[tuple[str, int]]]:
    head_dim = HIDDEN // HEADS
    return {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", HEADS * head_dim),
            ("self_attn.k_proj", KV_HEADS * head_dim),
            ("self_attn.v_proj", KV_HEADS * head_dim),
        ],
        "mlp.gate_up_proj": [("mlp.gate_proj", INTER), ("mlp.up_proj", INTER)],
    }


def compare(check: str, got: torch.Tensor, ref: torch.Tensor, **facts: Any) -> None:
    diff = (got.float() - ref.float()).abs().max().item()
    record(check, diff == 0.0, bit_identical=bool(torch.equal(got, ref)), max_abs_diff=diff, **facts)


def check_split(work: Path, scale: str) -> None:
    """Single-scale (or per-channel) fused source -> unfused and per-shard outputs through real matmuls."""
    src = build(work / f"src-{scale}", model(), scale=scale, files=2, static_input=False)
    layouts = ("unfused", "per-shard") if scale == "tensor" else ("unfused",)
    for layout in layouts:
        out = work / f"{scale}-{layout}"
        seconds = convert(src, out, "--layout", layout)
        s, o = load(src), load(out)
        for fused, shards in shard_rows().items():
            name = f"model.layers.0.{fused}"
            xq, sx = activations(s[name + ".weight"].shape[1])
            ref = mm(xq, sx, s[name + ".weight"], s[name + ".weight_scale"])
            col = 0
            for i, (unfused, rows) in enumerate(shards):
                if layout == "unfused":
                    part = f"model.layers.0.{unfused}"
                    got = mm(xq, sx, o[part + ".weight"], o[part + ".weight_scale"])
                else:
                    got = mm(xq, sx, o[name + ".weight"][col : col + rows], o[name + ".weight_scale"][i])
                compare(f"{scale} scale, {layout}: {fused} shard {i}", got, ref[:, col : col + rows], convert_s=seconds)
                col += rows


def check_requantized(work: Path) -> None:
    """Per-shard scales -> fused (requantized to the max): the codes are the documented formula's, computed
    here on the device (float32 code x scale / max scale, clamp, round to nearest even), the matmul through
    them bit-identical; its error against float64 is reported beside the source's own."""
    src = build(work / "src-shard", model(), scale="shard", files=1, static_input=False)
    out = work / "shard-fused"
    convert(src, out, "--layout", "fused")
    s, o = load(src), load(out)
    for fused, shards in shard_rows().items():
        name = f"model.layers.0.{fused}"
        w, scales = s[name + ".weight"], s[name + ".weight_scale"].float()
        xq, sx = activations(w.shape[1])
        rows = torch.tensor([r for _, r in shards], device=DEV)
        row_scales = scales.repeat_interleave(rows).reshape(-1, 1)
        top = scales.max()
        expected = ((w.float() * row_scales) / top).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        differing = int((expected.view(torch.uint8) != o[name + ".weight"].view(torch.uint8)).sum())
        truth = (xq.double() * sx.double()) @ (w.double() * row_scales.double()).t()
        cols, src_out = 0, []
        for i, (_, r) in enumerate(shards):
            src_out.append(mm(xq, sx, w[cols : cols + r], scales[i]))
            cols += r
        fused_out = mm(xq, sx, o[name + ".weight"], o[name + ".weight_scale"])
        same = bool(torch.equal(fused_out, mm(xq, sx, expected, top)))
        record(
            f"requantized fused: {fused}",
            differing == 0 and same and torch.equal(o[name + ".weight_scale"].float(), top),
            codes_off_formula=differing,
            matmul_bit_identical=same,
            source_rel_err=rel_error(torch.cat(src_out, dim=1), truth),
            fused_rel_err=rel_error(fused_out, truth),
        )


def rel_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return ((got.double() - truth).norm() / truth.norm()).item()


def check_block(work: Path) -> None:
    """Block FP8 (128x128 weight blocks) -> unfused: shards through the blockwise kernel (or bf16)."""
    src = build(work / "src-block", model(), fmt="block-fp8-128", files=1, static_input=False, kv_scales=False)
    out = work / "block-unfused"
    convert(src, out, "--layout", "unfused")
    s, o = load(src), load(out)
    for fused, shards in shard_rows().items():
        name = f"model.layers.0.{fused}"
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
        ref, how = block_mm(x, s[name + ".weight"], s[name + ".weight_scale_inv"])
        col = 0
        for i, (unfused, rows) in enumerate(shards):
            part = f"model.layers.0.{unfused}"
            got, _ = block_mm(x, o[part + ".weight"], o[part + ".weight_scale_inv"])
            compare(f"block 128x128, unfused: {fused} shard {i}", got, ref[:, col : col + rows], kernel=how)
            col += rows


def block_mm(x: torch.Tensor, w: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, str]:
    """DeepSeek-style: activations 1x128 per token, weights 128x128 blocks; cuBLASLt blockwise where torch
    exposes it (checked against the dequantized product), else the dequantized bf16 product."""
    k = x.shape[1]
    xa = x.float().reshape(x.shape[0], k // 128, 128)
    sa = xa.abs().amax(dim=2) / FP8_MAX
    xq = (xa / sa[:, :, None]).to(FP8).reshape(x.shape[0], k)
    wd = w.float() * grid.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    xd = xq.float().reshape(x.shape[0], k // 128, 128) * sa[:, :, None]
    emulated = (xd.reshape(x.shape[0], k) @ wd.t()).to(torch.bfloat16)
    if DEV.type == "cuda":  # the scale layouts torch versions have asked for, each checked against emulation
        outer_major = sa.t().contiguous().t()
        for scale_a, scale_b in ((outer_major, grid.float().t()), (outer_major, grid.float()), (sa, grid.float())):
            try:
                native = torch._scaled_mm(
                    xq, w.contiguous().t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
                )
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                continue
            if rel_error(native, emulated.double()) < 1e-2:
                return native, "cublaslt-blockwise"
    return emulated, "dequantized-bf16"


def check_fnuz(work: Path) -> None:
    """fn -> fnuz: every weight's value (code x scale, decoded on the device) equals the source's."""
    src = work / "tensor-unfused"
    out = work / "tensor-fnuz"
    convert(src, out, "--to", "e4m3fnuz")
    s, o = load(src), load(out)
    worst, weights = 0.0, 0
    for name, t in o.items():
        if t.dtype != torch.float8_e4m3fnuz:
            continue
        module = name.rsplit(".", 1)[0]
        before = s[name].float() * s[module + ".weight_scale"].float().reshape(-1, 1)
        after = t.float() * o[module + ".weight_scale"].float().reshape(-1, 1)
        worst = max(worst, (before - after).abs().max().item())
        weights += 1
    record(
        "e4m3fn -> e4m3fnuz: dequantized on the device",
        worst == 0.0 and weights > 0,
        weights=weights,
        max_abs_diff=worst,
    )
    back = work / "tensor-fnuz-fn"
    convert(out, back, "--to", "e4m3fn")
    b = load(back)
    same = all(torch.equal(b[n].float(), s[n].float()) for n in s if s[n].dtype == FP8)  # -0 came back as +0
    record("e4m3fnuz -> e4m3fn round trip: codes by value", same)


def check_experts(work: Path, experts: int = 8, hidden: int = 1024, inter: int = 1536) -> None:
    """Llama-4-style stacked experts with one scale per expert -> per-shard [E, 2], per-expert matmuls."""
    gen = torch.Generator().manual_seed(5)
    src = work / "src-experts"
    src.mkdir()
    w = torch.cat([torch.randn(experts, hidden, inter, generator=gen) * m for m in (0.02, 0.3)], dim=2)
    scale = w.abs().amax(dim=(1, 2)) / FP8_MAX
    name = "language_model.model.layers.0.feed_forward.experts.gate_up_proj"
    tensors = {name: quantize(w, scale.reshape(-1, 1, 1)), name + "_scale": scale}
    save_file(tensors, str(src / "model.safetensors"), {"format": "pt"})
    text = {"hidden_size": hidden, "intermediate_size": inter, "num_local_experts": experts}
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    }
    (src / "config.json").write_text(json.dumps(config))
    out = work / "experts-per-shard"
    convert(src, out, "--layout", "per-shard")
    s, o = load(src), load(out)
    xq, sx = activations(hidden)
    worst, identical = 0.0, True
    for e in range(experts):
        ref = mm(xq, sx, s[name][e].t(), s[name + "_scale"][e])  # [H, 2I] stored in x out: out rows are its columns
        for j in range(2):
            got = mm(xq, sx, o[name][e][:, j * inter : (j + 1) * inter].t(), o[name + "_scale"][e, j])
            part = ref[:, j * inter : (j + 1) * inter]
            worst = max(worst, (got.float() - part.float()).abs().max().item())
            identical &= bool(torch.equal(got, part))
    record(
        "stacked experts, per-shard [E, 2]: per-expert gate/up matmuls",
        worst == 0.0,
        experts=experts,
        bit_identical=identical,
        max_abs_diff=worst,
    )


def model():  # type: ignore[no-untyped-def]
    return phi3(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=INTER, layers=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON summary here")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        check_split(work, "tensor")
        check_split(work, "channel")
        check_requantized(work)
        check_block(work)
        check_fnuz(work)
        check_experts(work)
    summary = {
        "device": device,
        "torch": torch.__version__,
        "seconds": time.perf_counter() - start,
        "failed": sum(not r["ok"] for r in RESULTS),
        "checks": RESULTS,
    }
    print(f"{len(RESULTS) - summary['failed']}/{len(RESULTS)} checks passed in {summary['seconds']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()

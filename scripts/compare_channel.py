"""What the real loaders compute with, per layout, when a fused module's shards carry different scales.

Builds a Phi-3-shaped compressed-tensors FP8 checkpoint whose fused `qkv_proj` /
`gate_up_proj` carry one scale per shard (as exporters that quantize q/k/v separately
write them),
converts it with `--layout unfused`, `fused` and `channel`, loads each through the real
loaders (the harnesses of tests/loaders: vLLM's CPU build and transformers, in their
own venvs; `eval "$(bash scripts/setup_loader_venvs.sh)"` sets FP8FIX_VLLM_PYTHON and
FP8FIX_TRANSFORMERS_PYTHON), and compares the weights each loader ends up with against
the true values dequantized from SOURCE: how many fused-module weights differ, and the
worst difference in fp8 steps at the module's largest shard scale (the grid requantizing
puts it on). transformers computes in the model's bf16, so its weights are compared
with the true values rounded to bf16.

    python scripts/compare_channel.py            # docs/layouts.md: the comparison table
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fp8fix.numerics.dtypes import E4M3FN  # noqa: E402
from fp8fix.numerics.fp8 import steps_at  # noqa: E402
from tests.builders import Model, build, phi3  # noqa: E402
from tests.loaders.conftest import run_loader  # noqa: E402
from tests.loaders.test_real_loaders import as_loaded, true_weights  # noqa: E402

LAYOUTS = ("unfused", "fused", "channel")
FUSED = ("qkv_proj", "gate_up_proj")


def steps(got: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|got - truth| in fp8 (e4m3fn) steps at `scale`: the module's largest shard scale, the grid that
    requantizing (by the runtime or by `--layout fused`) puts every row on."""
    return (got - truth).abs() / (steps_at(truth / scale, E4M3FN) * scale)


def row_scales(folder: Path, model: Model) -> dict[str, torch.Tensor]:
    """SOURCE's scale of every row of every FP8 layer ([rows, 1]), by the builder's shard row counts."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for name, w in tensors.items():
        if name.endswith(".weight") and w.dtype == torch.float8_e4m3fn:
            module = name.removesuffix(".weight")
            scale = tensors[module + ".weight_scale"].float().reshape(-1)  # [] / [1] per tensor, [n] per shard
            counts = next((f.rows for f in model.fused if module.endswith(f.suffix)), [w.shape[0]])
            if scale.numel() == 1:
                scale = scale.expand(len(counts))
            out[module] = torch.cat([scale[i].expand(n) for i, n in enumerate(counts)]).reshape(-1, 1)
    return out


def main() -> None:
    missing = [v for v in ("FP8FIX_VLLM_PYTHON", "FP8FIX_TRANSFORMERS_PYTHON") if not os.environ.get(v)]
    if missing:
        raise SystemExit(f'{", ".join(missing)} not set: eval "$(bash scripts/setup_loader_venvs.sh)"')
    model = phi3(hidden=256, heads=8, kv_heads=4, intermediate=512, layers=2)
    model.config.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # as loader_model does
    with tempfile.TemporaryDirectory(prefix="fp8fix-channel-") as work:
        root = Path(work)
        src = build(root / "src", model, fmt="compressed-tensors", scale="shard")
        truth = true_weights(src, model)
        scales = row_scales(src, model)
        folders = {"source (per-shard scales)": src}
        for layout in LAYOUTS:
            out = root / layout
            cmd = [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), "--layout", layout, "-q"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            folders[f"--layout {layout}"] = out
        rows = ["| checkpoint | loader | loads | fused-module weights that differ | worst error (fp8 steps) |"]
        rows.append("|---|---|---|---|---|")
        for loader in ("vllm", "transformers"):
            results = run_loader(loader, list(folders.values()), root / f"loaded-{loader}")
            for name, result in zip(folders, results, strict=True):
                if not result.loaded:
                    rows.append(f"| {name} | {loader} | no: {result.error[:80]} | - | - |")
                    continue
                differ, total, worst = 0, 0, 0.0
                packed_scales = as_loaded(scales, result.weights)
                for module, expected in as_loaded(truth, result.weights).items():
                    if not module.endswith(FUSED):
                        continue
                    got, row_scale = result.weights[module], packed_scales[module]
                    if loader == "transformers":  # it computes in the model's bf16: compare there
                        expected = expected.to(torch.bfloat16).float()
                    differ += int((got != expected).sum())
                    total += got.numel()
                    worst = max(worst, float(steps(got, expected, row_scale.max()).max()))
                rows.append(f"| {name} | {loader} | yes | {differ:,} of {total:,} | {worst:.3f} |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()

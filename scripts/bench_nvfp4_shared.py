#!/usr/bin/env python3
"""`fp8fix convert` of NVFP4 whose packed projections' global scales differ (each packed layer given one global
scale: `fp8fix/plan/fp4_shared.py`, issue 49) side by side with the naive per-tensor torch rewrite.

The checkpoint is `scripts/bench_bf16.py`'s compressed-tensors NVFP4 one (random nibbles, e4m3 scales 2^-3 - 2^3,
MLPs of gate / up / down, one a shard) with each up_proj's global scale 1.37 times gate_proj's (its scales with it:
the same values), so every up_proj is moved to gate_proj's multiplier by a ratio of 1 / 1.37 and every other tensor
is copied. The naive contender loads each shard whole with safetensors and, per tensor, decodes the nibbles, rounds
s x ratio to the nearest e4m3fn with torch's cast and each element e2m1 x s x ratio / c to the nearest E2M1
(`torch.bucketize` on the midpoints, ties up) in float32, packs the nibbles and saves the shard; fp8fix also weighs
the other e4m3fn neighbour of each group's scale and keeps whichever errs less, so some bytes differ (counted).
Reported as in bench_bf16.py: medians of `--repeats` rounds in one rotation, the ratio to torch's and to `cp -r` of
OUTPUT, output bytes per wall and user-CPU second (all of OUTPUT; a third of it rewritten), peak RSS.

    python scripts/bench_nvfp4_shared.py --size-gb 0.5 --repeats 3
    python scripts/bench_nvfp4_shared.py --size-gb 0.5 --repeats 5 --baseline /tmp/fp8fix-main
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_bf16 import ENV, ROOT, bench_arguments, print_table, rotate  # noqa: E402

#: Each up_proj's global scale over gate_proj's in the benchmark's checkpoint.
FACTOR = 1.37

#: Per shard: up_proj's global scale (and its e4m3 scales) multiplied by FACTOR, every value as it was but where a
#: scale leaves e4m3fn's grid (the checkpoint's own rounding; both contenders start from these bytes).
SKEW = f"""
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
for path in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    state = load_file(path)
    for name in [n for n in state if n.endswith("up_proj.weight_global_scale")]:
        module = name.removesuffix(".weight_global_scale")
        state[name] = state[name] * {FACTOR}
        scale = state[module + ".weight_scale"].to(torch.float32) * {FACTOR}
        state[module + ".weight_scale"] = scale.clamp(max=448).to(torch.float8_e4m3fn)
    save_file(state, str(path), metadata={{"format": "pt"}})
"""

#: The naive per-tensor rewrite: each packed layer (gate / up) at its largest multiplier, nearest scale, nearest E2M1.
TORCH_SHARED = """
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
torch.set_num_threads(1)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
for path in sorted(src.glob("*.safetensors")):
    state = load_file(path)
    new = dict(state)
    for name in [n for n in state if n.endswith("up_proj.weight_packed")]:
        up = name.removesuffix(".weight_packed")
        gate = up.removesuffix("up_proj") + "gate_proj"
        g_up, g_gate = float(state[up + ".weight_global_scale"]), float(state[gate + ".weight_global_scale"])
        shared = min(g_up, g_gate)
        if g_up == shared:
            continue
        ratio = shared / g_up
        w = state[name]
        rows = w.shape[0]
        nibbles = torch.stack((w & 0x0F, w >> 4), dim=-1).reshape(rows, -1).long()
        s = state[up + ".weight_scale"].to(torch.float32)
        target = s * ratio
        c = target.to(torch.float8_e4m3fn)
        exact = e2m1[nibbles] * target.repeat_interleave(16, 1)
        q = exact / c.to(torch.float32).repeat_interleave(16, 1)
        magnitude = torch.bucketize(q.abs().clamp(max=6.0), mids)
        new_nibbles = (magnitude | torch.where(q < 0, 8, 0)).to(torch.uint8)
        new[name] = (new_nibbles[:, 0::2] | (new_nibbles[:, 1::2] << 4)).contiguous()
        new[up + ".weight_scale"] = c
        new[up + ".weight_global_scale"] = state[gate + ".weight_global_scale"].clone()
    save_file(new, str(out / path.name), metadata={"format": "pt"})
    del state, new
for f in ("config.json", "model.safetensors.index.json"):
    shutil.copy(src / f, out / f)
"""


def differing_bytes(a: Path, b: Path) -> tuple[int, int]:
    """(bytes that differ, bytes compared) between the packed weights and scales of two outputs."""
    import torch
    from safetensors import safe_open

    differ = total = 0
    for path in sorted(a.glob("*.safetensors")):
        with safe_open(path, "pt") as fa, safe_open(b / path.name, "pt") as fb:
            for name in fa.keys():
                x, y = fa.get_tensor(name).view(torch.uint8), fb.get_tensor(name).view(torch.uint8)
                differ += int((x != y).sum())
                total += x.numel()
    return differ, total


def main() -> int:
    args = bench_arguments(__doc__).parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8fix-bench-nvfp4-shared-"))
    src = work / "src-nvfp4-skewed"
    if not src.exists():  # in children: this process stays small
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; from scripts.bench_bf16 "
            f"import build; build(Path({str(src)!r}), {args.size_gb}, {args.shards}, fp4='nvfp4')"
        )
        subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
        subprocess.run([sys.executable, "-c", SKEW, str(src)], check=True, env=ENV)
    script = work / "torch_nvfp4_shared.py"
    script.write_text(TORCH_SHARED)
    out = work / "out"
    fp8fix = [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), "--jobs", "1", "-q"]
    shutil.rmtree(work / "a", ignore_errors=True)
    subprocess.run([*fp8fix[:5], str(work / "a"), *fp8fix[6:]], check=True, env=ENV)
    ours, naive = "fp8fix convert --jobs 1", "torch shared global scale, per tensor (CPU)"
    contenders = {
        ours: fp8fix,
        "cp -r of OUTPUT": ["cp", "-r", str(work / "a"), str(out)],
        naive: [sys.executable, str(script), str(src), str(out)],
    }
    results = rotate(contenders, out, args.repeats, args.baseline, ours)
    out_bytes = sum(p.stat().st_size for p in (work / "a").glob("*.safetensors"))
    print(f"source: {out_bytes / 1e9:.2f} GB NVFP4 (up_proj at 1 / {FACTOR} of gate_proj's multiplier); medians")
    print_table(results, out_bytes, naive, "torch")
    shutil.rmtree(work / "b", ignore_errors=True)
    subprocess.run([sys.executable, str(script), str(src), str(work / "b")], check=True, env=ENV)
    differ, total = differing_bytes(work / "a", work / "b")
    print(
        f"bytes that differ: {differ} of {total} (fp8fix weighs both e4m3fn neighbours of each group's scale and "
        "rounds in float64, ties to even; torch here takes the nearer, in float32, ties down)"
    )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""`fp8fix convert --blocks mx` (block FP8 -> MXFP8, issue 49) side by side with a naive per-tensor torch
conversion, in one rotation (scripts/bench_bf16.py's checkpoint, timing and table).

The naive contender loads each shard whole with safetensors and, per block-FP8 weight, does what a one-off
script does: dequantize in float32 (code x its block's `weight_scale_inv`), give each 128 x 128 block the power
of two 2^ceil(log2(amax / 448)) (vLLM's and DeepSeek's UE8M0 rule), divide and cast to e4m3fn, write the
exponents + 127 as U8 bytes per 32 elements of a row, and save. fp8fix keeps the codes of blocks whose scale is
a power of two as they are and requantizes the others once (`numerics.ue8m0`). Two checkpoints: scales uniform
in [1e-4, 1e-3) as DeepSeek-V3 ships them (every block requantized), and `--pow2`, the same rounded to powers of
two as UE8M0 checkpoints hold them (DeepSeek-V3.1: every block kept, the exact path).

    python scripts/bench_blocks.py --size-gb 0.5 --repeats 5
    python scripts/bench_blocks.py --size-gb 0.5 --repeats 5 --pow2
    python scripts/bench_blocks.py --size-gb 0.5 --repeats 5 --baseline /tmp/fp8fix-main
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_bf16 import ENV, bench_arguments, naive_script, print_table, rotate  # noqa: E402

#: The naive conversion (see the module docstring), one tensor at a time.
NAIVE = naive_script(
    "_scale_inv",
    """        full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        values = w.to(torch.float32) * full
        blocks = torch.nn.functional.pad(values.abs(), (0, -cols % 128, 0, -rows % 128))
        amax = blocks.reshape(scale.shape[0], 128, scale.shape[1], 128).amax(dim=(1, 3)).clamp(min=1e-4)
        k = torch.ceil(torch.log2(amax / 448.0))
        p = torch.exp2(k).repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        new[name] = (values / p).to(torch.float8_e4m3fn)
        new[name[: -len("weight")] + "weight_scale"] = (
            (k + 127).to(torch.uint8).repeat_interleave(128, 0)[:rows].repeat_interleave(4, 1)[:, : cols // 32]
        ).contiguous()""",
    'config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp8-quantized"}',
)


def differing_values(a: Path, b: Path) -> tuple[int, int]:
    """(values that differ, values compared) between the MXFP8 weights of two outputs (code x 2^(b - 127))."""
    import torch
    from safetensors import safe_open

    differ = total = 0
    for path in sorted(a.glob("*.safetensors")):
        with safe_open(path, "pt") as fa, safe_open(b / path.name, "pt") as fb:
            for name in [n for n in fa.keys() if n.endswith(".weight_scale")]:
                weight = name.removesuffix("_scale")
                x, y = (
                    f.get_tensor(weight).to(torch.float64)
                    * torch.exp2(f.get_tensor(name).to(torch.float64) - 127).repeat_interleave(32, 1)
                    for f in (fa, fb)
                )
                differ += int((x != y).sum())
                total += x.numel()
    return differ, total


def main() -> int:
    parser = bench_arguments(__doc__)
    parser.add_argument("--pow2", action="store_true", help="every block scale a power of two (the exact path)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8fix-bench-blocks-"))
    src = work / ("src-pow2" if args.pow2 else "src")
    if not src.exists():  # in a child: this process stays small, and its children's peak RSS starts from it
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; from scripts.bench_bf16 "
            f"import build; build(Path({str(src)!r}), {args.size_gb}, {args.shards}, pow2={args.pow2})"
        )
        subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
    script = work / "naive_block_to_mx.py"
    script.write_text(NAIVE)
    out = work / "out"
    fp8fix = [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), "--blocks", "mx", "--jobs", "1", "-q"]
    shutil.rmtree(work / "a", ignore_errors=True)
    subprocess.run([*fp8fix[:5], str(work / "a"), *fp8fix[6:]], check=True, env=ENV)
    ours, naive = "fp8fix convert --blocks mx --jobs 1", "naive torch, per tensor (CPU)"
    contenders = {
        ours: fp8fix,
        naive: [sys.executable, str(script), str(src), str(out)],
        "cp -r of OUTPUT": ["cp", "-r", str(work / "a"), str(out)],
    }
    results = rotate(contenders, out, args.repeats, args.baseline, ours)
    out_bytes = sum(p.stat().st_size for p in (work / "a").glob("*.safetensors"))
    source_gb = sum(p.stat().st_size for p in src.iterdir()) / 1e9
    kind = "power-of-two" if args.pow2 else "F32 (not powers of two)"
    print(f"source: {source_gb:.2f} GB block FP8, {kind} scales; output {out_bytes / 1e9:.2f} GB MXFP8; medians of "
          f"{args.repeats}")  # fmt: skip
    print_table(results, out_bytes, naive, "naive")
    shutil.rmtree(work / "b", ignore_errors=True)
    subprocess.run([sys.executable, str(script), str(src), str(work / "b")], check=True, env=ENV)
    differ, total = differing_values(work / "a", work / "b")
    report = json.loads((work / "a" / "config.json").read_text())["quantization_config"]["format"]
    print(f"values that differ from the naive conversion's: {differ} of {total} ({differ / max(total, 1):.2e}); "
          f"fp8fix's config format: {report}")  # fmt: skip
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""`fp8fix convert --to bf16` side by side with DeepSeek's `inference/fp8_cast_bf16.py` algorithm (issue 28).

DeepSeek's script loads each shard whole with safetensors, multiplies every block-FP8 weight by its
`weight_scale_inv` block in float32 (its Triton kernel `weight_dequant_kernel`: `y = x * s`, stored as
the default dtype, bfloat16) and saves the shard. Its kernel needs a GPU, so it is reimplemented here on
the CPU with torch, the same arithmetic (a float32 product, then a cast to bfloat16). Both run on a
block-FP8 checkpoint of real headers, normal weights quantized per 128x128 block with float32 scales
that are not powers of two (as DeepSeek-V3 ships), alternating, `--repeats` rounds; reported: median wall
time, the ratio to DeepSeek's algorithm and to `cp -r` of an output-sized folder, output GB/s, peak RSS,
and how many values differ between the two outputs (DeepSeek's float32 product rounds before the BF16
cast: a double rounding fp8fix does not do).

The user CPU seconds column is the per-core compute (one process, one thread each); the system seconds
are mostly the kernel's page-cache writes, which `cp -r` of the output pays too (on these machines they
vary 0.2-2.5 s per GB written from run to run, so compare within one run). `--baseline` times another
fp8fix checkout in the same rotation ("[before]").

    python scripts/bench_bf16.py                    # 2 GB of FP8 weights (4 GB of BF16 out), 3 rounds
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 1
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 9 --baseline /tmp/fp8fix-main
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 9 --tp-bf16 32   # attention in heads of 64, --tp-bf16
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 5 --mx   # compressed-tensors MXFP8 (issue 49)
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 5 --fp4 nvfp4   # compressed-tensors NVFP4 (or mxfp4)
    python scripts/bench_bf16.py --size-gb 0.5 --repeats 5 --fp4 gpt-oss   # gpt-oss's stacked MXFP4 experts

`--mx`: the checkpoint is compressed-tensors MXFP8 (e4m3fn codes, one E8M0 byte per 32 elements of a row, U8),
and the naive contender decodes each tensor whole with torch, as compressed-tensors' MXFP8 decompression does
(codes in float32 times 2^(b - 127) repeated over each block, cast to bfloat16): exact too, so no value may
differ.

`--fp4 nvfp4` / `mxfp4`: compressed-tensors NVFP4 (packed E2M1, an e4m3 scale per 16 and an F32 global scale) or
MXFP4 (an E8M0 byte per 32); the naive contender decodes each tensor whole with torch as compressed-tensors'
decompression does (nibbles through the E2M1 table, times the scale divided by the global scale, in float32, cast to
bfloat16: NVFP4 rounds there up to three times where fp8fix rounds once, so a few values may differ).

`--fp4 gpt-oss`: gpt-oss's MXFP4 experts (`<proj>_blocks` [experts, out, in / 32, 16], E8M0 `<proj>_scales`), 8
experts a layer; the naive contender is transformers' dequantization (integrations/mxfp4.py
convert_moe_packed_tensors: nibbles through the E2M1 table in bfloat16, ldexp by b - 127, each expert transposed),
per tensor: exact, so no value may differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 128
HIDDEN = 2048
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

#: A per-tensor torch conversion, as the naive tools write it: per shard, load whole, rewrite every weight that has
#: a SUFFIX scale (BODY: `new` entries from `name`, `w`, `scale`, `rows`, `cols`), drop the scales, save; then
#: config.json (CONFIG, on `config`). `naive_script` fills it in.
NAIVE_LOOP = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
torch.set_num_threads(1)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
for path in sorted(src.glob("*.safetensors")):
    state = load_file(path)
    new = {}
    for name, w in state.items():
        if name.endswith("SUFFIX"):
            continue
        scale = state.get(name + "SUFFIX")
        if scale is None:
            new[name] = w
            continue
        rows, cols = w.shape
BODY
    save_file(new, str(out / path.name), metadata={"format": "pt"})
    del state, new
config = json.loads((src / "config.json").read_text())
CONFIG
(out / "config.json").write_text(json.dumps(config))
"""


def naive_script(suffix: str, body: str, config: str) -> str:
    """NAIVE_LOOP with its scale suffix, its per-weight body (lines indented 8 spaces) and config edit."""
    return NAIVE_LOOP.replace("SUFFIX", suffix).replace("BODY", body).replace("CONFIG", config)


def dequantize_script(suffix: str, scales: str) -> str:
    """The per-tensor dequantization: each weight times its scale expanded to its shape (`scales`, an expression
    of `scale`, `rows`, `cols`) in float32, cast to bfloat16; the quantization config dropped."""
    body = f"        new[name] = (w.to(torch.float32) * ({scales})).to(torch.bfloat16)"
    return naive_script(suffix, body, 'config.pop("quantization_config", None)')


#: DeepSeek's fp8_cast_bf16.py, its kernel's arithmetic on the CPU: each 128 x 128 block times its
#: weight_scale_inv (a float32 product, cast to bfloat16).
DEEPSEEK = dequantize_script("_scale_inv", "scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]")
#: The naive MXFP8 decode (compressed-tensors' MXFP8 decompression): codes times 2^(b - 127) of their block.
TORCH_MX = dequantize_script("_scale", "torch.exp2(scale.to(torch.float32) - 127).repeat_interleave(32, 1)")


#: The naive FP4 decode (compressed-tensors' NVFP4 / MXFP4 decompression, compressors/nvfp4): per tensor, the
#: nibbles (lower first) through the E2M1 table, times scale / global scale in float32, cast to bfloat16.
TORCH_FP4 = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
torch.set_num_threads(1)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
for path in sorted(src.glob("*.safetensors")):
    state = load_file(path)
    new = {}
    for name, w in state.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith(("_scale", "_global_scale")):
                new[name] = w
            continue
        module = name.removesuffix(".weight_packed")
        rows = w.shape[0]
        nibbles = torch.stack((w & 0x0F, w >> 4), dim=-1).reshape(rows, -1).long()
        scale = state[module + ".weight_scale"]
        if scale.dtype == torch.uint8:
            per = torch.exp2(scale.to(torch.float32) - 127)
        else:
            per = scale.to(torch.float32) / state[module + ".weight_global_scale"]
        group = nibbles.shape[1] // scale.shape[1]
        new[module + ".weight"] = (e2m1[nibbles] * per.repeat_interleave(group, 1)).to(torch.bfloat16)
    save_file(new, str(out / path.name), metadata={"format": "pt"})
    del state, new
config = json.loads((src / "config.json").read_text())
config.pop("quantization_config", None)
(out / "config.json").write_text(json.dumps(config))
"""


#: transformers' gpt-oss dequantization (integrations/mxfp4.py convert_moe_packed_tensors), per tensor.
TORCH_GPT_OSS = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
torch.set_num_threads(1)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
lut = lut.to(torch.bfloat16)
for path in sorted(src.glob("*.safetensors")):
    state = load_file(path)
    new = {}
    for name, w in state.items():
        if not name.endswith("_blocks"):
            if not name.endswith("_scales"):
                new[name] = w
            continue
        param = name.removesuffix("_blocks")
        exponents = state[param + "_scales"].to(torch.int32) - 127
        experts, rows, groups, _ = w.shape
        values = torch.empty(experts, rows, groups, 32, dtype=torch.bfloat16)
        values[..., 0::2] = lut[(w & 0x0F).long()]
        values[..., 1::2] = lut[(w >> 4).long()]
        values = torch.ldexp(values, exponents[..., None]).to(torch.bfloat16)
        new[param] = values.reshape(experts, rows, groups * 32).transpose(1, 2).contiguous()
    save_file(new, str(out / path.name), metadata={"format": "pt"})
    del state, new
config = json.loads((src / "config.json").read_text())
config.pop("quantization_config", None)
(out / "config.json").write_text(json.dumps(config))
"""
#: gpt-oss's experts a layer in `--fp4 gpt-oss`.
GPT_OSS_EXPERTS = 8


def build(
    root: Path,
    size_gb: float,
    shards: int,
    attention: bool = False,
    mx: bool = False,
    pow2: bool = False,
    fp4: str | None = None,
) -> None:
    """Block-FP8 layers, `size_gb` of FP8 codes in all, scales uniform in [1e-4, 1e-3) (`pow2`: each rounded
    to a power of two, as UE8M0 checkpoints hold them): MLPs, one per shard; or (`attention`) q / k / v / o of
    2048 x 2048 in heads of 64, the layers spread over the shards, for `--tp 32 --tp-bf16` (32 heads: 64 rows
    a rank, not whole 128-blocks, so they are written in BF16)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    inter = int(size_gb * 1e9 / shards / (3 * HIDDEN)) // BLOCK * BLOCK
    gen = torch.Generator().manual_seed(0)
    attention_layers = max(shards, round(size_gb * 1e9 / (4 * HIDDEN * HIDDEN)))
    layers = attention_layers if attention else shards
    weight_map = {}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        shard = layer * shards // layers
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        square = (HIDDEN, HIDDEN)
        modules = (
            {f"self_attn.{m}_proj": square for m in "qkvo"}
            if attention
            else {"mlp.gate_proj": (inter, HIDDEN), "mlp.up_proj": (inter, HIDDEN), "mlp.down_proj": (HIDDEN, inter)}
        )
        if fp4 == "gpt-oss":  # one layer's experts: E8M0 bytes 2^-11 - 2^-4, random nibbles
            per = inter // GPT_OSS_EXPERTS // BLOCK * BLOCK
            for proj, (rows, cols) in (("gate_up_proj", (2 * per, HIDDEN)), ("down_proj", (HIDDEN, per))):
                prefix = f"model.layers.{layer}.mlp.experts.{proj}"
                shape = (GPT_OSS_EXPERTS, rows, cols // 32)
                tensors[f"{prefix}_blocks"] = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
                tensors[f"{prefix}_scales"] = torch.randint(116, 124, shape, generator=gen, dtype=torch.uint8)
            modules = {}
        for module, (rows, cols) in modules.items():
            if fp4:  # random nibbles; NVFP4 e4m3 scales 2^-3 - 2^3 under a global scale, MXFP4 E8M0 bytes 2^-11 - 2^-4
                prefix = f"model.layers.{layer}.{module}"
                tensors[f"{prefix}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=gen).to(
                    torch.uint8
                )
                if fp4 == "nvfp4":
                    scale_bytes = torch.randint(0x20, 0x58, (rows, cols // 16), generator=gen, dtype=torch.uint8)
                    tensors[f"{prefix}.weight_scale"] = scale_bytes.view(torch.float8_e4m3fn)
                    tensors[f"{prefix}.weight_global_scale"] = torch.tensor([2688.0 / 0.37], dtype=torch.float32)
                else:
                    scale_bytes = torch.randint(116, 124, (rows, cols // 32), generator=gen, dtype=torch.uint8)
                    tensors[f"{prefix}.weight_scale"] = scale_bytes
                continue
            codes = (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[f"model.layers.{layer}.{module}.weight"] = codes
            if mx:  # E8M0 bytes around 2^-7 (weights of 0.01 - 1 at codes of 1 - 448), as U8
                exponents = torch.randint(116, 124, (rows, cols // 32), generator=gen, dtype=torch.uint8)
                tensors[f"model.layers.{layer}.{module}.weight_scale"] = exponents
                continue
            grid = (rows // BLOCK, cols // BLOCK)
            scale = torch.rand(grid, generator=gen) * 9e-4 + 1e-4
            if pow2:
                scale = torch.exp2(torch.round(torch.log2(scale)))
            tensors[f"model.layers.{layer}.{module}.weight_scale_inv"] = scale
        if layer + 1 == layers or (layer + 1) * shards // layers != shard:  # the shard's last layer
            weight_map.update({t: name for t in tensors})
            save_file(tensors, str(root / name), metadata={"format": "pt"})
            tensors = {}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 4096 if attention else inter,  # attention: a size --tp 32 splits whole (no MLP)
        "num_hidden_layers": layers,
        "num_attention_heads": HIDDEN // 64 if attention else 16,
        "num_key_value_heads": HIDDEN // 64 if attention else 16,
        "head_dim": 64 if attention else HIDDEN // 16,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    if fp4 == "gpt-oss":
        config["architectures"], config["model_type"] = ["GptOssForCausalLM"], "gpt_oss"
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    elif fp4:
        from tests.builders import FP4_PRESETS

        fmt, weights, inputs = FP4_PRESETS[fp4]
        group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "format": fmt}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    if mx:
        from tests.builders import MXFP8_ARGS

        group = {"targets": ["Linear"], "weights": MXFP8_ARGS, "format": "mxfp8-quantized"}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp8-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def timed(cmd: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> tuple[float, float, float, float]:
    """Wall seconds, peak RSS (MB), user and system CPU seconds of one child, run in `cwd` (`python -m`
    imports fp8fix from the working folder first)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env or ENV, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024, usage.ru_utime, usage.ru_stime


def rotate(
    contenders: dict[str, list[str]], out: Path, repeats: int, baseline: Path | None = None, ours: str = ""
) -> dict[str, list[tuple[float, float, float, float]]]:
    """Each contender `repeats` times, in a new order each round (none always after the same one), OUTPUT
    removed and the disk synced before each run: `timed`'s figures per contender. `baseline`: another fp8fix
    checkout, whose `ours` command joins the rotation as "[before]"."""
    where = {name: (ROOT, ENV) for name in contenders}
    if baseline:
        before = baseline.resolve()
        contenders = {**contenders, f"{ours} [before]": contenders[ours]}
        where[f"{ours} [before]"] = (before, {**ENV, "PYTHONPATH": str(before)})
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in contenders}
    order = list(contenders)
    for round_ in range(repeats):
        random.Random(round_).shuffle(order)
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=False)
            results[name].append(timed(contenders[name], *where[name]))
    return results


def print_table(
    results: dict[str, list[tuple[float, float, float, float]]], out_bytes: int, reference: str, short: str
) -> None:
    """The Markdown table of medians: each contender beside `reference` (`short` in the header) and `cp -r of
    OUTPUT`, output bytes per wall and per user CPU second, peak RSS."""
    base = statistics.median(r[0] for r in results[reference]) if reference in results else None
    copy = statistics.median(r[0] for r in results["cp -r of OUTPUT"])
    print(
        f"| command | median s | min-max s | x {short}'s | x cp -r of OUTPUT | output GB/s | user CPU s "
        "| output GB per user CPU-s | system CPU s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        walls = [r[0] for r in runs]
        wall, user, system = (statistics.median(r[i] for r in runs) for i in (0, 2, 3))
        rss = max(r[1] for r in runs)
        versus = f"{wall / base:.2f}" if base else "-"
        per_cpu = f"{out_bytes / user / 1e9:.2f}" if user > 0.01 else "-"
        print(
            f"| {name} | {wall:.2f} | {min(walls):.2f}-{max(walls):.2f} | {versus} | {wall / copy:.2f} "
            f"| {out_bytes / wall / 1e9:.2f} | {user:.2f} | {per_cpu} | {system:.2f} | {rss:.0f} |"
        )


def bench_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark here takes: the checkpoint's size and shards, rounds, work folder, baseline."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="FP8 weight bytes of the checkpoint")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, help="work folder [a new temporary one]")
    parser.add_argument("--baseline", type=Path, help="another fp8fix checkout to time in the same rotation")
    return parser


def differing_values(a: Path, b: Path) -> tuple[int, int]:
    """(values that differ, values compared) between the BF16 weights of two outputs."""
    import torch
    from safetensors import safe_open

    differ = total = 0
    for path in sorted(a.glob("*.safetensors")):
        with safe_open(path, "pt") as fa, safe_open(b / path.name, "pt") as fb:
            for name in fa.keys():
                x, y = fa.get_tensor(name), fb.get_tensor(name)
                if x.dtype == torch.bfloat16:
                    differ += int((x.view(torch.int16) != y.view(torch.int16)).sum())
                    total += x.numel()
    return differ, total


def main() -> int:
    parser = bench_arguments(__doc__)
    parser.add_argument(
        "--tp-bf16", type=int, metavar="TP", help="time `convert --tp TP --tp-bf16` on attention layers instead"
    )
    parser.add_argument("--mx", action="store_true", help="a compressed-tensors MXFP8 checkpoint, beside torch")
    parser.add_argument(
        "--fp4", choices=("nvfp4", "mxfp4", "gpt-oss"), help="a compressed-tensors FP4 or gpt-oss MXFP4 checkpoint"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8fix-bench-bf16-"))
    attention = args.tp_bf16 is not None
    src = work / ("src-attention" if attention else "src-mx" if args.mx else f"src-{args.fp4}" if args.fp4 else "src")
    if not src.exists():  # in a child: this process stays small, and its children's peak RSS starts from it
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; from scripts.bench_bf16 "
            f"import build; build(Path({str(src)!r}), {args.size_gb}, {args.shards}, {attention}, {args.mx}, "
            f"fp4={args.fp4!r})"
        )
        subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
    naive = TORCH_GPT_OSS if args.fp4 == "gpt-oss" else TORCH_FP4 if args.fp4 else TORCH_MX if args.mx else DEEPSEEK
    script = work / (
        "torch_fp4_to_bf16.py" if args.fp4 else "torch_mx_to_bf16.py" if args.mx else "deepseek_fp8_cast_bf16.py"
    )
    script.write_text(naive)
    out = work / "out"
    options = ["--tp", str(args.tp_bf16), "--tp-bf16"] if attention else ["--to", "bf16"]
    fp8fix = [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), *options, "--jobs", "1", "-q"]
    # fp8fix's output, kept for cp -r of it (the same bytes written) in the rotation and the value comparison
    shutil.rmtree(work / "a", ignore_errors=True)
    subprocess.run([*fp8fix[:5], str(work / "a"), *fp8fix[6:]], check=True, env=ENV)
    ours = f"fp8fix convert {' '.join(options)} --jobs 1"
    deepseek_name = (
        f"torch {args.fp4.upper()} decode, per tensor (CPU)"
        if args.fp4
        else "torch MXFP8 decode, per tensor (CPU)"
        if args.mx
        else "DeepSeek fp8_cast_bf16 (torch, CPU)"
    )
    contenders = {ours: fp8fix, "cp -r of OUTPUT": ["cp", "-r", str(work / "a"), str(out)]}
    if not attention:  # DeepSeek's script dequantizes every weight: the --to bf16 job only
        contenders[deepseek_name] = [sys.executable, str(script), str(src), str(out)]
    results = rotate(contenders, out, args.repeats, args.baseline, ours)
    out_bytes = sum(p.stat().st_size for p in (work / "a").glob("*.safetensors"))
    source_gb = sum(p.stat().st_size for p in src.iterdir()) / 1e9
    kind = args.fp4.upper() if args.fp4 else "MXFP8" if args.mx else "block FP8"
    print(f"source: {source_gb:.2f} GB {kind}; output {out_bytes / 1e9:.2f} GB; medians of {args.repeats}")
    print_table(results, out_bytes, deepseek_name, "torch" if args.mx or args.fp4 else "DeepSeek")
    if not attention:
        shutil.rmtree(work / "b", ignore_errors=True)
        subprocess.run([sys.executable, str(script), str(src), str(work / "b")], check=True, env=ENV)
        differ, total = differing_values(work / "a", work / "b")
        share = differ / max(total, 1)
        why = (
            "both exact"
            if args.mx or args.fp4 in ("mxfp4", "gpt-oss")
            else "torch's float32 scale / global and product round before the BF16 cast"
            if args.fp4
            else "DeepSeek's float32 product rounds twice"
        )
        print(f"values that differ: {differ} of {total} ({share:.2e}; {why})")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

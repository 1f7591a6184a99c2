#!/usr/bin/env python3
"""Planning time against tensor count (issue 25 H5): header-only commands on one shard of N tensors.

    python scripts/bench_tensor_count.py                            # 10k, 20k, 40k tensors, this checkout
    python scripts/bench_tensor_count.py --baseline ../fp8fix-main   # and another checkout, in the same run
    python scripts/bench_tensor_count.py --counts 10000 40000 --repeats 5
    python scripts/bench_tensor_count.py --counts 100000 --shards 160 --baseline ../fp8fix-main  # DeepSeek-V3-sized
    python scripts/bench_tensor_count.py --shape phi3 --counts 112000 --shards 40 --baseline ../fp8fix-main
    python scripts/bench_tensor_count.py --shape deepseek-v4 --counts 100000 --shards 46   # FP8 + MXFP4 (issue 49)

Each checkpoint is one safetensors file of N/2 tiny e4m3fn weights with their F32 scales (a real header,
real bytes), so the time is fp8fix's own per-tensor work: `inspect --json`, `convert --dry-run` (also with
`--to e4m3fnuz`) and `convert`.
`--shape phi3`: Phi-3-shaped AutoFP8 layers instead (fused qkv_proj and gate_up_proj with one scale each,
every scale its own value), where `--target auto` has 8 candidates to judge; `convert --dry-run --layout
fused` is the single-layout plan the others are measured against.
`--shape deepseek-v4`: DeepSeek-V4-shaped layers (block FP8 attention and shared experts with E8M0 `.scale`
grids, routed experts packed MXFP4, I8 with an E8M0 `.scale` per 32), where `convert --dry-run --to bf16` plans
every module's dequantization.
Checkouts run alternately, round by round (these machines are noisy); the table gives medians and the
ratio of CPU seconds, baseline / this checkout. `scripts/bench_convert.py --suite` runs the 10k / 30k / 100k
series with its other rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


Entry = tuple[str, str, list[int], bytes]  # a tensor: name, safetensors dtype, shape, bytes


def write_shard(path: Path, entries: list[Entry], weight_map: dict[str, str]) -> None:
    """A safetensors file of `entries` in order (a real header, real bytes); each name mapped to it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    body = bytearray()
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
        weight_map[name] = path.name
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(body))


def checkpoint(root: Path, tensors: int, shards: int = 1) -> Path:
    """N tensors (N/2 tiny weights with their scales) over SHARDS files; one shard has no index.

    One shard: AutoFP8 per-tensor `down_proj` weights, one per layer (the issue's 10k-40k series).
    Several shards: a DeepSeek-V3-shaped block-FP8 checkpoint (`weight_scale_inv` grids, per-expert
    gate/up/down in 61 layers), as DeepSeek-V3 (~91k tensors, 163 shards) and Kimi-K2 publish them.
    """
    root.mkdir(parents=True)
    if shards == 1:
        names = [f"model.layers.{i}.mlp.down_proj" for i in range(tensors // 2)]
        scale, quant = "weight_scale", {"quant_method": "fp8", "activation_scheme": "dynamic"}
        layers, scale_shape = len(names), []
    else:
        layers = 61
        experts = -(-tensors // (2 * 3 * layers))
        names = [
            f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
            for layer in range(layers)
            for e in range(experts)
            for proj in ("gate", "up", "down")
        ][: tensors // 2]
        scale, scale_shape = "weight_scale_inv", [1, 1]
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        entries: list[Entry] = []
        for name in names[index * per_shard : (index + 1) * per_shard]:
            entries.append((f"{name}.weight", "F8_E4M3", [4, 4], bytes(16)))
            entries.append((f"{name}.{scale}", "F32", scale_shape, struct.pack("<f", 0.01)))
        write_shard(root / file, entries, weight_map)
    if shards > 1:
        index_text = {"metadata": {"total_size": 20 * len(names)}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index_text))
    config = {
        "architectures": ["LlamaForCausalLM" if shards == 1 else "DeepseekV3ForCausalLM"],
        "hidden_size": 4,
        "num_hidden_layers": layers,
        "quantization_config": quant,
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def phi3_checkpoint(root: Path, tensors: int, shards: int) -> Path:
    """About N tensors of tiny Phi-3 layers (14 tensors each: 4 FP8 linears with weight and input scales, 2
    norms) over SHARDS files, every scale a value of its own, as exporters write them."""
    root.mkdir(parents=True)
    layers = max(2, tensors // 14)
    per_shard = -(-layers // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        entries = [e for layer in range(index * per_shard, min(layers, (index + 1) * per_shard)) for e in _phi3(layer)]
        write_shard(root / file, entries, weight_map)
    index_text = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index_text))
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"},
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def _phi3(layer: int) -> list[Entry]:
    """One Phi-3 layer of hidden size 8 (qkv: 2 heads and 1 kv head of 4; gate_up: 2 x 8 rows)."""
    p = f"model.layers.{layer}."
    found: list[Entry] = []
    for k, (module, rows) in enumerate(
        {"self_attn.qkv_proj": 16, "self_attn.o_proj": 8, "mlp.gate_up_proj": 16, "mlp.down_proj": 8}.items()
    ):
        found.append((f"{p}{module}.weight", "F8_E4M3", [rows, 8], bytes(rows * 8)))
        for j, scale in enumerate(("weight_scale", "input_scale")):
            value = 0.001 + ((layer * 8 + k * 2 + j) % 100_003) * 1e-8  # every scale its own value
            found.append((f"{p}{module}.{scale}", "F32", [], struct.pack("<f", value)))
    found += [(f"{p}{norm}.weight", "BF16", [8], bytes(16)) for norm in ("input_layernorm", "post_attention_layernorm")]
    return found


def deepseek_v4_config(layers: int, experts: int, hidden: int, expert_dtype: str = "fp4") -> dict[str, object]:
    """config.json of a DeepSeek-V4 as DeepSeek ships it (V4-Flash: `expert_dtype: fp4`, block FP8 with UE8M0
    scales; V4-Flash-Base: `fp8`, F32 scales), with this many layers, routed experts and hidden size."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "expert_dtype": expert_dtype,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "n_routed_experts": experts,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            **({"scale_fmt": "ue8m0"} if expert_dtype == "fp4" else {}),
            "weight_block_size": [128, 128],
        },
    }


def deepseek_v4_checkpoint(root: Path, tensors: int, shards: int) -> Path:
    """About N tensors of tiny DeepSeek-V4 layers (61 of them, as V4-Pro has) over SHARDS files: per layer 5 block
    FP8 attention projections and 3 shared-expert ones with their E8M0 `.scale`, and as many routed experts (w1,
    w2, w3 packed E2M1 as I8 [4, 16], an E8M0 `.scale` [4, 1] each) as make up the count."""
    root.mkdir(parents=True)
    layers, fp8 = (
        61,
        (
            "attn.wq_a",
            "attn.wq_b",
            "attn.wkv",
            "attn.wo_a",
            "attn.wo_b",
            "ffn.shared_experts.w1",
            "ffn.shared_experts.w2",
            "ffn.shared_experts.w3",
        ),
    )
    experts = max(1, (tensors // layers - 2 * len(fp8) - 1) // 6)
    per_shard = -(-layers // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        entries: list[Entry] = []
        for layer in range(index * per_shard, min(layers, (index + 1) * per_shard)):
            p = f"layers.{layer}."
            for module in fp8:
                entries += [(f"{p}{module}.weight", "F8_E4M3", [4, 4], bytes(16))]
                entries += [(f"{p}{module}.scale", "F8_E8M0", [1, 1], bytes([120]))]
            for e in range(experts):
                for w in ("w1", "w2", "w3"):
                    entries += [(f"{p}ffn.experts.{e}.{w}.weight", "I8", [4, 16], bytes(64))]
                    entries += [(f"{p}ffn.experts.{e}.{w}.scale", "F8_E8M0", [4, 1], bytes([120] * 4))]
            entries += [(f"{p}ffn.gate.weight", "BF16", [experts, 4], bytes(8 * experts))]
        write_shard(root / f"model-{index + 1:05d}-of-{shards:05d}.safetensors", entries, weight_map)
    index_text = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index_text))
    config = deepseek_v4_config(layers, experts, hidden=4)
    (root / "config.json").write_text(json.dumps(config))
    return root


def timed(checkout: Path, args: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (with its workers) and peak RSS (MB) of one fp8fix command."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()  # cwd too: `python -m` puts the working folder first on sys.path
        proc = subprocess.Popen(
            [sys.executable, "-m", "fp8fix", *args], env=env, cwd=checkout, stdout=subprocess.DEVNULL, stderr=stderr
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise SystemExit(f"{checkout}: fp8fix {' '.join(args)} failed:\n{stderr.read().decode()[-2000:]}")
    # wait4 gives the child's own usage; its --jobs workers are its children, counted by RUSAGE_CHILDREN
    # only once reaped by it, which they are before it exits.
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def series(
    counts: list[int],
    shards_of: dict[int, int],
    repeats: int,
    checkouts: dict[str, Path],
    work: Path,
    shape: str = "auto",
) -> list[str]:
    """The table's rows: for each tensor count, each header-only command, each checkout's medians (alternately)."""
    heads = " | ".join(f"{k}: wall s / CPU s / peak MB" for k in checkouts)
    rows = [
        f"| tensors | shards | command | {heads} | ratio (CPU) |",
        "|---|---|---|" + "---|" * len(checkouts) + "---|",
    ]
    for count in counts:
        shards = shards_of[count]
        make = {"phi3": phi3_checkpoint, "deepseek-v4": deepseek_v4_checkpoint}.get(shape, checkpoint)
        src = make(work / f"n{count}", count, shards)
        out = work / f"n{count}-out"
        dry_run = ["convert", str(src), str(out), "--dry-run", "-q"]
        commands = {
            "inspect --json": ["inspect", str(src), "--json", "-q"],
            "convert --dry-run": dry_run,
            # the single-layout plan `--target auto` is measured against
            **({"convert --dry-run --layout fused": [*dry_run, "--layout", "fused"]} if shape == "phi3" else {}),
            # an encoding change: its candidates are planned with it (issue 47), not sketched
            "convert --dry-run --to e4m3fnuz": [*dry_run, "--to", "e4m3fnuz"],
            # every module dequantized, the FP4 experts too
            **({"convert --dry-run --to bf16": [*dry_run, "--to", "bf16"]} if shape == "deepseek-v4" else {}),
            "convert": ["convert", str(src), str(out), "-q", "--overwrite"],
        }
        for label, command in commands.items():
            runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in checkouts}
            for _ in range(repeats):
                for name, checkout in checkouts.items():  # alternately, round by round
                    runs[name].append(timed(checkout, command))
            medians = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
            ratio = f"{medians['baseline'][1] / medians['this'][1]:.1f}x" if "baseline" in medians else "-"
            cells = " | ".join(f"{m[0]:.2f} / {m[1]:.2f} / {m[2]:.0f}" for m in medians.values())
            rows.append(f"| {count:,} | {shards} | {label} | {cells} | {ratio} |")
            print(rows[-1], file=sys.stderr, flush=True)  # progress: the table is printed at the end
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 20_000, 40_000])
    parser.add_argument("--shards", type=int, default=1, help="files per checkpoint (several: block FP8 + index)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--shape", choices=["auto", "phi3", "deepseek-v4"], default="auto", help="phi3: fused Phi-3 layers"
    )
    parser.add_argument("--baseline", type=Path, help="another fp8fix checkout to time in the same run")
    args = parser.parse_args()
    checkouts = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        shards_of = dict.fromkeys(args.counts, args.shards)
        print("\n".join(series(args.counts, shards_of, args.repeats, checkouts, Path(tmp), args.shape)))


if __name__ == "__main__":
    main()
